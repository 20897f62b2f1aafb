//! The decode pipeline as it stands. Every step, on the GPU: route each sequence's new token at
//! every layer with the configured router (its statistics live on the GPU), append the tokens
//! into their shards with the routed experts (no host round trip), rebuild the page lists, run
//! decode attention per layer, evict down to the budget with the configured scheduler, and
//! recount each expert's miss rate from the pool for the next step's routing. The host reads
//! back only counters and small statistics for the report. With a scheduler, a second pool
//! keeps the full cache and runs the same attention, so the report carries the attention error
//! of the budgeted cache against the full one.

mod config;
mod lockstep;
mod report;
mod stages;

pub use config::DemoConfig;
pub use lockstep::{VerifyReport, check_eviction, compare_pool, pool_model_of};
pub use report::{LayerRecord, ReportParts, StageTimes, StepReport};

use lockstep::Checked;
use report::Slot;
use stages::Stages;

use crate::append::KvPool;
use crate::attend::{AttendOptions, Attention};
use crate::config::{Codec, KvDtype};
use crate::error::{Error, Result};
use crate::evict::config::SchedulerConfig;
use crate::evict::flexgen::FlexGen;
use crate::evict::quest::Quest;
use crate::evict::{AllocatorSpec, Scheduler};
use crate::reference::append::decode_words;
use crate::route::{RouteShape, Router};
use crate::runtime::Runtime;
use crate::runtime::timer::GpuTimer;
use crate::workload::{GenToken, Workload};
use crate::{append::format::encode_values, reference::PoolModel};

/// The full-cache pool and its attention, kept beside a budgeted pool to measure its error.
struct Reference {
    pool: KvPool,
    attn: Attention,
}

/// A demo run's decode pipeline: the KV pool with its router, attention and scheduler on the GPU,
/// fed by the synthetic workload, one [`Pipeline::step`] at a time after [`Pipeline::prefill`].
pub struct Pipeline {
    /// The configuration the run was built from.
    pub cfg: DemoConfig,
    /// The KV pool: the budgeted cache with a scheduler or a codec, else the whole cache.
    pub pool: KvPool,
    /// Decode attention over `pool` (under QUEST, over its selected pages).
    pub attn: Attention,
    /// The route stage: each new token's experts, with the statistics the routers keep on the GPU.
    pub router: Router,
    /// The evicting scheduler; `None` without one, and under QUEST and FlexGen, which select or
    /// place pages instead.
    pub scheduler: Option<Scheduler>,
    /// QUEST page selection, when it is the configured scheduler.
    pub quest: Option<Quest>,
    /// FlexGen placement, with the QUEST page bounds it scores host pages by.
    pub flexgen: Option<(FlexGen, Quest)>,
    /// The generator of the run's tokens (K, V, router logits) and queries.
    pub workload: Workload,
    reference: Option<Reference>,
    model: Option<PoolModel>,
    timer: Option<GpuTimer>,
    step: u32,
    /// Tokens routed so far (the hash router numbers tokens by this).
    routed_tokens: u32,
    last_queries: Vec<f32>,
    /// Prompt positions per prefill batch.
    prefill_chunk: u32,
    checked: Checked,
}

fn kv_words(tokens: &[GenToken], dtype: KvDtype) -> Vec<u32> {
    let mut words = Vec::new();
    for t in tokens {
        encode_values(&t.k, dtype, &mut words);
        encode_values(&t.v, dtype, &mut words);
    }
    words
}

/// Positions of every sequence per prefill batch: whole positions of every layer and sequence,
/// within what one append may carry.
fn prefill_positions(max_append: u32, n_seqs: u32, layers: u32) -> u32 {
    (max_append / (n_seqs * layers)).clamp(1, 256)
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    if den > 0.0 { (num / den).sqrt() } else { num.sqrt() }
}

impl Pipeline {
    /// Check `cfg` and build the run on `rt`: the pool, router, attention and scheduler, a CPU
    /// lockstep with `verify`, and a full-cache reference pool with `reference_attention` where a
    /// scheduler or codec shrinks the cache. Runs the kernels once over the empty pool so that the
    /// first step's time is the step's own.
    pub async fn new(rt: &Runtime, cfg: DemoConfig) -> Result<Pipeline> {
        let budget = cfg.budget_tokens()?;
        if let Some(s) = &cfg.scheduler {
            s.check_codec(cfg.codec)?;
        }
        if let (Some(s), Some(b)) = (&cfg.scheduler, budget) {
            s.validate(b)?;
        }
        if let Some(a) = &cfg.allocator {
            a.validate()?;
            if !cfg.scheduler.as_ref().is_some_and(SchedulerConfig::uses_evict_kernels) {
                return Err(Error::config(
                    "allocator",
                    "ekva",
                    format!(
                        "the EKVA allocator splits an evicting scheduler's budgets (h2o, streaming-llm, lru, lru-plus, adakv, duo, fastv-tokens), not {}",
                        cfg.scheduler.as_ref().map_or("none", |s| s.name())
                    ),
                ));
            }
        }
        cfg.layer_budgets()?;
        let pool_cfg = cfg.pool_config();
        let workload = Workload::new(cfg.workload.clone())?;
        let w = &cfg.workload;
        let pool = KvPool::new(rt, pool_cfg.clone()).await?;
        if pool.max_append_tokens(rt) < w.n_seqs * w.layers {
            return Err(Error::config(
                "seqs",
                w.n_seqs,
                format!("one decode step appends seqs x layers = {} tokens, more than an append may carry here", w.n_seqs * w.layers),
            ));
        }
        let reference_pool = if (cfg.scheduler.is_some() || cfg.codec != Codec::None) && cfg.reference_attention {
            Some(KvPool::new(rt, cfg.full_pool_config()).await?)
        } else {
            None
        };
        let max_append =
            reference_pool.as_ref().map_or(pool.max_append_tokens(rt), |r| r.max_append_tokens(rt).min(pool.max_append_tokens(rt)));
        let mut positions = prefill_positions(max_append, w.n_seqs, w.layers);
        if let (Some(b), true) = (budget, cfg.scheduler.as_ref().is_some_and(SchedulerConfig::evicts)) {
            positions = positions.min(cfg.evicting_chunk(b));
        }
        if cfg.codec.is_low_rank() {
            if cfg.calibration == 0 || cfg.basis_iters == 0 {
                return Err(Error::config(
                    "calibration",
                    cfg.calibration,
                    "the low-rank fit needs calibration >= 1 position and basis_iters >= 1",
                ));
            }
            positions = positions.min(cfg.calibration);
        }
        let shape = RouteShape { n_experts: w.n_experts, top_k: w.top_k, layers: w.layers, max_tokens: positions * w.n_seqs };
        let mut router = Router::new(rt, cfg.router.clone(), shape, cfg.route_ema).await?;
        router.bind_pool(rt, &pool)?;
        let attend_opts = AttendOptions {
            group: w.group,
            n_seqs: w.n_seqs,
            chunk_pages: cfg.chunk_pages,
            // The attention-mass pass feeds the evicting and placing schedulers (utilities,
            // kept-attention share); the full cache, QUEST and the codecs do without it.
            mass: cfg.scheduler.as_ref().is_some_and(|s| !matches!(s, SchedulerConfig::Quest)),
            variant: None,
            ..Default::default()
        };
        let mut flexgen = None;
        let (attn, scheduler, quest) = match (&cfg.scheduler, budget) {
            (Some(SchedulerConfig::FlexGen), Some(b)) => {
                flexgen = Some((FlexGen::new(&pool, b)?, Quest::new(rt, &pool, b).await?));
                (Attention::new(rt, &pool, attend_opts.clone()).await?, None, None)
            }
            (Some(SchedulerConfig::Quest), Some(b)) => {
                let mut q = Quest::new(rt, &pool, b).await?;
                let attn = Attention::with_lists(rt, &pool, attend_opts.clone(), Some((&q.sel_list, &q.sel_counts))).await?;
                q.bind(rt, &pool, &attn);
                (attn, None, Some(q))
            }
            (Some(s), Some(b)) => (
                Attention::new(rt, &pool, attend_opts.clone()).await?,
                Some(
                    Scheduler::with_allocator(
                        rt,
                        &pool,
                        s.clone(),
                        b,
                        cfg.pyramid,
                        cfg.threshold,
                        cfg.allocator.map(|a| AllocatorSpec { cfg: a, n_experts: w.n_experts, route_stats: Some(&router.stats) }),
                    )
                    .await?,
                ),
                None,
            ),
            _ => (Attention::new(rt, &pool, attend_opts.clone()).await?, None, None),
        };
        let reference = match reference_pool {
            Some(rpool) => {
                let rattn = Attention::new(rt, &rpool, AttendOptions { mass: false, ..attend_opts }).await?;
                Some(Reference { pool: rpool, attn: rattn })
            }
            None => None,
        };
        // Some drivers compile on first dispatch: run the kernels once over the empty pool (no
        // page is touched) so that the first step's time is the step's.
        pool.gather(rt)?;
        attn.run(rt, 0, 0)?;
        rt.wait()?;
        let timer = GpuTimer::new(rt, Slot::pairs(w.layers));
        let model = cfg.verify.then(|| PoolModel::new(&pool_cfg));
        Ok(Pipeline {
            cfg,
            pool,
            attn,
            router,
            scheduler,
            quest,
            flexgen,
            workload,
            reference,
            model,
            timer,
            step: 0,
            routed_tokens: 0,
            last_queries: Vec::new(),
            prefill_chunk: positions,
            checked: Checked::default(),
        })
    }

    /// Summarise changed pages (QUEST bounds) and read every page's bounds back.
    async fn refresh_bounds(&self, rt: &Runtime) -> Result<Vec<f32>> {
        let Some((_, q)) = &self.flexgen else {
            return Ok(Vec::new());
        };
        let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("evict/quest_summarize") });
        {
            let mut pass =
                enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("evict/quest_summarize"), timestamp_writes: None });
            q.encode_summarize(&mut pass);
        }
        rt.queue.submit([enc.finish()]);
        rt.read_all(&q.bounds).await
    }

    /// Append the prompt of every sequence, routed on the GPU (with a scheduler: attend and
    /// evict after each batch). `progress(done, total)` after each batch.
    pub async fn prefill(&mut self, rt: &Runtime, progress: &mut dyn FnMut(u64, u64)) -> Result<()> {
        let w = self.cfg.workload.clone();
        let total = u64::from(w.prompt_len) * u64::from(w.n_seqs * w.layers);
        let mut done = 0;
        let mut left = w.prompt_len;
        let attend = self.scheduler.is_some() || self.flexgen.is_some();
        while left > 0 {
            let positions = self.prefill_chunk.min(left);
            let tokens = self.workload.next_positions(positions);
            let queries = if attend { (0..w.layers).map(|l| self.workload.queries(l)).collect() } else { Vec::new() };
            let st = Stages { per_layer: positions * w.n_seqs, timed: false, fused: self.fused(), attend, miss: false };
            self.run_stages(rt, &tokens, queries, st).await?;
            left -= positions;
            done += tokens.len() as u64;
            progress(done, total);
        }
        self.update_miss(rt)?;
        rt.wait()?;
        // For the message of an exhausted pool: the pages the whole prompt takes.
        let c = &self.pool.cfg;
        let prompt_pages = w.prompt_len.div_ceil(c.page_size) * w.n_seqs * w.layers * c.kv_heads;
        self.pool.check_errors(rt, prompt_pages).await?;
        if let Some(r) = &self.reference {
            r.pool.check_errors(rt, prompt_pages).await?;
        }
        Ok(())
    }

    /// Recount each expert's cached tokens and miss rate (after the prefill).
    fn update_miss(&self, rt: &Runtime) -> Result<()> {
        let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("route/miss") });
        self.router
            .encode_miss(&mut enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("route/miss"), timestamp_writes: None }))?;
        rt.queue.submit([enc.finish()]);
        Ok(())
    }

    /// Whether a step runs as one submission with no host round trip: nothing on the side needs
    /// the host mid-step (no CPU lockstep, no full-cache reference, no host tier, no QUEST
    /// selection, a low-rank basis already fitted).
    pub fn fused(&self) -> bool {
        self.model.is_none()
            && self.reference.is_none()
            && self.flexgen.is_none()
            && self.quest.is_none()
            && (!self.pool.cfg.codec.is_low_rank() || self.pool.calibrated)
    }

    /// This step's synthetic inputs: every layer's new tokens, then every layer's queries (the
    /// order the generator has always drawn them in, so runs repeat).
    fn next_inputs(&mut self) -> (Vec<GenToken>, Vec<Vec<f32>>) {
        let tokens = self.workload.next_tokens();
        let queries = (0..self.pool.cfg.layers).map(|l| self.workload.queries(l)).collect();
        (tokens, queries)
    }

    /// One decode step: route, append, gather, attend every layer, evict, recount miss rates.
    pub async fn step(&mut self, rt: &Runtime) -> Result<StepReport> {
        #[cfg(not(target_arch = "wasm32"))]
        let t0 = std::time::Instant::now();
        let n_seqs = self.cfg.workload.n_seqs;
        let layers = self.pool.cfg.layers;
        let (tokens, queries) = self.next_inputs();
        let st = Stages { per_layer: n_seqs, timed: true, fused: self.fused(), attend: true, miss: true };
        let attention_error = self.run_stages(rt, &tokens, queries, st).await?;
        rt.wait()?;
        let ctl = self.pool.check_errors(rt, n_seqs * layers).await?;
        let gpu = match &self.timer {
            Some(t) => Some(StageTimes::from_pairs(&t.read_ms(rt, Slot::pairs(layers)).await?, layers)),
            None => None,
        };
        #[cfg(not(target_arch = "wasm32"))]
        let host_ms = t0.elapsed().as_secs_f64() * 1e3;
        #[cfg(target_arch = "wasm32")]
        let host_ms = f64::NAN;
        let parts =
            ReportParts { pool: &self.pool, router: Some(&self.router), scheduler: self.scheduler.as_ref(), quest: self.quest.as_ref() };
        let mut report = StepReport::collect(rt, parts, ctl, (self.step, self.workload.position(0)), gpu, host_ms).await?;
        report.attention_error = attention_error;
        if let Some((fg, _)) = &self.flexgen {
            report.host_kv_bytes = fg.stats.host_bytes;
            report.tier_bytes_moved = fg.stats.bytes_to_host + fg.stats.bytes_to_gpu;
        }
        if let Some(r) = &self.reference {
            let c = r.pool.read_ctl(rt).await?;
            report.full_kv_bytes = Some(u64::from(r.pool.cfg.n_pages - c.free_top) * r.pool.cfg.page_bytes());
        }
        self.step += 1;
        Ok(report)
    }
    /// With a codec and the reference pool: the relative L2 error of the decoded keys and values of
    /// every compressed page against the same tokens in the full f16 cache (pages pair up by
    /// their place in the page lists, which both pools build alike). `None` without both.
    pub async fn reconstruction_error(&self, rt: &Runtime) -> Result<Option<(f64, f64)>> {
        let (Some(r), true) = (&self.reference, self.pool.cfg.codec != Codec::None) else {
            return Ok(None);
        };
        let c = &self.pool.cfg;
        let rc = &r.pool.cfg;
        let (lists, counts) = self.pool.read_page_lists(rt).await?;
        let (rlists, rcounts) = r.pool.read_page_lists(rt).await?;
        let codec_kv = self.pool.read_codec_kv(rt).await?;
        let basis = self.pool.read_basis(rt).await?;
        let rkv = r.pool.read_kv(rt).await?;
        let meta: Vec<crate::gpu_data::PageMeta> = rt.read_all(&self.pool.page_meta).await?;
        let cw = c.codec.page_words(c.page_size, c.head_dim) as usize;
        let (rpw, vw) = (rc.page_words() as usize, rc.vec_words() as usize);
        let maxp = c.max_pages_per_seq() as usize;
        let (mut num, mut den) = ([0f64; 2], [0f64; 2]);
        for li in 0..c.n_lists() as usize {
            if counts[li] != rcounts[li] {
                return Err(Error::Gpu {
                    during: "reconstruction error".into(),
                    message: format!("page list {li} differs from the reference's"),
                });
            }
            for i in 0..counts[li] as usize {
                let page = lists[li * maxp + i];
                if page < c.n_pages {
                    continue;
                }
                let rpage = rlists[li * maxp + i] as usize;
                let c0 = (page - c.n_pages) as usize * cw;
                for s in 0..meta[page as usize].fill as usize {
                    for kv in 0..2 {
                        let basis = crate::reference::compress::basis_slice(c, &basis, meta[page as usize].owner);
                        let got = crate::reference::compress::decode_vector(c, &codec_kv[c0..c0 + cw], basis, kv, s);
                        let o = rpage * rpw + kv * rc.page_size as usize * vw + s * vw;
                        let want = decode_words(&rkv[o..o + vw], rc.dtype);
                        for (g, w) in got.iter().zip(&want) {
                            num[kv] += (g - w).powi(2);
                            den[kv] += w * w;
                        }
                    }
                }
            }
        }
        let rel = |k: usize| if den[k] > 0.0 { (num[k] / den[k]).sqrt() } else { 0.0 };
        Ok(Some((rel(0), rel(1))))
    }
}
