//! The recall tier: nothing an eviction removes is lost. Between the scheduler's victim selection
//! and its compaction, every victim's K, V and position are captured into its page list's tier
//! (`evict/capture.wgsl`, `evict/capture_copy.wgsl`), laid out as the pool's raw pages, and each
//! captured key leaves a one-bit-a-dimension digest in device memory (`evict/digest.wgsl`,
//! against its list's centre, calibrated once on the first [`DIGEST_CALIB_TOKENS`] tokens). Before
//! every layer's reduce pass, each list's tier tokens are scored against the layer's queries by
//! their digests, which nominate the best `candidates` pages; those pages' true q.k (their keys
//! read from the tier) choose the `pages` attended over their true keys and values
//! (`attend/recall.wgsl`), one more partial record per query head that the reduce pass merges
//! with the resident pages'. Optionally ([`RecallConfig::with_bound_candidates`]) part of the
//! candidates are nominated first by each tier page's i8 key bounds, kept after the digests.
//!
//! Where the device can read host memory in place (`MAPPABLE_PRIMARY_BUFFERS`, native), the tier
//! lives there: the GPU holds the pool within its budget and the digests (an f16 key's sixteenth,
//! counted in the K/V bytes: [`RecallTier::digest_bytes`]), and a recall reads only the nominated
//! pages' keys and the chosen pages' values over the bus, with no host stop and no copy. Elsewhere (the browser) the tier is
//! device memory: the same answers, no bytes saved, and [`RecallTier::host_memory`] says so.
//! [`RecallTier::set_audit`] has the pass also find the pages the true scores would choose and
//! count the digest's hits ([`DigestAudit`]).

use expertkv_shaders::Kernel;

use crate::append::KvPool;
use crate::attend::Attention;
use crate::error::{Error, Result};
use crate::gpu_data::{TierParams, uncalibrated_digests};
use crate::runtime::dispatch::CountedDispatch;
use crate::runtime::{Runtime, split_workgroups};

/// Most pages recalled per list and layer (`attend/recall.wgsl` keeps their tokens' scores in
/// one workgroup: pages x page size at most 256).
pub const MAX_RECALL_PAGES: u32 = 16;

/// Most tier pages a list may hold (`attend/recall.wgsl`'s workgroup table of page scores).
pub const MAX_TIER_PAGES: u32 = 1024;

/// Most pages the digests nominate per list and layer (`attend/recall.wgsl`'s candidates).
pub const MAX_RECALL_CANDIDATES: u32 = 64;

/// Pages the digests nominate by default: on SmolLM2 (bench/digest_reference.py) one-bit
/// digests alone missed every planted fact, and nominating 32 pages whose true scores then chose
/// 4 found every one.
pub const DEFAULT_RECALL_CANDIDATES: u32 = 32;

/// Query heads per KV head the recall pass handles.
pub const MAX_RECALL_GROUP: u32 = 8;

/// `tier_stats` words: victims dropped past a full tier, victims captured, then the audit's
/// counters ([`DigestAudit`]).
const STATS: u64 = 6;

pub use crate::gpu_data::{DIGEST_CALIB_TOKENS, bound_words};

/// How well the digests chose, over every audited recall pass since the audit was turned on
/// ([`RecallTier::set_audit`]): of the pages the true q.k would recall, how many the digest
/// recalled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DigestAudit {
    /// Recall passes audited (a list with tier pages, at a layer, at a step).
    pub passes: u64,
    /// Passes whose truly best page the digest recalled.
    pub top_hits: u64,
    /// The truly best pages (up to the pages recalled a list), summed over the passes.
    pub want: u64,
    /// ... of which the digest recalled.
    pub hits: u64,
}

impl DigestAudit {
    /// The share of the truly best pages the digest recalled (1 with none audited).
    pub fn recall(&self) -> f64 {
        if self.want == 0 { 1.0 } else { self.hits as f64 / self.want as f64 }
    }

    /// The share of passes whose truly best page the digest recalled (1 with none audited).
    pub fn top_recall(&self) -> f64 {
        if self.passes == 0 { 1.0 } else { self.top_hits as f64 / self.passes as f64 }
    }
}

/// What the recall tier keeps and attends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RecallConfig {
    /// Tier pages attended per list and layer (1..=[`MAX_RECALL_PAGES`]).
    pub pages: u32,
    /// Tier pages nominated per list and layer, among which the true scores choose `pages`
    /// (`pages..=`[`MAX_RECALL_CANDIDATES`]).
    pub candidates: u32,
    /// Of the candidates, how many the tier pages' key bounds nominate (the best upper bounds on
    /// q.k, from an i8 minimum and maximum of every key dimension a page, kept in device memory
    /// beside the digests); the digests nominate the rest. 0: the digests nominate all.
    pub bound_candidates: u32,
    /// Tier tokens per list: the most a list may lose to eviction over a run (rounded up to
    /// whole pages; a victim past it is dropped and counted).
    pub tokens: u32,
}

impl RecallConfig {
    /// `pages` attended a list and layer out of [`DEFAULT_RECALL_CANDIDATES`] nominated (or
    /// `pages`, if more) by the digests, a tier of `tokens` a list.
    pub fn new(pages: u32, tokens: u32) -> RecallConfig {
        RecallConfig { pages, candidates: DEFAULT_RECALL_CANDIDATES.max(pages).min(MAX_RECALL_CANDIDATES), bound_candidates: 0, tokens }
    }

    /// The same, `bound_candidates` of the candidates nominated by the tier pages' key bounds.
    /// Their device bytes (an i8 minimum and maximum a key dimension a page: 8.25 bytes a token
    /// at 16 slots a page and head_dim 64, beside the digests' 8) come out of the same budget;
    /// on SmolLM2 at 10% of the K/V bytes that cost more than the better nomination gained
    /// (H100, 2026-12-07: BENCHMARKS.md, "The recall tier"), so [`RecallConfig::new`] keeps none.
    pub fn with_bound_candidates(self, bound_candidates: u32) -> RecallConfig {
        RecallConfig { bound_candidates, ..self }
    }

    /// Refuse shapes the kernels cannot take, naming the field.
    pub fn validate(&self, page_size: u32, group: u32, head_dim: u32) -> Result<()> {
        if head_dim > 256 {
            return Err(Error::config("head_dim", head_dim, "the recall tier's key digests take head dimensions up to 256"));
        }
        if self.pages == 0 || self.pages > MAX_RECALL_PAGES || self.pages * page_size > 256 {
            return Err(Error::config(
                "recall",
                self.pages,
                format!("pages recalled per list and layer: 1 to {} ({} tokens at most)", MAX_RECALL_PAGES.min(256 / page_size), 256),
            ));
        }
        if self.candidates < self.pages || self.candidates > MAX_RECALL_CANDIDATES {
            return Err(Error::config(
                "recall candidates",
                self.candidates,
                format!("pages the digests nominate: from the pages recalled ({}) to {MAX_RECALL_CANDIDATES}", self.pages),
            ));
        }
        if self.bound_candidates > self.candidates {
            return Err(Error::config(
                "recall bound candidates",
                self.bound_candidates,
                format!("candidates the key bounds nominate: 0 to the candidates ({})", self.candidates),
            ));
        }
        if self.tokens == 0 || self.tokens.div_ceil(page_size) > MAX_TIER_PAGES {
            return Err(Error::config(
                "recall tier",
                self.tokens,
                format!("tokens a list's tier holds: 1 to {} pages of {page_size}", MAX_TIER_PAGES),
            ));
        }
        if group == 0 || group > MAX_RECALL_GROUP {
            return Err(Error::config("group", group, format!("the recall pass takes 1 to {MAX_RECALL_GROUP} query heads per KV head")));
        }
        Ok(())
    }

    /// Tier slots per list: `tokens` rounded up to whole pages.
    pub fn cap(&self, page_size: u32) -> u32 {
        self.tokens.div_ceil(page_size) * page_size
    }

    /// Bytes of the key digests, their calibration and the pages' key bounds (when they
    /// nominate) for `pool`'s lists, in device memory (they count in the GPU's K/V bytes).
    pub fn digest_bytes(&self, pool: &crate::config::PoolConfig) -> u64 {
        u64::from(pool.n_lists()) * self.digest_bytes_per_list(pool.page_size, pool.head_dim)
    }

    /// The same for one list of pages of `page_size` slots and keys of `head_dim`
    /// ([`digest_bytes_per_list`], with the bounds when they nominate).
    pub fn digest_bytes_per_list(&self, page_size: u32, head_dim: u32) -> u64 {
        digest_bytes_per_list(self.cap(page_size), head_dim, (self.bound_candidates > 0).then_some(page_size))
    }

    /// Bytes of the tier's K/V and positions for `pool`'s lists (host memory where the device
    /// reads it in place).
    pub fn tier_bytes(&self, pool: &crate::config::PoolConfig) -> u64 {
        let cap = u64::from(self.cap(pool.page_size));
        let lists = u64::from(pool.n_lists());
        lists * cap / u64::from(pool.page_size) * u64::from(pool.page_words()) * 4 + lists * cap * 4
    }
}

/// The capture passes of one scheduler's eviction (built with the scheduler's victim marks).
pub(crate) struct Capture {
    plan: (wgpu::ComputePipeline, wgpu::BindGroup),
    copies: Vec<(wgpu::ComputePipeline, wgpu::BindGroup, [u32; 2])>,
    digest: (wgpu::ComputePipeline, wgpu::BindGroup),
    n_lists: u32,
}

impl Capture {
    /// Plan then copy every victim into its list's tier, then digest the new slots' keys.
    pub(crate) fn encode(&self, pass: &mut wgpu::ComputePass<'_>) {
        pass.set_pipeline(&self.plan.0);
        pass.set_bind_group(0, &self.plan.1, &[]);
        let [x, y] = split_workgroups(self.n_lists);
        pass.dispatch_counted(x, y, 1);
        for (p, bg, [x, y]) in &self.copies {
            pass.set_pipeline(p);
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_counted(*x, *y, 1);
        }
        pass.set_pipeline(&self.digest.0);
        pass.set_bind_group(0, &self.digest.1, &[]);
        pass.dispatch_counted(x, y, 1);
    }
}

/// The recall tier of one pool (see the module docs).
pub struct RecallTier {
    /// What it keeps and attends.
    pub cfg: RecallConfig,
    /// Whether the tier lives in host memory the device reads in place (else device memory).
    pub host_memory: bool,
    /// Tier slots per list.
    pub cap: u32,
    /// K/V words of the tier, the pool's raw page layout, `cap / page_size` pages a list.
    pub tier_kv: wgpu::Buffer,
    /// Each tier slot's position.
    pub tier_pos: wgpu::Buffer,
    /// Tokens each list's tier holds.
    pub tier_count: wgpu::Buffer,
    /// Each tier slot's key digest, `head_dim.div_ceil(32)` words (device memory).
    pub tier_digest: wgpu::Buffer,
    /// Per list: the digests' centre, spread and key sums, `head_dim` floats each.
    pub tier_calib: wgpu::Buffer,
    /// Per list: the slots digested and the tokens the digest calibrated on (0: not yet).
    pub tier_digested: wgpu::Buffer,
    audit: bool,
    slot: u32,
    /// Word of `tier_digest` where the pages' key bounds start (0: none kept).
    bounds_at: u32,
    /// Per pool slot: the tier slot its victim goes to (`u32::MAX`: none), cleared once copied.
    capture_dst: wgpu::Buffer,
    /// Victims dropped past a full tier, victims captured.
    tier_stats: wgpu::Buffer,
    params: wgpu::Buffer,
    /// Per list, from the last recall pass: the chosen tier pages (`u32::MAX`: none), then their
    /// scores (f32 bits).
    pub recall_sel: wgpu::Buffer,
    recall: Option<(wgpu::ComputePipeline, wgpu::BindGroup, [u32; 2])>,
    n_lists: u32,
    owner: crate::runtime::RuntimeId,
}

impl RecallTier {
    /// The tier of `pool`: empty, in host memory where the device reads it in place.
    pub async fn new(rt: &Runtime, pool: &KvPool, cfg: RecallConfig, group: u32) -> Result<RecallTier> {
        let c = &pool.cfg;
        cfg.validate(c.page_size, group, c.head_dim)?;
        let cap = cfg.cap(c.page_size);
        let n_lists = c.n_lists();
        let kv_bytes = u64::from(n_lists) * u64::from(cap / c.page_size) * u64::from(c.page_words()) * 4;
        rt.fits_binding("the recall tier (fewer tokens per list, sequences or layers fit)", kv_bytes)?;
        let (tier_kv, host_memory) = rt.host_storage("evict/recall tier", kv_bytes);
        let (tier_pos, _) = rt.host_storage("evict/recall tier positions", u64::from(n_lists) * u64::from(cap) * 4);
        let tier_count = rt.storage("evict/recall tier counts", u64::from(n_lists) * 4);
        let digest_words = u64::from(n_lists) * u64::from(cap) * u64::from(c.head_dim.div_ceil(32));
        let bounds_at = if cfg.bound_candidates > 0 { digest_words } else { 0 };
        let bounds_words =
            if cfg.bound_candidates > 0 { u64::from(n_lists) * u64::from(cap / c.page_size) * bound_words(c.head_dim) } else { 0 };
        let digest_bytes = (digest_words + bounds_words) * 4;
        rt.fits_binding("the recall tier's key digests and bounds (fewer tokens per list, sequences or layers fit)", digest_bytes)?;
        let bounds_at = u32::try_from(bounds_at).map_err(|_| Error::config("recall tier", cfg.tokens, "key digests past 2^32 words"))?;
        let tier_digest = rt.storage("evict/recall key digests and bounds", digest_bytes);
        let tier_calib = rt.storage_init("evict/recall digest calibration", &uncalibrated_digests(n_lists, c.head_dim));
        let tier_digested = rt.storage("evict/recall digested", u64::from(n_lists) * 8);
        let capture_dst = rt.storage_init("evict/recall capture plan", &vec![u32::MAX; (c.n_ids() * c.page_size) as usize]);
        let tier_stats = rt.storage("evict/recall stats", STATS * 4);
        let slot = 0;
        let params = rt.uniform("evict/recall tier params", &TierParams { cap, pages: cfg.pages, slot, audit: 0, bounds_at, _pad: [0; 3] });
        let recall_sel = rt.storage("attend/recall selection", u64::from(n_lists) * 2 * u64::from(cfg.pages) * 4);
        rt.check("recall tier")?;
        Ok(RecallTier {
            cfg,
            host_memory,
            cap,
            tier_kv,
            tier_pos,
            tier_count,
            tier_digest,
            tier_calib,
            tier_digested,
            audit: false,
            slot,
            bounds_at,
            capture_dst,
            tier_stats,
            params,
            recall_sel,
            recall: None,
            n_lists,
            owner: pool.owner(),
        })
    }

    /// The capture passes over `pool` with `victim`, the scheduler's victim marks.
    pub(crate) async fn capture(&self, rt: &Runtime, pool: &KvPool, victim: &wgpu::Buffer) -> Result<Capture> {
        rt.check_owner(self.owner, "this recall tier")?;
        let plan_p = rt.pipeline(Kernel::EvictCapture, &[]).await?;
        let plan_bg = rt.bind(
            Kernel::EvictCapture.label(),
            &plan_p,
            &[&pool.geometry, &self.params, &pool.rings, &pool.ring_pages, victim, &self.tier_count, &self.capture_dst, &self.tier_stats],
        );
        let copy_p = rt.pipeline(Kernel::EvictCaptureCopy, &[]).await?;
        let c = &pool.cfg;
        let copies = pool
            .kv_buffers
            .iter()
            .zip(&pool.window_bufs)
            .zip(&pool.windows)
            .map(|((kv, w), win)| {
                let bg = rt.bind(
                    Kernel::EvictCaptureCopy.label(),
                    &copy_p,
                    &[&pool.geometry, w, &self.capture_dst, &pool.slot_meta, kv, &self.tier_kv, &self.tier_pos],
                );
                let (x, y) = crate::runtime::grid(win.page_count * c.page_size);
                (copy_p.clone(), bg, [x, y])
            })
            .collect();
        let dig_p = rt
            .pipeline(
                Kernel::EvictDigest,
                &[
                    ("F16", f64::from(u8::from(c.dtype == crate::config::KvDtype::F16))),
                    ("BOUNDS", f64::from(u8::from(self.cfg.bound_candidates > 0))),
                ],
            )
            .await?;
        let dig_bg = rt.bind(
            Kernel::EvictDigest.label(),
            &dig_p,
            &[&pool.geometry, &self.params, &self.tier_count, &self.tier_kv, &self.tier_digested, &self.tier_calib, &self.tier_digest],
        );
        Ok(Capture { plan: (plan_p, plan_bg), copies, digest: (dig_p, dig_bg), n_lists: self.n_lists })
    }

    /// Bind the recall pass to `attn` (built with [`crate::attend::AttendOptions::recall`]).
    pub async fn bind_attention(&mut self, rt: &Runtime, pool: &KvPool, attn: &Attention) -> Result<()> {
        let Some(slot) = attn.recall_slot() else {
            return Err(Error::Input("the recall tier needs an attention built with AttendOptions::recall".into()));
        };
        let group = attn.opts.group;
        let p = rt
            .pipeline(
                Kernel::AttendRecall,
                &[
                    ("GROUP", f64::from(group)),
                    ("F16", f64::from(u8::from(pool.cfg.dtype == crate::config::KvDtype::F16))),
                    ("PAGES", f64::from(self.cfg.pages)),
                    ("CANDIDATES", f64::from(self.cfg.candidates)),
                    ("BOUND_CANDIDATES", f64::from(self.cfg.bound_candidates)),
                ],
            )
            .await?;
        self.slot = slot;
        self.write_params(rt);
        let bg = rt.bind(
            Kernel::AttendRecall.label(),
            &p,
            &[
                &pool.geometry,
                attn.params_buffer(),
                &self.params,
                &self.tier_count,
                &self.tier_kv,
                &attn.queries,
                &self.tier_digest,
                &self.recall_sel,
                &attn.partials,
                &self.tier_calib,
                &self.tier_stats,
            ],
        );
        self.recall = Some((p, bg, [pool.cfg.kv_heads, attn.opts.n_seqs]));
        Ok(())
    }

    fn write_params(&self, rt: &Runtime) {
        let p = TierParams {
            cap: self.cap,
            pages: self.cfg.pages,
            slot: self.slot,
            audit: u32::from(self.audit),
            bounds_at: self.bounds_at,
            _pad: [0; 3],
        };
        rt.queue.write_buffer(&self.params, 0, bytemuck::bytes_of(&p));
    }

    /// Turn the audit on or off: with it, every recall pass also finds the pages the true q.k
    /// would choose (reading every tier key, as a recall without digests would) and counts the
    /// digest's hits ([`RecallTier::read_audit`]); the choice and the attention stay the
    /// digest's. Turning it on clears the counters.
    pub fn set_audit(&mut self, rt: &Runtime, on: bool) {
        self.audit = on;
        self.write_params(rt);
        if on {
            rt.queue.write_buffer(&self.tier_stats, 8, bytemuck::cast_slice(&[0u32; 4]));
        }
    }

    /// The audit's counters since it was turned on.
    pub async fn read_audit(&self, rt: &Runtime) -> Result<DigestAudit> {
        let s: Vec<u32> = rt.read_all(&self.tier_stats).await?;
        Ok(DigestAudit { passes: u64::from(s[2]), top_hits: u64::from(s[3]), want: u64::from(s[4]), hits: u64::from(s[5]) })
    }

    /// The digests of every tier slot and each list's calibration (centre, spread, key sums,
    /// then per list the slots digested and the tokens calibrated on): tests and audits.
    pub async fn read_digests(&self, rt: &Runtime) -> Result<(Vec<u32>, Vec<f32>, Vec<u32>)> {
        let bits: Vec<u32> = rt.read_all(&self.tier_digest).await?;
        let calib: Vec<f32> = rt.read_all(&self.tier_calib).await?;
        let state: Vec<u32> = rt.read_all(&self.tier_digested).await?;
        Ok((bits, calib, state))
    }

    /// Word of [`RecallTier::read_digests`]'s digest words where the tier pages' key bounds
    /// start ([`bound_words`] a page, `cap / page_size` pages a list), when the tier keeps them.
    pub fn bounds_at(&self) -> Option<usize> {
        (self.cfg.bound_candidates > 0).then_some(self.bounds_at as usize)
    }

    /// The recall pass of the layer whose parameters the attention holds (between its split and
    /// reduce passes).
    pub fn encode_recall(&self, pass: &mut wgpu::ComputePass<'_>) -> Result<()> {
        let Some((p, bg, [x, y])) = &self.recall else {
            return Err(Error::Input("the recall tier is not bound to an attention (bind_attention)".into()));
        };
        pass.set_pipeline(p);
        pass.set_bind_group(0, bg, &[]);
        pass.dispatch_counted(*x, *y, 1);
        Ok(())
    }

    /// Empty sequence `seq`'s lists of every layer (its tokens were released).
    pub fn release_sequence(&self, rt: &Runtime, pool: &KvPool, seq: u32) {
        let c = &pool.cfg;
        for layer in 0..c.layers {
            let first = (layer * c.max_seqs + seq) * c.kv_heads;
            rt.queue.write_buffer(&self.tier_count, u64::from(first) * 4, bytemuck::cast_slice(&vec![0u32; c.kv_heads as usize]));
            rt.queue.write_buffer(&self.tier_digested, u64::from(first) * 8, bytemuck::cast_slice(&vec![0u32; 2 * c.kv_heads as usize]));
            rt.queue.write_buffer(
                &self.tier_calib,
                u64::from(first) * u64::from(3 * c.head_dim) * 4,
                bytemuck::cast_slice(&uncalibrated_digests(c.kv_heads, c.head_dim)),
            );
        }
    }

    /// Tokens each list's tier holds.
    pub async fn read_counts(&self, rt: &Runtime) -> Result<Vec<u32>> {
        rt.read_all(&self.tier_count).await
    }

    /// Bytes one step's recall passes read from the tier now (every layer's, the audit off): the
    /// keys of the tokens of the pages the digests nominate and the values of those of the pages
    /// recalled. (The digests they score every tier token by are device memory:
    /// [`RecallTier::digest_bytes_read_per_step`].)
    pub async fn bytes_read_per_step(&self, rt: &Runtime, pool: &KvPool) -> Result<u64> {
        let token = u64::from(pool.cfg.vec_words()) * 4;
        let (nominated, recalled) = (self.cfg.candidates * pool.cfg.page_size, self.cfg.pages * pool.cfg.page_size);
        let counts = self.read_counts(rt).await?;
        Ok(counts.iter().map(|&n| u64::from(n.min(self.cap).min(nominated) + n.min(self.cap).min(recalled)) * token).sum())
    }

    /// Bytes of digests (and key bounds) one step's recall passes read from device memory now
    /// (every layer's).
    pub async fn digest_bytes_read_per_step(&self, rt: &Runtime, pool: &KvPool) -> Result<u64> {
        let c = &pool.cfg;
        let counts = self.read_counts(rt).await?;
        let bounds = |n: u32| if self.cfg.bound_candidates > 0 { u64::from(n.div_ceil(c.page_size)) * bound_words(c.head_dim) } else { 0 };
        Ok(counts.iter().map(|&n| (u64::from(n.min(self.cap)) * u64::from(c.head_dim.div_ceil(32)) + bounds(n.min(self.cap))) * 4).sum())
    }

    /// Bytes of the key digests (and the pages' key bounds, when kept) and their calibration
    /// (device memory, counted in the GPU's K/V bytes).
    pub fn digest_bytes(&self) -> u64 {
        self.tier_digest.size() + self.tier_calib.size() + self.tier_digested.size()
    }

    /// Victims dropped past a full tier and captured, over every eviction so far.
    pub async fn read_stats(&self, rt: &Runtime) -> Result<(u64, u64)> {
        let s: Vec<u32> = rt.read_all(&self.tier_stats).await?;
        Ok((u64::from(s[0]), u64::from(s[1])))
    }

    /// The tier's K/V words and positions, every list's `cap` slots (read back whole: tests and
    /// audits).
    pub async fn read_tier(&self, rt: &Runtime) -> Result<(Vec<u32>, Vec<u32>)> {
        let mut r =
            rt.read_many::<u32>(&[(&self.tier_kv, 0, self.tier_kv.size() / 4), (&self.tier_pos, 0, self.tier_pos.size() / 4)]).await?;
        let pos = r.pop().unwrap_or_default();
        Ok((r.pop().unwrap_or_default(), pos))
    }

    /// The last recall pass's choice per list: the tier pages (`u32::MAX`: none) and their scores.
    pub async fn read_selection(&self, rt: &Runtime) -> Result<Vec<(Vec<u32>, Vec<f32>)>> {
        let w: Vec<u32> = rt.read_all(&self.recall_sel).await?;
        let r = self.cfg.pages as usize;
        Ok(w.chunks(2 * r).map(|c| (c[..r].to_vec(), c[r..].iter().map(|&b| f32::from_bits(b)).collect())).collect())
    }

    /// Bytes of the tier in device memory: its digests, counters and plan, and the tier itself
    /// where the device cannot read host memory in place.
    pub fn gpu_bytes(&self) -> u64 {
        let own = self.tier_count.size() + self.capture_dst.size() + self.tier_stats.size() + self.recall_sel.size() + self.digest_bytes();
        if self.host_memory { own } else { own + self.tier_kv.size() + self.tier_pos.size() }
    }

    /// Bytes of the tier in host memory (0 where it lives in device memory).
    pub fn host_bytes(&self) -> u64 {
        if self.host_memory { self.tier_kv.size() + self.tier_pos.size() } else { 0 }
    }
}

/// Device bytes one list's key digests take for a tier of `cap` slots and keys of `head_dim`:
/// a bit a dimension a slot, the calibration (centre, spread, sums) and two counters; with
/// `bounds_page_size`, the key bounds of each tier page of that size too ([`bound_words`]).
pub fn digest_bytes_per_list(cap: u32, head_dim: u32, bounds_page_size: Option<u32>) -> u64 {
    let bounds = bounds_page_size.map_or(0, |p| u64::from(cap / p) * bound_words(head_dim) * 4);
    u64::from(cap) * u64::from(head_dim.div_ceil(32)) * 4 + u64::from(3 * head_dim) * 4 + 8 + bounds
}
