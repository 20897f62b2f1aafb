//! The paged, sharded KV pool on the GPU.
//!
//! Pages of K/V live in as many storage buffers as the adapter's binding limit requires; shard
//! rings, page tables, slot metadata and the free stack live in GPU buffers and are changed only
//! by kernels, so pages are taken and returned without a host round trip. The host keeps no
//! mirror of the state: it reads snapshots when it wants to look.

pub mod format;
pub mod invariants;

use expertkv_shaders::Kernel;

use crate::append::format::{NewToken, initial_free_stack, token_words};
use crate::config::PoolConfig;
use crate::error::{Error, Result};
use crate::gpu_data::{
    AppendParams, ApplyParams, GatherParams, Geometry, NO_OWNER, PageMeta, PoolCtl, PoolWindow, ReleaseParams, RingState, TokenPlan,
    pool_errors,
};
use crate::runtime::Runtime;
use crate::runtime::dispatch::CountedDispatch;

/// Everything of the pool state, read back (for tests, stats and the viewer).
#[derive(Clone, Debug)]
pub struct PoolSnapshot {
    /// One ring per shard key (layer, sequence, KV head, shard): oldest entry, page count, fill.
    pub rings: Vec<RingState>,
    /// `ring_capacity` page ids per shard key, a circular array whose oldest entry sits at the
    /// ring's `head`; entry `k` of a ring is at `key * ring_capacity + (head + k) % ring_capacity`.
    pub ring_pages: Vec<u32>,
    /// Per page id (raw, then compressed): owning shard key or `NO_OWNER`, and valid slots.
    pub page_meta: Vec<PageMeta>,
    /// The raw pages' free stack (`n_pages` entries; the first `ctl.free_top` are free).
    pub free_stack: Vec<u32>,
    /// Free-stack tops, sticky error flags and counters.
    pub ctl: PoolCtl,
    /// `meta_words` u32 per slot of every page id: position, last access, access count,
    /// experts, gates (f32 bits), attention mass (f32 bits).
    pub slot_meta: Vec<u32>,
    /// The compressed pages' free stack (the first `ctl.codec_free_top` are free); empty when
    /// the pool has no codec.
    pub codec_free: Vec<u32>,
}

/// Which pages each ring holds: the part of a [`PoolSnapshot`] a host tier's fetch reads.
#[derive(Clone, Debug, PartialEq)]
pub struct RingTables {
    /// One ring per shard key (see [`PoolSnapshot::rings`]).
    pub rings: Vec<RingState>,
    /// `ring_capacity` page ids per shard key (see [`PoolSnapshot::ring_pages`]).
    pub ring_pages: Vec<u32>,
    /// Per page id: owning shard key or `NO_OWNER`, and valid slots.
    pub page_meta: Vec<PageMeta>,
}

/// Words read back as `T`s, whole elements only (as `Runtime::read_all` reads them).
fn cast_words<T: bytemuck::Pod>(words: &[u32]) -> Vec<T> {
    let bytes: &[u8] = bytemuck::cast_slice(words);
    bytemuck::pod_collect_to_vec(&bytes[..bytes.len() / std::mem::size_of::<T>() * std::mem::size_of::<T>()])
}

/// The passes that compress full pages (`compress/plan.wgsl#count`, `#main`, `#assign`,
/// `compress/encode`).
pub(crate) struct CodecPasses {
    pub(crate) passes: crate::page_passes::PagePasses,
    pub(crate) _buffers: [wgpu::Buffer; 3],
}

/// Fitting the low-rank codecs' basis (`compress/gram`, `compress/basis`), built and run by
/// [`crate::compress`].
pub(crate) struct LowRankFit {
    pub(crate) gram: wgpu::Buffer,
    pub(crate) gram_pass: (wgpu::ComputePipeline, Vec<wgpu::BindGroup>),
    /// `compress/basis.wgsl` init, iterate, finish.
    pub(crate) basis_passes: [(wgpu::ComputePipeline, wgpu::BindGroup); 3],
    pub(crate) _work: wgpu::Buffer,
    /// Gram matrices fitted: layers x KV heads (low-rank) or layers (LoRA).
    pub(crate) fits: u32,
}

/// Growable staging buffers of the append passes.
struct AppendScratch {
    capacity: u32,
    new_tokens: wgpu::Buffer,
    new_kv: wgpu::Buffer,
    plan: wgpu::Buffer,
    params: wgpu::Buffer,
    plan_bg: wgpu::BindGroup,
    alloc_bg: wgpu::BindGroup,
    write_bgs: Vec<wgpu::BindGroup>,
}

/// The paged, sharded KV pool on one device: its K/V buffers, the ring and page-table state the
/// kernels keep, and the append, gather and release passes.
pub struct KvPool {
    /// The validated configuration the pool was built from.
    pub cfg: PoolConfig,
    /// The runtime it was made with (calls with another are refused).
    owner: crate::runtime::RuntimeId,
    /// The pool's shape as the kernels see it.
    pub geo: Geometry,
    /// `geo` as a uniform buffer, bound by every pool kernel.
    pub geometry: wgpu::Buffer,
    /// K/V pages, `geo.pages_per_buffer` per buffer.
    pub kv_buffers: Vec<wgpu::Buffer>,
    /// Per K/V buffer: its index and the global ids of the pages it holds.
    pub windows: Vec<PoolWindow>,
    /// `windows` as uniform buffers, one per K/V buffer.
    pub window_bufs: Vec<wgpu::Buffer>,
    /// A [`RingState`] per shard key (layer, sequence, KV head, shard).
    pub rings: wgpu::Buffer,
    /// `ring_capacity` page ids (u32) per shard key, circular from each ring's head (entries
    /// past a ring's count are stale; `NO_OWNER` before first use).
    pub ring_pages: wgpu::Buffer,
    /// A [`PageMeta`] per page id, raw then compressed.
    pub page_meta: wgpu::Buffer,
    /// Free raw page ids (u32), popped from the top (`PoolCtl::free_top`).
    pub free_stack: wgpu::Buffer,
    /// The pool's [`PoolCtl`]: free-stack tops, error flags, counters.
    pub ctl: wgpu::Buffer,
    /// Slot metadata, `meta_words` u32 per slot of every page id ([`PoolSnapshot::slot_meta`]).
    pub slot_meta: wgpu::Buffer,
    /// Per raw page: its generation (u32), raised by every pass that writes the page's K/V
    /// (append, compaction's moves, thaw), so summaries of a page's contents (QUEST's bounds)
    /// know when they are stale.
    pub page_gen: wgpu::Buffer,
    /// Per (layer, seq, KV head): `max_pages_per_seq` page ids, built by `append/gather_pages`.
    pub page_list: wgpu::Buffer,
    /// Per (layer, seq, KV head): the length of its page list in pages (u32), as of the last gather.
    pub page_counts: wgpu::Buffer,
    apply_pipe: wgpu::ComputePipeline,
    plan_pipe: wgpu::ComputePipeline,
    alloc_pipe: wgpu::ComputePipeline,
    write_pipe: wgpu::ComputePipeline,
    gather_pipe: wgpu::ComputePipeline,
    release_pipe: wgpu::ComputePipeline,
    gather_params: wgpu::Buffer,
    gather_bg: wgpu::BindGroup,
    /// `GatherParams { first_layer: l }` for every layer l, copied into `gather_params` by
    /// [`KvPool::encode_gather_layer`] so one submission can gather layer after layer.
    gather_layers: wgpu::Buffer,
    _release_params: wgpu::Buffer,
    release_counts: wgpu::Buffer,
    release_bg: wgpu::BindGroup,
    scratch: Option<AppendScratch>,
    /// Token records staged by [`KvPool::stage_append`]: (buffer, tokens per batch, batches).
    staged: Option<(wgpu::Buffer, u32, u32)>,
    /// Compressed pages (ids `n_pages..n_ids`), their free stack, and the compression passes.
    pub codec_kv: wgpu::Buffer,
    /// Free compressed page ids (u32), popped from the top (`PoolCtl::codec_free_top`).
    pub codec_free: wgpu::Buffer,
    pub(crate) codec: Option<CodecPasses>,
    /// Low-rank codecs: per (layer, KV head), K then V, `rank` basis rows of `head_dim` f32
    /// (f16 values); a 4-byte placeholder otherwise.
    pub codec_basis: wgpu::Buffer,
    pub(crate) fit: Option<LowRankFit>,
    /// Whether the low-rank basis has been fitted (pages cannot be encoded before).
    pub calibrated: bool,
}

/// Router output an append takes its tokens' experts and gates from (row i for token i), instead
/// of the host's `NewToken::experts` / `gates`.
#[derive(Clone, Copy)]
pub struct Routed<'a> {
    /// The router's chosen experts, top_k u32 per row ([`crate::route::Router::experts`]).
    pub experts: &'a wgpu::Buffer,
    /// The router's gate weights, top_k f32 per row ([`crate::route::Router::gates`]).
    pub gates: &'a wgpu::Buffer,
    /// Tokens of each layer in the batch (the batch is ordered `[layer][token]`).
    pub per_layer: u32,
    /// Router rows between the first tokens of consecutive layers (its `max_tokens`).
    pub row_stride: u32,
    /// The router layer of the batch's first tokens (a batch of one layer after another).
    pub first_layer: u32,
}

/// The routing pass of one staged batch ([`KvPool::bind_staged_routing`]).
pub struct StagedRouting {
    bind: wgpu::BindGroup,
    per_batch: u32,
    /// The scratch it writes into (a larger append reallocates the scratch).
    scratch_capacity: u32,
}

/// Most tokens one append may carry: workgroup dispatch limit of the write pass (y).
pub const MAX_APPEND_TOKENS: u32 = 65_535;

impl KvPool {
    /// Validate `cfg` and allocate the pool on `rt`'s device: K/V split over as many buffers as
    /// its binding limit needs, every page free, every ring empty. Errors name a field or limit.
    pub async fn new(rt: &Runtime, cfg: PoolConfig) -> Result<KvPool> {
        cfg.validate()?;
        let max_binding = rt.max_binding_bytes();
        let ppb = cfg.pages_per_buffer(max_binding);
        if ppb == 0 {
            return Err(Error::Limit {
                what: "one KV page".into(),
                needed: cfg.page_bytes(),
                limit_name: "max_storage_buffer_binding_size",
                limit: max_binding,
            });
        }
        let geo = cfg.geometry(ppb);
        let check = |what: &str, bytes: u64| rt.fits_binding(what, bytes);
        let slots = u64::from(cfg.n_ids()) * u64::from(cfg.page_size);
        check("slot metadata", slots * u64::from(cfg.meta_words()) * 4)?;
        let codec_pages = cfg.n_ids() - cfg.n_pages;
        check("compressed pages", u64::from(codec_pages) * cfg.codec_page_bytes())?;
        check("ring page table", u64::from(cfg.n_keys()) * u64::from(cfg.ring_capacity) * 4)?;
        check("page lists", u64::from(cfg.n_lists()) * u64::from(cfg.max_pages_per_seq()) * 4)?;

        let oom = rt.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let n_buffers = cfg.n_pages.div_ceil(ppb);
        let mut kv_buffers = Vec::with_capacity(n_buffers as usize);
        let mut windows = Vec::with_capacity(n_buffers as usize);
        let mut window_bufs = Vec::with_capacity(n_buffers as usize);
        for b in 0..n_buffers {
            let first = b * ppb;
            let count = ppb.min(cfg.n_pages - first);
            let label = format!("expertkv pool kv[{b}]");
            kv_buffers.push(rt.storage(&label, u64::from(count) * cfg.page_bytes()));
            let w = PoolWindow { buffer_index: b, first_page: first, page_count: count, n_buffers };
            window_bufs.push(rt.uniform(&format!("expertkv pool window[{b}]"), &w));
            windows.push(w);
        }
        let geometry = rt.uniform("expertkv pool geometry", &geo);
        let rings = rt.storage_init(
            "expertkv pool rings",
            &vec![RingState { head: 0, count: 0, fill: cfg.page_size, _pad: 0 }; cfg.n_keys() as usize],
        );
        let ring_pages = rt.storage_init("expertkv pool ring_pages", &vec![NO_OWNER; (cfg.n_keys() * cfg.ring_capacity) as usize]);
        let page_meta = rt.storage_init("expertkv pool page_meta", &vec![PageMeta { owner: NO_OWNER, fill: 0 }; cfg.n_ids() as usize]);
        let free_stack = rt.storage_init("expertkv pool free_stack", &initial_free_stack(cfg.n_pages));
        let ctl =
            rt.storage_init("expertkv pool ctl", &[PoolCtl { free_top: cfg.n_pages, codec_free_top: codec_pages, ..Default::default() }]);
        let codec_kv = rt.storage("expertkv pool codec_kv", u64::from(codec_pages) * cfg.codec_page_bytes());
        let codec_free: Vec<u32> = (cfg.n_pages..cfg.n_ids()).rev().collect();
        let codec_free = rt.storage_init("expertkv pool codec_free", &codec_free);
        let slot_meta = rt.storage("expertkv pool slot_meta", slots * u64::from(cfg.meta_words()) * 4);
        let page_gen = rt.storage_init("expertkv pool page_gen", &vec![0u32; cfg.n_pages as usize]);
        let list_len = u64::from(cfg.n_lists()) * u64::from(cfg.max_pages_per_seq());
        let page_list = rt.storage("expertkv pool page_list", list_len * 4);
        let page_counts = rt.storage_init("expertkv pool page_counts", &vec![0u32; cfg.n_lists() as usize]);
        if let Some(e) = oom.pop().await {
            return Err(Error::Gpu { during: "KV pool allocation".into(), message: e.to_string() });
        }

        let apply_pipe = rt.pipeline(Kernel::AppendApplyRouting, &[]).await?;
        let plan_pipe = rt.pipeline(Kernel::AppendPlan, &[]).await?;
        let alloc_pipe = rt.pipeline(Kernel::AppendAlloc, &[]).await?;
        let write_pipe = rt.pipeline(Kernel::AppendWrite, &[]).await?;
        let gather_pipe = rt.pipeline(Kernel::AppendGatherPages, &[]).await?;
        let release_pipe = rt.pipeline(Kernel::AppendRelease, &[]).await?;

        let gather_params = rt.uniform("append/gather_pages params", &GatherParams::default());
        let per_layer: Vec<GatherParams> = (0..cfg.layers).map(|l| GatherParams { first_layer: l, ..Default::default() }).collect();
        let gather_layers = rt.storage_init("append/gather_pages per-layer params", &per_layer);
        let gather_bg = rt.bind(
            Kernel::AppendGatherPages.label(),
            &gather_pipe,
            &[&geometry, &gather_params, &rings, &ring_pages, &page_list, &page_counts],
        );
        let release_params = rt.uniform("append/release params", &ReleaseParams { n_keys: cfg.n_keys(), ..Default::default() });
        let release_counts = rt.storage("append/release counts", u64::from(cfg.n_keys()) * 4);
        let release_bg = rt.bind(
            Kernel::AppendRelease.label(),
            &release_pipe,
            &[&geometry, &release_params, &release_counts, &rings, &ring_pages, &free_stack, &ctl, &page_meta, &codec_free],
        );
        check("low-rank basis", cfg.basis_words() * 4)?;
        let codec_basis = rt.storage("expertkv pool codec_basis", (cfg.basis_words() * 4).max(4));
        let mut pool = KvPool {
            cfg,
            owner: rt.id(),
            geo,
            geometry,
            kv_buffers,
            windows,
            window_bufs,
            rings,
            ring_pages,
            page_meta,
            free_stack,
            ctl,
            slot_meta,
            page_gen,
            page_list,
            page_counts,
            apply_pipe,
            plan_pipe,
            alloc_pipe,
            write_pipe,
            gather_pipe,
            release_pipe,
            gather_params,
            gather_bg,
            gather_layers,
            _release_params: release_params,
            release_counts,
            release_bg,
            scratch: None,
            staged: None,
            codec: None,
            codec_kv,
            codec_free,
            codec_basis,
            fit: None,
            calibrated: false,
        };
        pool.fit = LowRankFit::new(rt, &pool).await?;
        pool.codec = CodecPasses::new(rt, &pool).await?;
        rt.check("KV pool creation")?;
        Ok(pool)
    }

    /// Most tokens one append may carry: a ring must not wrap onto pages written in the same
    /// batch, the write pass dispatches one row per token, and the staged K/V must fit a binding.
    pub fn max_append_tokens(&self, rt: &Runtime) -> u32 {
        Self::max_append_tokens_of(rt, &self.cfg)
    }

    /// [`KvPool::max_append_tokens`] of a pool of configuration `cfg` (validated), before it
    /// is made.
    pub fn max_append_tokens_of(rt: &Runtime, cfg: &PoolConfig) -> u32 {
        let token_bytes = u64::from(2 * cfg.kv_heads * cfg.vec_words()) * 4;
        let fits = (rt.max_binding_bytes() / token_bytes).min(u64::from(MAX_APPEND_TOKENS)) as u32;
        (cfg.ring_capacity.saturating_sub(1) * cfg.page_size).min(fits)
    }

    /// Storage buffers the raw K/V pages are split over.
    pub fn n_buffers(&self) -> usize {
        self.kv_buffers.len()
    }

    /// Bytes allocated for K/V pages.
    pub fn kv_bytes_allocated(&self) -> u64 {
        self.kv_buffers.iter().map(|b| b.size()).sum()
    }

    /// Bytes allocated for the pool's pages (raw and compressed) and every table that lives as
    /// long as it ([`PoolConfig::pool_bytes`] predicts them before allocating); per-step
    /// scratch is not included.
    pub fn pool_bytes_allocated(&self) -> u64 {
        self.kv_bytes_allocated() + self.meta_bytes_allocated() + self.codec_kv.size() + self.codec_free.size() + self.codec_basis.size()
    }

    /// Bytes allocated for everything else: rings, page tables, metadata, free stack.
    pub fn meta_bytes_allocated(&self) -> u64 {
        [
            &self.rings,
            &self.ring_pages,
            &self.page_meta,
            &self.free_stack,
            &self.ctl,
            &self.slot_meta,
            &self.page_gen,
            &self.page_list,
            &self.page_counts,
        ]
        .iter()
        .map(|b| b.size())
        .sum()
    }

    fn ensure_scratch(&mut self, rt: &Runtime, n_tokens: u32) {
        if self.scratch.as_ref().is_some_and(|s| s.capacity >= n_tokens) {
            return;
        }
        let tw = u64::from(token_words(self.cfg.top_k));
        let kvw = u64::from(2 * self.cfg.kv_heads * self.cfg.vec_words());
        let fits = (rt.max_binding_bytes() / (kvw * 4)).min(u64::from(u32::MAX)) as u32;
        let capacity = n_tokens.next_power_of_two().max(64).min(fits).max(n_tokens);
        let new_tokens = rt.storage("append/append new_tokens", u64::from(capacity) * tw * 4);
        let new_kv = rt.storage("append/append new_kv", u64::from(capacity) * kvw * 4);
        // One plan per (token, KV head).
        let plan =
            rt.storage("append/append plan", u64::from(capacity) * u64::from(self.cfg.kv_heads) * std::mem::size_of::<TokenPlan>() as u64);
        let params = rt.uniform("append/append params", &AppendParams::default());
        let plan_bg = rt.bind(Kernel::AppendPlan.label(), &self.plan_pipe, &[&self.geometry, &params, &new_tokens, &self.rings, &plan]);
        let alloc_bg = rt.bind(
            Kernel::AppendAlloc.label(),
            &self.alloc_pipe,
            &[&self.geometry, &params, &plan, &self.rings, &self.ring_pages, &self.free_stack, &self.ctl, &self.page_meta, &self.page_gen],
        );
        let write_bgs = self
            .kv_buffers
            .iter()
            .zip(&self.window_bufs)
            .map(|(kv, w)| {
                rt.bind(
                    Kernel::AppendWrite.label(),
                    &self.write_pipe,
                    &[
                        &self.geometry,
                        &params,
                        w,
                        &new_tokens,
                        &new_kv,
                        &plan,
                        &self.ring_pages,
                        &self.ctl,
                        kv,
                        &self.slot_meta,
                        &self.page_meta,
                    ],
                )
            })
            .collect();
        self.scratch = Some(AppendScratch { capacity, new_tokens, new_kv, plan, params, plan_bg, alloc_bg, write_bgs });
    }

    /// Append a batch of tokens; `kv` holds per token K then V of every KV head in storage
    /// words (see [`crate::append::format::encode_values`]). Submits its own command buffer.
    /// A refused batch (exhausted pool, bad token) changes nothing and shows in
    /// [`PoolCtl::error_flags`]; [`KvPool::check_errors`] turns that into an [`Error`].
    pub fn append(&mut self, rt: &Runtime, tokens: &[NewToken], kv: &[u32], step: u32) -> Result<()> {
        self.append_timed(rt, tokens, kv, step, None, None)
    }

    /// [`KvPool::append`], with optional timestamp writes around its compute pass.
    pub fn append_timed(
        &mut self,
        rt: &Runtime,
        tokens: &[NewToken],
        kv: &[u32],
        step: u32,
        routed: Option<Routed<'_>>,
        timestamps: Option<wgpu::ComputePassTimestampWrites<'_>>,
    ) -> Result<()> {
        if tokens.is_empty() {
            return Ok(());
        }
        let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("append/append") });
        self.encode_append(rt, &mut enc, tokens, kv, step, routed, timestamps)?;
        rt.queue.submit([enc.finish()]);
        rt.check("append/append")
    }

    /// [`KvPool::append_timed`] recorded into `enc` (its staging uploads go through the queue,
    /// so at most one append per submission).
    #[allow(clippy::too_many_arguments)]
    pub fn encode_append(
        &mut self,
        rt: &Runtime,
        enc: &mut wgpu::CommandEncoder,
        tokens: &[NewToken],
        kv: &[u32],
        step: u32,
        routed: Option<Routed<'_>>,
        timestamps: Option<wgpu::ComputePassTimestampWrites<'_>>,
    ) -> Result<()> {
        rt.check_owner(self.owner, "this pool")?;
        let n = tokens.len() as u32;
        if n == 0 {
            return Ok(());
        }
        let max_batch = self.max_append_tokens(rt);
        if n > max_batch {
            return Err(Error::Input(format!(
                "an append carries at most {max_batch} tokens here (a ring must not wrap onto pages of the same batch: \
                 (ring_capacity - 1) x page_size; staged K/V must fit one binding), got {n}; split the batch"
            )));
        }
        self.check_tokens(tokens, routed.is_some())?;
        let kvw = (2 * self.cfg.kv_heads * self.cfg.vec_words()) as usize;
        if kv.len() != tokens.len() * kvw {
            return Err(Error::Input(format!("K/V data holds {} words, {} tokens need {}", kv.len(), n, tokens.len() * kvw)));
        }
        self.ensure_scratch(rt, n);
        let Some(s) = self.scratch.as_ref() else { unreachable!("scratch ensured above") };
        let mut words = Vec::with_capacity(tokens.len() * token_words(self.cfg.top_k) as usize);
        for t in tokens {
            t.encode_into(self.cfg.top_k as usize, &mut words);
        }
        rt.queue.write_buffer(&s.new_tokens, 0, bytemuck::cast_slice(&words));
        rt.queue.write_buffer(&s.new_kv, 0, bytemuck::cast_slice(kv));
        let params = AppendParams { n_tokens: n, token_words: token_words(self.cfg.top_k), step, _pad: 0 };
        rt.queue.write_buffer(&s.params, 0, bytemuck::bytes_of(&params));

        if let Some(r) = &routed
            && (r.per_layer == 0 || !n.is_multiple_of(r.per_layer) || r.per_layer > r.row_stride)
        {
            return Err(Error::Input(format!(
                "routed append: {n} tokens are not whole layers of {} tokens within router rows of {}",
                r.per_layer, r.row_stride
            )));
        }
        let apply_bg = routed.map(|r| self.apply_routing_bind(rt, &s.new_tokens, r, n, r.first_layer * r.row_stride));
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("append/append"), timestamp_writes: timestamps });
        self.encode_append_dispatches(&mut pass, n, apply_bg.as_ref());
        Ok(())
    }

    /// Every token carries top_k experts and gates (finite gates unless a router supplies them).
    fn check_tokens(&self, tokens: &[NewToken], routed: bool) -> Result<()> {
        let k = self.cfg.top_k as usize;
        for (i, t) in tokens.iter().enumerate() {
            if t.experts.len() != k || t.gates.len() != k {
                return Err(Error::Input(format!(
                    "token {i}: {} experts and {} gates, the pool keeps top_k = {k}",
                    t.experts.len(),
                    t.gates.len()
                )));
            }
            if !routed && let Some(g) = t.gates.iter().find(|g| !g.is_finite()) {
                return Err(Error::Input(format!("token {i}: gate weight {g} is not finite")));
            }
        }
        Ok(())
    }

    /// The append's dispatches over `n` tokens already in the scratch buffers.
    fn encode_append_dispatches(&self, pass: &mut wgpu::ComputePass<'_>, n: u32, apply_bg: Option<&wgpu::BindGroup>) {
        let Some(s) = self.scratch.as_ref() else { return };
        let kvw = 2 * self.cfg.kv_heads * self.cfg.vec_words();
        if let Some(bg) = apply_bg {
            pass.set_pipeline(&self.apply_pipe);
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_counted(n.div_ceil(64), 1, 1);
        }
        pass.set_pipeline(&self.plan_pipe);
        pass.set_bind_group(0, &s.plan_bg, &[]);
        pass.dispatch_counted(n.div_ceil(64), 1, 1);
        pass.set_pipeline(&self.alloc_pipe);
        pass.set_bind_group(0, &s.alloc_bg, &[]);
        pass.dispatch_counted(1, 1, 1);
        pass.set_pipeline(&self.write_pipe);
        for bg in &s.write_bgs {
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_counted(kvw.div_ceil(64), n, 1);
        }
    }

    /// Stage the token records of `tokens.len() / per_batch` appends of `per_batch` tokens each
    /// (one per layer, say, when a forward pass appends layer after layer in one submission), for
    /// [`KvPool::encode_staged_append`]; `step` is every batch's step. Checked as
    /// [`KvPool::append`] checks; writes through the queue (one staging per submission).
    pub fn stage_append(&mut self, rt: &Runtime, tokens: &[NewToken], per_batch: u32, step: u32) -> Result<()> {
        if per_batch == 0 || tokens.is_empty() || !(tokens.len() as u32).is_multiple_of(per_batch) {
            return Err(Error::Input(format!("staged append: {} tokens are not whole batches of {per_batch}", tokens.len())));
        }
        let max_batch = self.max_append_tokens(rt);
        if per_batch > max_batch {
            return Err(Error::Input(format!("an append carries at most {max_batch} tokens here, got batches of {per_batch}")));
        }
        self.check_tokens(tokens, false)?;
        self.ensure_scratch(rt, per_batch);
        let tw = token_words(self.cfg.top_k);
        let mut words = Vec::with_capacity(tokens.len() * tw as usize);
        for t in tokens {
            t.encode_into(self.cfg.top_k as usize, &mut words);
        }
        let batches = tokens.len() as u32 / per_batch;
        let bytes = words.len() as u64 * 4;
        if self.staged.as_ref().is_none_or(|(b, _, _)| b.size() < bytes) {
            self.staged = Some((rt.storage("append/append staged tokens", bytes), per_batch, batches));
        }
        let Some((buf, pb, nb)) = self.staged.as_mut() else { unreachable!("staged above") };
        (*pb, *nb) = (per_batch, batches);
        rt.queue.write_buffer(buf, 0, bytemuck::cast_slice(&words));
        let Some(s) = self.scratch.as_ref() else { unreachable!("scratch ensured above") };
        let params = AppendParams { n_tokens: per_batch, token_words: tw, step, _pad: 0 };
        rt.queue.write_buffer(&s.params, 0, bytemuck::bytes_of(&params));
        Ok(())
    }

    /// Append staged batch `batch` ([`KvPool::stage_append`]) with its K/V taken from `kv` on the
    /// GPU from byte `kv_offset` on (per token K then V of every KV head in storage words, as
    /// [`KvPool::append`] takes them), recorded into `enc`: nothing crosses to the host.
    ///
    /// With `routing` ([`KvPool::bind_staged_routing`] for this batch), the tokens' experts and
    /// gates are first copied from the router's output on the GPU, replacing the staged ones.
    pub fn encode_staged_append(
        &self,
        enc: &mut wgpu::CommandEncoder,
        batch: u32,
        (kv, kv_offset): (&wgpu::Buffer, u64),
        routing: Option<&StagedRouting>,
    ) -> Result<()> {
        self.copy_staged_batch(enc, batch, (kv, kv_offset), routing)?;
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("append/append"), timestamp_writes: None });
        self.encode_staged_dispatches(&mut pass, routing);
        Ok(())
    }

    /// The copies of [`KvPool::encode_staged_append`]: batch `batch`'s token records and K/V
    /// into the append's scratch (checked: a staged batch, K/V within `kv`, `routing` bound for
    /// this scratch). [`KvPool::encode_staged_dispatches`] then appends them.
    pub fn copy_staged_batch(
        &self,
        enc: &mut wgpu::CommandEncoder,
        batch: u32,
        (kv, kv_offset): (&wgpu::Buffer, u64),
        routing: Option<&StagedRouting>,
    ) -> Result<()> {
        let (Some((buf, per_batch, batches)), Some(s)) = (self.staged.as_ref(), self.scratch.as_ref()) else {
            return Err(Error::Input("no staged append: call stage_append first".into()));
        };
        if batch >= *batches {
            return Err(Error::Input(format!("staged append {batch} of {batches}")));
        }
        let tw = u64::from(token_words(self.cfg.top_k)) * 4;
        let kv_bytes = u64::from(*per_batch) * u64::from(2 * self.cfg.kv_heads * self.cfg.vec_words()) * 4;
        if kv.size() < kv_offset.saturating_add(kv_bytes) {
            return Err(Error::Input(format!(
                "staged append: the K/V buffer holds {} bytes, {per_batch} tokens from byte {kv_offset} need {kv_bytes}",
                kv.size()
            )));
        }
        if let Some(r) = routing
            && (r.per_batch != *per_batch || r.scratch_capacity != s.capacity)
        {
            return Err(Error::Input(format!(
                "staged append: routing bound for batches of {} over an older scratch, staged {per_batch}: bind it again",
                r.per_batch
            )));
        }
        let rec = tw * u64::from(*per_batch);
        enc.copy_buffer_to_buffer(buf, rec * u64::from(batch), &s.new_tokens, 0, rec);
        enc.copy_buffer_to_buffer(kv, kv_offset, &s.new_kv, 0, kv_bytes);
        Ok(())
    }

    /// The append passes of the batch [`KvPool::copy_staged_batch`] copied in.
    pub fn encode_staged_dispatches(&self, pass: &mut wgpu::ComputePass<'_>, routing: Option<&StagedRouting>) {
        let per_batch = self.staged.as_ref().map_or(0, |s| s.1);
        self.encode_append_dispatches(pass, per_batch, routing.map(|r| &r.bind));
    }

    /// Whether `routing` still serves staged batches of `per_batch` tokens (the scratch it
    /// writes into was not reallocated since it was bound).
    pub fn staged_routing_fits(&self, routing: &StagedRouting, per_batch: u32) -> bool {
        routing.per_batch == per_batch && self.scratch.as_ref().is_some_and(|s| s.capacity == routing.scratch_capacity)
    }

    /// The routing pass of a staged batch of `per_batch` tokens that is router layer `layer`
    /// (rows `layer * row_stride ..` of `routed`): for [`KvPool::encode_staged_append`]. Made
    /// once; valid while the staged batches keep that size.
    pub fn bind_staged_routing(&mut self, rt: &Runtime, routed: Routed<'_>, layer: u32, per_batch: u32) -> Result<StagedRouting> {
        if per_batch == 0 || per_batch != routed.per_layer || per_batch > routed.row_stride {
            return Err(Error::Input(format!(
                "staged routing: batches of {per_batch} tokens, router layers of {} within rows of {}",
                routed.per_layer, routed.row_stride
            )));
        }
        self.ensure_scratch(rt, per_batch);
        let Some(s) = self.scratch.as_ref() else { unreachable!("scratch ensured above") };
        let bind = self.apply_routing_bind(rt, &s.new_tokens, routed, per_batch, layer * routed.row_stride);
        Ok(StagedRouting { bind, per_batch, scratch_capacity: s.capacity })
    }

    /// `append/apply_routing`'s bind group: `n_tokens` token records in `new_tokens` take their
    /// experts and gates from `routed`, the first from router row `first_row`.
    fn apply_routing_bind(
        &self,
        rt: &Runtime,
        new_tokens: &wgpu::Buffer,
        routed: Routed<'_>,
        n_tokens: u32,
        first_row: u32,
    ) -> wgpu::BindGroup {
        let ap = ApplyParams {
            n_tokens,
            token_words: token_words(self.cfg.top_k),
            per_layer: routed.per_layer,
            row_stride: routed.row_stride,
            first_row,
            _pad: [0; 3],
        };
        let u = rt.uniform("append/apply_routing params", &ap);
        rt.bind(Kernel::AppendApplyRouting.label(), &self.apply_pipe, &[&self.geometry, &u, routed.experts, routed.gates, new_tokens])
    }

    /// Rebuild the page lists of `layers` (all sequences) from the rings.
    pub fn encode_gather(
        &self,
        rt: &Runtime,
        enc: &mut wgpu::CommandEncoder,
        first_layer: u32,
        n_layers: u32,
        timestamps: Option<wgpu::ComputePassTimestampWrites<'_>>,
    ) {
        rt.queue.write_buffer(&self.gather_params, 0, bytemuck::bytes_of(&GatherParams { first_layer, ..Default::default() }));
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some(Kernel::AppendGatherPages.label()),
            timestamp_writes: timestamps,
        });
        pass.set_pipeline(&self.gather_pipe);
        pass.set_bind_group(0, &self.gather_bg, &[]);
        pass.dispatch_counted(self.cfg.max_seqs * self.cfg.kv_heads, n_layers, 1);
    }

    /// Rebuild the page lists of layer `layer` alone, recorded into `enc` without a queue write
    /// (the layer's parameters are copied in place), so one submission can gather layer after
    /// layer between appends.
    pub fn encode_gather_layer(&self, enc: &mut wgpu::CommandEncoder, layer: u32) -> Result<()> {
        self.copy_gather_params(enc, layer)?;
        let mut pass =
            enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some(Kernel::AppendGatherPages.label()), timestamp_writes: None });
        self.encode_gather_dispatch(&mut pass);
        Ok(())
    }

    /// The copy of [`KvPool::encode_gather_layer`]: layer `layer`'s gather parameters into place.
    pub fn copy_gather_params(&self, enc: &mut wgpu::CommandEncoder, layer: u32) -> Result<()> {
        if layer >= self.cfg.layers {
            return Err(Error::Input(format!("gather: layer {layer} of {}", self.cfg.layers)));
        }
        let pb = std::mem::size_of::<GatherParams>() as u64;
        enc.copy_buffer_to_buffer(&self.gather_layers, pb * u64::from(layer), &self.gather_params, 0, pb);
        Ok(())
    }

    /// The gather of the layer whose parameters [`KvPool::copy_gather_params`] put in place.
    pub fn encode_gather_dispatch(&self, pass: &mut wgpu::ComputePass<'_>) {
        pass.set_pipeline(&self.gather_pipe);
        pass.set_bind_group(0, &self.gather_bg, &[]);
        pass.dispatch_counted(self.cfg.max_seqs * self.cfg.kv_heads, 1, 1);
    }

    /// The runtime the pool was made with.
    pub fn owner(&self) -> crate::runtime::RuntimeId {
        self.owner
    }

    /// Gather the page lists of every layer, in its own submission.
    pub fn gather(&self, rt: &Runtime) -> Result<()> {
        rt.check_owner(self.owner, "this pool")?;
        let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("append/gather") });
        self.encode_gather(rt, &mut enc, 0, self.cfg.layers, None);
        rt.queue.submit([enc.finish()]);
        rt.check("append/gather_pages")
    }

    /// Release the `counts[key]` oldest pages of each shard ring back to the free stack.
    /// Keys are `((layer * max_seqs + seq) * kv_heads + head) * n_shards + shard`.
    pub fn release(&self, rt: &Runtime, counts: &[u32]) -> Result<()> {
        rt.check_owner(self.owner, "this pool")?;
        if counts.len() != self.cfg.n_keys() as usize {
            return Err(Error::Input(format!("release counts: {} entries, the pool has {} shard rings", counts.len(), self.cfg.n_keys())));
        }
        rt.queue.write_buffer(&self.release_counts, 0, bytemuck::cast_slice(counts));
        let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("append/release") });
        {
            let mut pass =
                enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some(Kernel::AppendRelease.label()), timestamp_writes: None });
            pass.set_pipeline(&self.release_pipe);
            pass.set_bind_group(0, &self.release_bg, &[]);
            pass.dispatch_counted(1, 1, 1);
        }
        rt.queue.submit([enc.finish()]);
        rt.check("append/release")
    }

    /// Release every page of one sequence (all layers and shards).
    pub fn release_sequence(&self, rt: &Runtime, seq: u32) -> Result<()> {
        if seq >= self.cfg.max_seqs {
            return Err(Error::Input(format!("sequence {seq} out of range (max_seqs = {})", self.cfg.max_seqs)));
        }
        let mut counts = vec![0u32; self.cfg.n_keys() as usize];
        for layer in 0..self.cfg.layers {
            for h in 0..self.cfg.kv_heads {
                for s in 0..self.cfg.n_shards {
                    counts[(((layer * self.cfg.max_seqs + seq) * self.cfg.kv_heads + h) * self.cfg.n_shards + s) as usize] = u32::MAX;
                }
            }
        }
        self.release(rt, &counts)
    }

    /// Read the pool's control block (free-stack tops, error flags, counters) back.
    pub async fn read_ctl(&self, rt: &Runtime) -> Result<PoolCtl> {
        rt.check_owner(self.owner, "this pool")?;
        Ok(rt.read::<PoolCtl>(&self.ctl, 0, 1).await?[0])
    }

    /// Turn the pool's sticky error flags into an error (and clear them).
    pub async fn check_errors(&self, rt: &Runtime, needed_hint: u32) -> Result<PoolCtl> {
        let ctl = self.read_ctl(rt).await?;
        if ctl.error_flags != 0 {
            let mut cleared = ctl;
            cleared.error_flags = 0;
            cleared.abort = 0;
            rt.queue.write_buffer(&self.ctl, 0, bytemuck::bytes_of(&cleared));
            if ctl.error_flags & pool_errors::POOL_EXHAUSTED != 0 {
                return Err(Error::PoolExhausted { needed: needed_hint, free: ctl.free_top, total: self.cfg.n_pages });
            }
            if ctl.error_flags & pool_errors::RING_FULL != 0 {
                return Err(Error::Input(format!(
                    "a sequence outgrew its ring of {} pages in a pool with the {} codec (its oldest page is compressed and cannot be recycled); the batch was refused: give the pool room for the longest sequence",
                    self.cfg.ring_capacity,
                    self.cfg.codec.name()
                )));
            }
            return Err(Error::Input(format!(
                "a token named a layer or sequence outside the pool (layers = {}, max_seqs = {}); the batch was refused",
                self.cfg.layers, self.cfg.max_seqs
            )));
        }
        Ok(ctl)
    }

    /// The plan of the last append (placement of each (token, KV head), token-major), for tests
    /// and traces.
    pub async fn read_last_plan(&self, rt: &Runtime, n: u32) -> Result<Vec<TokenPlan>> {
        match &self.scratch {
            Some(s) => rt.read(&s.plan, 0, u64::from(n) * u64::from(self.cfg.kv_heads)).await,
            None => Ok(Vec::new()),
        }
    }

    /// A whole buffer as a readback range of u32 words.
    fn whole(b: &wgpu::Buffer) -> (&wgpu::Buffer, u64, u64) {
        (b, 0, b.size() / 4)
    }

    /// Read the whole pool state but the K/V words back ([`KvPool::read_kv`] reads those).
    pub async fn snapshot(&self, rt: &Runtime) -> Result<PoolSnapshot> {
        rt.check_owner(self.owner, "this pool")?;
        // One readback for every table (a host tier reads them every layer of a step).
        let words = rt.read_many::<u32>(&self.snapshot_ranges()).await?;
        Ok(self.snapshot_from(words))
    }

    /// The readback ranges (buffer, first word, words) of a [`KvPool::snapshot`], for a caller
    /// that reads them with other buffers in one [`Runtime::read_many`] and hands the words to
    /// [`KvPool::snapshot_from`].
    pub fn snapshot_ranges(&self) -> Vec<(&wgpu::Buffer, u64, u64)> {
        let mut ranges = self.ring_tables_ranges();
        ranges.extend([
            Self::whole(&self.free_stack),
            (&self.ctl, 0, (std::mem::size_of::<PoolCtl>() / 4) as u64),
            Self::whole(&self.slot_meta),
        ]);
        if self.codec.is_some() {
            ranges.push(Self::whole(&self.codec_free));
        }
        ranges
    }

    /// The readback ranges of the tables that say which pages each ring holds (rings, ring
    /// pages, page owners and fills), for [`KvPool::ring_tables_from`].
    pub fn ring_tables_ranges(&self) -> Vec<(&wgpu::Buffer, u64, u64)> {
        vec![Self::whole(&self.rings), Self::whole(&self.ring_pages), Self::whole(&self.page_meta)]
    }

    /// The ring tables read as [`KvPool::ring_tables_ranges`] says, one word vector a range.
    pub fn ring_tables_from(&self, words: Vec<Vec<u32>>) -> RingTables {
        let mut words = words.into_iter();
        let mut next = || words.next().unwrap_or_default();
        let (rings, ring_pages, page_meta) = (next(), next(), next());
        RingTables { rings: cast_words(&rings), ring_pages, page_meta: cast_words(&page_meta) }
    }

    /// The snapshot read as [`KvPool::snapshot_ranges`] says, one word vector a range.
    pub fn snapshot_from(&self, mut words: Vec<Vec<u32>>) -> PoolSnapshot {
        let rest = words.split_off(words.len().min(3));
        let RingTables { rings, ring_pages, page_meta } = self.ring_tables_from(words);
        let mut words = rest.into_iter();
        let mut next = || words.next().unwrap_or_default();
        let (free_stack, ctl, slot_meta) = (next(), next(), next());
        PoolSnapshot {
            rings,
            ring_pages,
            page_meta,
            free_stack,
            ctl: cast_words::<PoolCtl>(&ctl).first().copied().unwrap_or_default(),
            slot_meta,
            codec_free: next(),
        }
    }

    /// All K/V words, pages in global order (concatenating the pool buffers).
    pub async fn read_kv(&self, rt: &Runtime) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        for b in &self.kv_buffers {
            out.extend(rt.read_all::<u32>(b).await?);
        }
        Ok(out)
    }

    /// Page lists (per layer, sequence and KV head) and their lengths, as built by the last gather.
    pub async fn read_page_lists(&self, rt: &Runtime) -> Result<(Vec<u32>, Vec<u32>)> {
        Ok((rt.read_all(&self.page_list).await?, rt.read_all(&self.page_counts).await?))
    }
}
