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
mod run;

pub use config::DemoConfig;
pub use lockstep::{VerifyReport, check_carried, check_eviction, compare_pool, pool_model_of};
pub use report::{LayerRecord, ReportParts, StageTimes, StepReport};

use lockstep::Checked;
use run::Stages;

use crate::append::KvPool;
use crate::attend::{AttendOptions, Attention};
use crate::config::{Codec, KvDtype};
use crate::error::{Error, Result};
use crate::evict::config::SchedulerConfig;
use crate::evict::recall::RecallConfig;
use crate::reference::append::decode_words;
use crate::reference::recall::TierModel;
use crate::route::Router;
use crate::runtime::Runtime;
use crate::step::{KvSide, KvSideConfig, RouteSpec, StepTimer, Timing};
use crate::workload::{GenToken, Workload};
use crate::{append::format::encode_values, reference::PoolModel};

/// The full-cache pool and its attention, kept beside a budgeted pool to measure its error.
struct Reference {
    pool: KvPool,
    attn: Attention,
}

/// A demo run's decode pipeline: the K/V side of the step ([`KvSide`]: the pool with its router,
/// attention and policy on the GPU), fed by the synthetic workload, one [`Pipeline::step`] at a
/// time after [`Pipeline::prefill`].
pub struct Pipeline {
    /// The configuration the run was built from.
    pub cfg: DemoConfig,
    /// The pool, its attention, the route stage (always on: the workload's router logits) and
    /// the policy over the pool.
    pub kv: KvSide,
    /// The generator of the run's tokens (K, V, router logits) and queries.
    pub workload: Workload,
    reference: Option<Reference>,
    model: Option<PoolModel>,
    timer: Option<StepTimer>,
    step: u32,
    /// Tokens routed so far (the hash router numbers tokens by this).
    routed_tokens: u32,
    last_queries: Vec<f32>,
    /// Prompt positions per prefill batch.
    prefill_chunk: u32,
    /// Low-rank codecs: positions every sequence holds before the basis is fitted (the first
    /// prefill batch).
    calibration_window: u32,
    /// A run's K/V words, every layer's (grown as needed).
    kv_stage: Option<wgpu::Buffer>,
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

/// Timed passes of a step of `layers` layers at most: route, append, compress, gather and
/// attention per layer; evict and the miss recount.
fn timed_passes(layers: u32) -> u32 {
    5 * layers + 2
}

impl Pipeline {
    /// Check `cfg` and build the run on `rt`: the K/V side ([`KvSide::new`]), a CPU lockstep
    /// with `verify`, and a full-cache reference pool with `reference_attention` where a
    /// scheduler or codec shrinks the cache. Runs the kernels once over the empty pool so that
    /// the first step's time is the step's own.
    pub async fn new(rt: &Runtime, cfg: DemoConfig) -> Result<Pipeline> {
        let budget = cfg.budget_tokens()?;
        cfg.layer_budgets()?;
        if cfg.verify && matches!(cfg.scheduler, Some(SchedulerConfig::FlexGen)) {
            return Err(Error::config("verify", true, "FlexGen moves pages through the host; run it with --no-verify"));
        }
        if cfg.verify && cfg.recall > 0 && cfg.codec != Codec::None {
            return Err(Error::config(
                "verify",
                true,
                "the CPU lockstep checks the recall tier over raw pages; run a codec with recall with --no-verify",
            ));
        }
        let pool_cfg = cfg.pool_config();
        let workload = Workload::new(cfg.workload.clone())?;
        let w = &cfg.workload;
        pool_cfg.validate()?;
        let max_pool_append = KvPool::max_append_tokens_of(rt, &pool_cfg);
        if max_pool_append < w.n_seqs * w.layers {
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
        let max_append = reference_pool.as_ref().map_or(max_pool_append, |r| r.max_append_tokens(rt).min(max_pool_append));
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
        let kv_cfg = KvSideConfig {
            pool: pool_cfg.clone(),
            policy: cfg.scheduler.clone().zip(budget),
            pyramid: cfg.pyramid,
            threshold: cfg.threshold,
            allocator: cfg.allocator,
            group: w.group,
            chunk_pages: cfg.chunk_pages,
            route: Some(RouteSpec {
                router: cfg.router.clone(),
                n_experts: w.n_experts,
                max_tokens: positions * w.n_seqs,
                ema: cfg.route_ema,
            }),
            recall: (cfg.recall > 0).then(|| RecallConfig::new(cfg.recall, w.prompt_len + cfg.steps)),
        };
        let kv = KvSide::new(rt, &kv_cfg).await?;
        let reference = match reference_pool {
            Some(rpool) => {
                let opts =
                    AttendOptions { group: w.group, n_seqs: w.n_seqs, chunk_pages: cfg.chunk_pages, mass: false, ..Default::default() };
                let rattn = Attention::new(rt, &rpool, opts).await?;
                Some(Reference { pool: rpool, attn: rattn })
            }
            None => None,
        };
        // Some drivers compile on first dispatch: run the kernels once over the empty pool (no
        // page is touched) so that the first step's time is the step's.
        kv.pool.gather(rt)?;
        kv.attn.run(rt, 0, 0)?;
        rt.wait()?;
        let timer = StepTimer::new(rt, timed_passes(w.layers), Timing::Passes);
        let model = cfg.verify.then(|| {
            let mut m = PoolModel::new(&pool_cfg);
            m.tier = kv.recall.as_ref().map(|t| TierModel::new(&pool_cfg, t.cap));
            m
        });
        // The first prefill batch is the calibration window (it holds at most `calibration`
        // positions).
        let calibration_window = positions.min(w.prompt_len).max(1);
        Ok(Pipeline {
            cfg,
            kv,
            workload,
            reference,
            model,
            timer,
            step: 0,
            routed_tokens: 0,
            last_queries: Vec::new(),
            prefill_chunk: positions,
            calibration_window,
            kv_stage: None,
            checked: Checked::default(),
        })
    }

    /// The route stage's router (the workload's tokens are always routed).
    pub fn router(&self) -> &Router {
        match &self.kv.route {
            Some(r) => &r.router,
            None => unreachable!("Pipeline::new builds the route stage"),
        }
    }

    /// Append the prompt of every sequence, routed on the GPU (with a scheduler: attend and
    /// evict after each batch). `progress(done, total)` after each batch.
    pub async fn prefill(&mut self, rt: &Runtime, progress: &mut dyn FnMut(u64, u64)) -> Result<()> {
        let w = self.cfg.workload.clone();
        let total = u64::from(w.prompt_len) * u64::from(w.n_seqs * w.layers);
        let mut done = 0;
        let mut left = w.prompt_len;
        let attend = self.kv.scheduler.is_some() || self.kv.flexgen.is_some();
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
        let c = &self.kv.pool.cfg;
        let prompt_pages = w.prompt_len.div_ceil(c.page_size) * w.n_seqs * w.layers * c.kv_heads;
        self.kv.pool.check_errors(rt, prompt_pages).await?;
        if let Some(r) = &self.reference {
            r.pool.check_errors(rt, prompt_pages).await?;
        }
        Ok(())
    }

    /// Recount each expert's cached tokens and miss rate (after the prefill).
    fn update_miss(&self, rt: &Runtime) -> Result<()> {
        self.router().update_miss(rt)
    }

    /// Whether a step runs as one submission with no host round trip: nothing on the side needs
    /// the host mid-step (no CPU lockstep, no full-cache reference, no host tier).
    pub fn fused(&self) -> bool {
        self.model.is_none() && self.reference.is_none() && self.kv.flexgen.is_none()
    }

    /// This step's synthetic inputs: every layer's new tokens, then every layer's queries (the
    /// order the generator has always drawn them in, so runs repeat).
    fn next_inputs(&mut self) -> (Vec<GenToken>, Vec<Vec<f32>>) {
        let tokens = self.workload.next_tokens();
        let queries = (0..self.kv.pool.cfg.layers).map(|l| self.workload.queries(l)).collect();
        (tokens, queries)
    }

    /// One decode step: route, append, gather, attend every layer, evict, recount miss rates.
    pub async fn step(&mut self, rt: &Runtime) -> Result<StepReport> {
        #[cfg(not(target_arch = "wasm32"))]
        let t0 = std::time::Instant::now();
        let n_seqs = self.cfg.workload.n_seqs;
        let layers = self.kv.pool.cfg.layers;
        let (tokens, queries) = self.next_inputs();
        let st = Stages { per_layer: n_seqs, timed: true, fused: self.fused(), attend: true, miss: true };
        let attention_error = self.run_stages(rt, &tokens, queries, st).await?;
        rt.wait()?;
        let ctl = self.kv.pool.check_errors(rt, n_seqs * layers).await?;
        let gpu = match &self.timer {
            Some(t) => Some(StageTimes::from_stage_ms(&t.read(rt).await?)),
            None => None,
        };
        #[cfg(not(target_arch = "wasm32"))]
        let host_ms = t0.elapsed().as_secs_f64() * 1e3;
        #[cfg(target_arch = "wasm32")]
        let host_ms = f64::NAN;
        let kv = &self.kv;
        let parts = ReportParts { pool: &kv.pool, router: Some(self.router()), scheduler: kv.scheduler.as_ref(), quest: kv.quest.as_ref() };
        let mut report = StepReport::collect(rt, parts, ctl, (self.step, self.workload.position(0)), gpu, host_ms).await?;
        report.attention_error = attention_error;
        if let Some((fg, _)) = &self.kv.flexgen {
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
        let (Some(r), true) = (&self.reference, self.kv.pool.cfg.codec != Codec::None) else {
            return Ok(None);
        };
        let pool = &self.kv.pool;
        let c = &pool.cfg;
        let rc = &r.pool.cfg;
        let (lists, counts) = pool.read_page_lists(rt).await?;
        let (rlists, rcounts) = r.pool.read_page_lists(rt).await?;
        let codec_kv = pool.read_codec_kv(rt).await?;
        let basis = pool.read_basis(rt).await?;
        let rkv = r.pool.read_kv(rt).await?;
        let meta: Vec<crate::gpu_data::PageMeta> = rt.read_all(&pool.page_meta).await?;
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
