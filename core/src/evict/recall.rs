//! The recall tier: nothing an eviction removes is lost. Between the scheduler's victim selection
//! and its compaction, every victim's K, V and position are captured into its page list's tier
//! (`evict/capture.wgsl`, `evict/capture_copy.wgsl`), laid out as the pool's raw pages; before
//! every layer's reduce pass, each list's tier pages holding the best scores against the layer's
//! queries are attended (`attend/recall.wgsl`), their attention one more partial record per query
//! head that the reduce pass merges with the resident pages'. The scores are the true q.k, the
//! best token's of a page, so a page is recalled for what it holds, not for a bound on it.
//!
//! Where the device can read host memory in place (`MAPPABLE_PRIMARY_BUFFERS`, native), the tier
//! lives there: the GPU's K/V bytes stay the scheduler's budget, and a recall reads the tier's keys
//! and the chosen pages' values over the bus, with no host stop and no copy. Elsewhere (the
//! browser) the tier is device memory: the same answers, no bytes saved, and
//! [`RecallTier::host_memory`] says so.

use expertkv_shaders::Kernel;

use crate::append::KvPool;
use crate::attend::Attention;
use crate::error::{Error, Result};
use crate::gpu_data::TierParams;
use crate::runtime::dispatch::CountedDispatch;
use crate::runtime::{Runtime, split_workgroups};

/// Most pages recalled per list and layer (`attend/recall.wgsl` keeps their tokens' scores in
/// one workgroup: pages x page size at most 256).
pub const MAX_RECALL_PAGES: u32 = 16;

/// Most tier pages a list may hold (`attend/recall.wgsl`'s workgroup table of page scores).
pub const MAX_TIER_PAGES: u32 = 1024;

/// Query heads per KV head the recall pass handles.
pub const MAX_RECALL_GROUP: u32 = 8;

/// `tier_stats` words: victims dropped past a full tier, victims captured.
const STATS: u64 = 2;

/// What the recall tier keeps and attends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RecallConfig {
    /// Tier pages attended per list and layer (1..=[`MAX_RECALL_PAGES`]).
    pub pages: u32,
    /// Tier tokens per list: the most a list may lose to eviction over a run (rounded up to
    /// whole pages; a victim past it is dropped and counted).
    pub tokens: u32,
}

impl RecallConfig {
    /// Refuse shapes the kernels cannot take, naming the field.
    pub fn validate(&self, page_size: u32, group: u32) -> Result<()> {
        if self.pages == 0 || self.pages > MAX_RECALL_PAGES || self.pages * page_size > 256 {
            return Err(Error::config(
                "recall",
                self.pages,
                format!("pages recalled per list and layer: 1 to {} ({} tokens at most)", MAX_RECALL_PAGES.min(256 / page_size), 256),
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
    n_lists: u32,
}

impl Capture {
    /// Plan then copy every victim into its list's tier.
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
        cfg.validate(c.page_size, group)?;
        let cap = cfg.cap(c.page_size);
        let n_lists = c.n_lists();
        let kv_bytes = u64::from(n_lists) * u64::from(cap / c.page_size) * u64::from(c.page_words()) * 4;
        rt.fits_binding("the recall tier (fewer tokens per list, sequences or layers fit)", kv_bytes)?;
        let (tier_kv, host_memory) = rt.host_storage("evict/recall tier", kv_bytes);
        let (tier_pos, _) = rt.host_storage("evict/recall tier positions", u64::from(n_lists) * u64::from(cap) * 4);
        let tier_count = rt.storage("evict/recall tier counts", u64::from(n_lists) * 4);
        let capture_dst = rt.storage_init("evict/recall capture plan", &vec![u32::MAX; (c.n_ids() * c.page_size) as usize]);
        let tier_stats = rt.storage("evict/recall stats", STATS * 4);
        let slot = 0;
        let params = rt.uniform("evict/recall tier params", &TierParams { cap, pages: cfg.pages, slot, _pad0: 0 });
        let recall_sel = rt.storage("attend/recall selection", u64::from(n_lists) * 2 * u64::from(cfg.pages) * 4);
        rt.check("recall tier")?;
        Ok(RecallTier {
            cfg,
            host_memory,
            cap,
            tier_kv,
            tier_pos,
            tier_count,
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
        Ok(Capture { plan: (plan_p, plan_bg), copies, n_lists: self.n_lists })
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
                ],
            )
            .await?;
        rt.queue.write_buffer(&self.params, 0, bytemuck::bytes_of(&TierParams { cap: self.cap, pages: self.cfg.pages, slot, _pad0: 0 }));
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
                &attn.partials,
                &self.recall_sel,
            ],
        );
        self.recall = Some((p, bg, [pool.cfg.kv_heads, attn.opts.n_seqs]));
        Ok(())
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
        }
    }

    /// Tokens each list's tier holds.
    pub async fn read_counts(&self, rt: &Runtime) -> Result<Vec<u32>> {
        rt.read_all(&self.tier_count).await
    }

    /// Bytes one step's recall passes read from the tier now (every layer's): each tier token's
    /// key, and the values of the tokens of the pages each list recalls.
    pub async fn bytes_read_per_step(&self, rt: &Runtime, pool: &KvPool) -> Result<u64> {
        let token = u64::from(pool.cfg.vec_words()) * 4;
        let recalled = self.cfg.pages * pool.cfg.page_size;
        let counts = self.read_counts(rt).await?;
        Ok(counts.iter().map(|&n| u64::from(n.min(self.cap)) * token + u64::from(n.min(recalled)) * token).sum())
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

    /// Bytes of the tier in device memory: its counters and plan, and the tier itself where the
    /// device cannot read host memory in place.
    pub fn gpu_bytes(&self) -> u64 {
        let own = self.tier_count.size() + self.capture_dst.size() + self.tier_stats.size() + self.recall_sel.size();
        if self.host_memory { own } else { own + self.tier_kv.size() + self.tier_pos.size() }
    }

    /// Bytes of the tier in host memory (0 where it lives in device memory).
    pub fn host_bytes(&self) -> u64 {
        if self.host_memory { self.tier_kv.size() + self.tier_pos.size() } else { 0 }
    }
}
