//! Page codecs: full pages of the pool re-encoded into smaller ones (int8 and int4 with per-channel
//! or per-group scales, low-rank and LoRA projections), chosen on the GPU by
//! `compress/plan.wgsl` and written by `compress/encode.wgsl` into the pool's compressed ids
//! (`n_pages..n_ids`); the low-rank bases are fitted once on a calibration window
//! (`compress/gram.wgsl`, `compress/basis.wgsl`). CPU reference: `reference/compress.rs`.

use expertkv_shaders::Kernel;

use crate::append::{CodecPasses, KvPool, LowRankFit};
use crate::config::Codec;
use crate::error::{Error, Result};
use crate::page_passes::PagePasses;
use crate::runtime::Runtime;
use crate::runtime::dispatch::CountedDispatch;

/// Subspace iterations of the low-rank fit unless told otherwise.
pub const DEFAULT_BASIS_ITERS: u32 = 24;

impl LowRankFit {
    /// The fit's buffers and passes for a low-rank pool; `None` for the other codecs.
    pub(crate) async fn new(rt: &Runtime, pool: &KvPool) -> Result<Option<LowRankFit>> {
        let KvPool { cfg, geometry, kv_buffers, window_bufs, page_list, page_counts, page_meta, codec_basis, .. } = pool;
        let Some(rank) = cfg.codec.rank() else { return Ok(None) };
        let fits = cfg.layers * cfg.basis_heads();
        let d = u64::from(cfg.head_dim);
        let gram_bytes = u64::from(fits) * 2 * d * d * 4;
        rt.fits_binding("low-rank Gram matrices", gram_bytes)?;
        let gram = rt.storage("codec gram", gram_bytes);
        let work = rt.storage("codec basis work", u64::from(fits) * 4 * d * u64::from(rank) * 4);
        let gram_p = rt.pipeline(Kernel::CompressGram, &[]).await?;
        let gram_bgs = kv_buffers
            .iter()
            .zip(window_bufs)
            .map(|(kv, w)| rt.bind(Kernel::CompressGram.label(), &gram_p, &[geometry, w, page_list, page_counts, page_meta, kv, &gram]))
            .collect();
        // Each entry point's automatic layout holds only the bindings it uses.
        let mut basis_passes = Vec::new();
        for (k, used) in [
            (Kernel::CompressBasisInit, vec![(0, geometry), (2, &work)]),
            (Kernel::CompressBasisIterate, vec![(0, geometry), (1, &gram), (2, &work)]),
            (Kernel::CompressBasisFinish, vec![(0, geometry), (2, &work), (3, codec_basis)]),
        ] {
            let p = rt.pipeline(k, &[]).await?;
            let bg = rt.bind_at(k.label(), &p, &used);
            basis_passes.push((p, bg));
        }
        let basis_passes: [(wgpu::ComputePipeline, wgpu::BindGroup); 3] =
            basis_passes.try_into().map_err(|_| Error::Input("basis passes".into()))?;
        Ok(Some(LowRankFit { gram, gram_pass: (gram_p, gram_bgs), basis_passes, _work: work, fits }))
    }
}

impl CodecPasses {
    /// The compression passes of a pool with a codec; `None` without one.
    pub(crate) async fn new(rt: &Runtime, pool: &KvPool) -> Result<Option<CodecPasses>> {
        let KvPool {
            cfg,
            geometry,
            kv_buffers,
            window_bufs,
            rings,
            ring_pages,
            page_meta,
            free_stack,
            ctl,
            codec_kv,
            codec_free,
            slot_meta,
            codec_basis,
            ..
        } = pool;
        if cfg.codec == Codec::None {
            return Ok(None);
        }
        let codec_pages = cfg.n_ids() - cfg.n_pages;
        let jobs = rt.storage("codec jobs", u64::from(codec_pages) * 8);
        let dispatch = rt.indirect_args("codec dispatch");
        let n_keys = cfg.n_keys();
        let plan_counts = rt.storage("codec plan counts", u64::from(n_keys.max(1)) * 4);
        let plan_state = rt.storage("codec plan state", 16);
        let passes = PagePasses::new(
            rt,
            [
                (Kernel::CompressPlanCount, vec![(0, geometry), (1, rings), (2, ring_pages), (3, page_meta), (9, &plan_counts)]),
                (Kernel::CompressPlan, vec![(0, geometry), (6, ctl), (8, &dispatch), (9, &plan_counts), (10, &plan_state)]),
                (
                    Kernel::CompressPlanAssign,
                    vec![
                        (0, geometry),
                        (1, rings),
                        (2, ring_pages),
                        (3, page_meta),
                        (4, free_stack),
                        (5, codec_free),
                        (7, &jobs),
                        (9, &plan_counts),
                        (10, &plan_state),
                    ],
                ),
            ],
            Kernel::CompressEncode,
            kv_buffers.iter().zip(window_bufs).map(|(kv, w)| vec![geometry, w, &jobs, kv, codec_kv, slot_meta, page_meta, codec_basis]),
            dispatch.clone(),
            n_keys,
        )
        .await?;
        Ok(Some(CodecPasses { passes, _buffers: [jobs, plan_counts, plan_state] }))
    }
}

impl KvPool {
    /// Compress every full raw page that is no longer its ring's newest, while compressed pages
    /// last (no-op without a codec).
    pub fn encode_compress(&self, pass: &mut wgpu::ComputePass<'_>) {
        let Some(c) = &self.codec else { return };
        if !self.ready_to_compress() {
            return;
        }
        c.passes.encode(pass);
    }

    /// Whether full pages may be encoded now (a low-rank codec needs its basis first).
    pub fn ready_to_compress(&self) -> bool {
        self.codec.is_some() && (self.fit.is_none() || self.calibrated)
    }

    /// Fit the low-rank codecs' basis on the raw pages cached now (the calibration window):
    /// gather the page lists, build every Gram matrix, run `iters` subspace iterations. Call once,
    /// before the first compression; the basis then stays fixed (encoded pages depend on it).
    pub fn calibrate(&mut self, rt: &Runtime, iters: u32) -> Result<()> {
        let Some(fit) = &self.fit else {
            return Err(Error::config("codec", self.cfg.codec.name(), "only the low-rank codecs (low-rank, lora) are calibrated"));
        };
        if self.calibrated {
            return Err(Error::Input("the low-rank basis is already fitted: encoded pages depend on it".into()));
        }
        self.gather(rt)?;
        let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("codec calibrate") });
        enc.clear_buffer(&fit.gram, 0, None);
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("codec calibrate"), timestamp_writes: None });
            let d = self.cfg.head_dim;
            pass.set_pipeline(&fit.gram_pass.0);
            for bg in &fit.gram_pass.1 {
                pass.set_bind_group(0, bg, &[]);
                pass.dispatch_counted((d * d).div_ceil(64), fit.fits, 2);
            }
            for (i, (p, bg)) in fit.basis_passes.iter().enumerate() {
                pass.set_pipeline(p);
                pass.set_bind_group(0, bg, &[]);
                for _ in 0..if i == 1 { iters } else { 1 } {
                    pass.dispatch_counted(fit.fits, 2, 1);
                }
            }
        }
        rt.queue.submit([enc.finish()]);
        rt.check("codec calibrate")?;
        self.calibrated = true;
        Ok(())
    }

    /// The fitted basis (see [`KvPool::codec_basis`]); empty for the other codecs.
    pub async fn read_basis(&self, rt: &Runtime) -> Result<Vec<f32>> {
        if self.fit.is_none() {
            return Ok(Vec::new());
        }
        rt.read_all(&self.codec_basis).await
    }

    /// The Gram matrices of the last calibration (tests).
    pub async fn read_gram(&self, rt: &Runtime) -> Result<Vec<f32>> {
        match &self.fit {
            Some(f) => rt.read_all(&f.gram).await,
            None => Ok(Vec::new()),
        }
    }

    /// [`KvPool::encode_compress`] in its own submission.
    pub fn compress(&self, rt: &Runtime) -> Result<()> {
        self.compress_timed(rt, None)
    }

    /// [`KvPool::compress`] with timestamps around its pass; the pass (empty without a codec)
    /// and its timestamps are there whenever `timestamps` is.
    pub fn compress_timed(&self, rt: &Runtime, timestamps: Option<wgpu::ComputePassTimestampWrites<'_>>) -> Result<()> {
        if self.codec.is_none() && timestamps.is_none() {
            return Ok(());
        }
        if self.codec.is_some() && !self.ready_to_compress() {
            return Err(Error::Input("a low-rank codec encodes pages only once its basis is fitted (KvPool::calibrate)".into()));
        }
        let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("codec") });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("codec"), timestamp_writes: timestamps });
            self.encode_compress(&mut pass);
        }
        rt.queue.submit([enc.finish()]);
        rt.check("codec")
    }

    /// Bytes allocated for compressed pages.
    pub fn codec_bytes_allocated(&self) -> u64 {
        if self.codec.is_some() { self.codec_kv.size() + if self.fit.is_some() { self.codec_basis.size() } else { 0 } } else { 0 }
    }

    /// Compressed page words (ids from `n_pages` on), in id order.
    pub async fn read_codec_kv(&self, rt: &Runtime) -> Result<Vec<u32>> {
        if self.codec.is_none() {
            return Ok(Vec::new());
        }
        rt.read_all(&self.codec_kv).await
    }
}

/// Thawing compressed pages under eviction (`compress/thaw_plan.wgsl`, `compress/thaw.wgsl`):
/// between victim selection and compaction, every compressed page a ring's compaction would
/// touch is decoded into a raw page, so compaction and freeing see only raw pages; the next
/// compress pass re-encodes the pages that are full again. A ring whose pages do not fit in the
/// raw pages free keeps its tokens this step (its eviction is deferred, and counted). Built by
/// the scheduler of a pool with a codec, bound to its victim marks. CPU reference:
/// `PoolModel::thaw`.
pub(crate) struct Thaw {
    /// count, main, assign; then the decode, once per raw pool buffer.
    passes: PagePasses,
    /// Raw and codec free tops before the last thaw, pages thawed and rings deferred by it, and
    /// both summed over every thaw so far.
    pub(crate) state: wgpu::Buffer,
    _buffers: [wgpu::Buffer; 2],
}

/// What the thaw under eviction (`compress/thaw_plan.wgsl`, `compress/thaw.wgsl`) has done: in the
/// last eviction and in all so far (see [`crate::evict::Scheduler::read_thaw`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ThawCounts {
    /// Compressed pages decoded back into raw pages by the last thaw.
    pub pages: u32,
    /// Shard rings whose eviction the last thaw deferred (their pages did not fit in the free
    /// raw pages, so they kept their tokens).
    pub deferred_rings: u32,
    /// `pages` summed over every thaw so far.
    pub pages_total: u32,
    /// `deferred_rings` summed over every thaw so far.
    pub deferred_rings_total: u32,
}

impl ThawCounts {
    pub(crate) fn from_state(s: &[u32]) -> ThawCounts {
        ThawCounts { pages: s[2], deferred_rings: s[3], pages_total: s[4], deferred_rings_total: s[5] }
    }
}

impl Thaw {
    /// The thaw passes of `pool` (which must have a codec), marking through `victim`.
    pub(crate) async fn new(rt: &Runtime, pool: &KvPool, victim: &wgpu::Buffer) -> Result<Thaw> {
        let KvPool {
            cfg,
            geometry,
            kv_buffers,
            window_bufs,
            rings,
            ring_pages,
            page_meta,
            free_stack,
            ctl,
            codec_kv,
            codec_free,
            slot_meta,
            codec_basis,
            page_gen,
            ..
        } = pool;
        if cfg.codec == Codec::None {
            return Err(Error::Input("thawing needs a pool with a codec".into()));
        }
        let n_keys = cfg.n_keys();
        let codec_pages = cfg.n_ids() - cfg.n_pages;
        let jobs = rt.storage("thaw jobs", u64::from(codec_pages.max(1)) * 8);
        let dispatch = rt.indirect_args("thaw dispatch");
        let counts = rt.storage("thaw counts", u64::from(n_keys.max(1)) * 4);
        let state = rt.storage_init("thaw state", &[0u32; 8]);
        let passes = PagePasses::new(
            rt,
            [
                (Kernel::CompressThawCount, vec![(0, geometry), (1, rings), (2, ring_pages), (9, &counts), (11, victim)]),
                (Kernel::CompressThawPlan, vec![(0, geometry), (6, ctl), (8, &dispatch), (9, &counts), (10, &state)]),
                (
                    Kernel::CompressThawAssign,
                    vec![
                        (0, geometry),
                        (1, rings),
                        (2, ring_pages),
                        (3, page_meta),
                        (4, free_stack),
                        (5, codec_free),
                        (7, &jobs),
                        (9, &counts),
                        (10, &state),
                        (11, victim),
                    ],
                ),
            ],
            Kernel::CompressThaw,
            kv_buffers
                .iter()
                .zip(window_bufs)
                .map(|(kv, w)| vec![geometry, w, &jobs, kv, codec_kv, slot_meta, victim, page_meta, codec_basis, page_gen]),
            dispatch.clone(),
            n_keys,
        )
        .await?;
        Ok(Thaw { passes, state, _buffers: [jobs, counts] })
    }

    /// Encode the thaw: plan (count, main, assign), then the decode per pool buffer.
    pub(crate) fn encode(&self, pass: &mut wgpu::ComputePass<'_>) {
        self.passes.encode(pass);
    }

    /// What the thaw has done.
    pub(crate) async fn read_counts(&self, rt: &Runtime) -> Result<ThawCounts> {
        Ok(ThawCounts::from_state(&rt.read_all::<u32>(&self.state).await?))
    }
}
