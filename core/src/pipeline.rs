//! The decode pipeline as it stands. Every step, on the GPU: route each sequence's new token at
//! every layer with the configured router (its statistics live on the GPU), append the tokens
//! into their shards with the routed experts (no host round trip), rebuild the page lists, run
//! decode attention per layer, evict down to the budget with the configured scheduler, and
//! recount each expert's miss rate from the pool for the next step's routing. The host reads
//! back only counters and small statistics for the report. With a scheduler, a second pool
//! keeps the full cache and runs the same attention, so the report carries the attention error
//! of the budgeted cache against the full one.

use serde::{Deserialize, Serialize};

use crate::attend::{AttendOptions, Attention};
use crate::config::{Codec, KvDtype, PoolConfig, ShardMap};
use crate::error::{Error, Result};
use crate::evict::{AllocatorSpec, Scheduler};
use crate::flexgen::FlexGen;
use crate::gpu_data::{ListState, PoolCtl, meta};
use crate::pool::KvPool;
use crate::quest::Quest;
use crate::reference::pool::decode_words;
use crate::reference::pool::{NewToken, PoolModel, encode_values};
use crate::route::{RouteShape, Router};
use crate::router_config::RouterConfig;
use crate::runtime::Runtime;
use crate::scheduler_config::{EkvaConfig, SchedulerConfig, Threshold};
use crate::timer::GpuTimer;
use crate::workload::{GenToken, Workload, WorkloadConfig};

/// Everything a demo run is made of; also the TOML config file (`expertkv demo --config FILE`),
/// where every field is optional.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DemoConfig {
    pub workload: WorkloadConfig,
    pub steps: u32,
    pub page_size: u32,
    pub dtype: KvDtype,
    pub n_shards: u32,
    pub shard_map: ShardMap,
    /// Pages in the pool; `None`: enough for prompt + steps with headroom.
    pub pool_pages: Option<u32>,
    pub chunk_pages: u32,
    /// Keep a CPU reference of the pool in lockstep and check placement and attention.
    pub verify: bool,
    pub router: RouterConfig,
    /// Weight of the newest step in the routers' moving-average load.
    pub route_ema: f32,
    /// Eviction policy; `None` keeps the full cache.
    pub scheduler: Option<SchedulerConfig>,
    /// Tokens each (layer, sequence, KV head) keeps: a number, or a share of the final context
    /// such as "25%".
    pub budget: String,
    /// PyramidKV over the scheduler: the first layer's budget over the last's (budgets shrink
    /// linearly with depth, averaging `budget`); `None`: every layer keeps `budget`.
    pub pyramid: Option<f32>,
    /// The EKVA allocator over the scheduler: every list's budget split over expert groups by
    /// importance (routing frequency and attention mass); `None`: expert-blind budgets.
    pub allocator: Option<EkvaConfig>,
    pub threshold: Threshold,
    /// With a scheduler or a codec: keep a full f16 cache beside it to measure the attention
    /// error.
    pub reference_attention: bool,
    /// How full pages are stored (compression); needs no evicting scheduler.
    pub codec: Codec,
    /// Low-rank codecs: prompt positions per sequence in the calibration window (the first
    /// prefill batch) the basis is fitted on.
    pub calibration: u32,
    /// Low-rank codecs: subspace iterations of the fit.
    pub basis_iters: u32,
}

impl Default for DemoConfig {
    fn default() -> Self {
        DemoConfig {
            workload: WorkloadConfig::default(),
            steps: 16,
            page_size: 16,
            dtype: KvDtype::F16,
            n_shards: 4,
            shard_map: ShardMap::Pikv { n_tok: 4, n_exp: 4 },
            pool_pages: None,
            chunk_pages: 8,
            verify: true,
            router: RouterConfig::CacheAware { lambda: 2.0 },
            route_ema: 0.1,
            scheduler: Some(SchedulerConfig::H2o { sinks: 4, window: 32 }),
            budget: "25%".into(),
            pyramid: None,
            allocator: None,
            threshold: Threshold::default(),
            reference_attention: true,
            codec: Codec::None,
            calibration: 256,
            basis_iters: crate::pool::DEFAULT_BASIS_ITERS,
        }
    }
}

impl DemoConfig {
    /// Tokens per page list the scheduler keeps (None without a scheduler).
    pub fn budget_tokens(&self) -> Result<Option<u32>> {
        if self.scheduler.is_none() {
            return Ok(None);
        }
        let full = self.workload.prompt_len + self.steps;
        let b = self.budget.trim();
        let tokens = if let Some(pct) = b.strip_suffix('%') {
            let f: f64 = pct.trim().parse().map_err(|_| Error::config("budget", b, "a number of tokens or a percentage like 25%"))?;
            if !(f > 0.0 && f <= 100.0) {
                return Err(Error::config("budget", b, "a percentage must be in (0, 100]"));
            }
            (f64::from(full) * f / 100.0).ceil() as u32
        } else {
            b.parse::<u32>().map_err(|_| Error::config("budget", b, "a number of tokens or a percentage like 25%"))?
        };
        if tokens < self.page_size {
            return Err(Error::config("budget", b, format!("{tokens} tokens is below one page ({} tokens)", self.page_size)));
        }
        Ok(Some(tokens))
    }

    /// Every layer's base budget for the evict/* schedulers (`KEEP_ALL`: the whole layer);
    /// `None` without one.
    pub fn layer_budgets(&self) -> Result<Option<Vec<u32>>> {
        match (&self.scheduler, self.budget_tokens()?) {
            (Some(s), Some(b)) if s.uses_evict_kernels() => {
                Ok(Some(s.layer_budgets(b, self.workload.layers, self.pyramid, self.page_size)?))
            }
            (Some(s), _) if self.pyramid.is_some() => {
                Err(Error::config("pyramid", s.name(), "PyramidKV shapes the budgets of the evicting schedulers only"))
            }
            _ => Ok(None),
        }
    }

    /// Prompt positions routed and appended per prefill batch when a scheduler evicts between
    /// batches (so that a batch never overruns the budget by much).
    pub fn evicting_chunk(&self, budget: u32) -> u32 {
        (budget / 2).clamp(1, 256)
    }

    /// The pool: the full cache, or, with a scheduler, the budget plus one prefill chunk and a
    /// partly filled page per shard ring.
    pub fn pool_config(&self) -> PoolConfig {
        let evicting = self.scheduler.as_ref().is_some_and(SchedulerConfig::evicts);
        match self.budget_tokens() {
            Ok(Some(b)) if evicting => {
                let w = &self.workload;
                let full = w.prompt_len + self.steps;
                let layer_budgets = self.layer_budgets().ok().flatten().unwrap_or_else(|| vec![b; w.layers as usize]);
                let list_pages: Vec<u32> = layer_budgets
                    .iter()
                    .map(|&lb| (lb.min(full) + self.evicting_chunk(b)).div_ceil(self.page_size) + self.n_shards + 1)
                    .collect();
                let mut c = self.full_pool_config();
                c.n_pages = self.pool_pages.unwrap_or(w.n_seqs * w.kv_heads * list_pages.iter().sum::<u32>());
                // A ring may hold every page of its list (maps need not spread tokens evenly).
                c.ring_capacity = list_pages.iter().max().copied().unwrap_or(1) + 1;
                c
            }
            _ if self.codec != Codec::None => {
                // Raw pages for every ring's newest page and a prefill chunk; compressed pages
                // for the rest of the context.
                let w = &self.workload;
                let lists = w.n_seqs * w.layers * w.kv_heads;
                let mut c = self.full_pool_config();
                let full = c.n_pages;
                c.n_pages = lists * (2 * self.n_shards + 256u32.div_ceil(self.page_size) + 2);
                c.codec = self.codec;
                c.codec_pages = full;
                c
            }
            _ => self.full_pool_config(),
        }
    }

    /// A pool that holds the whole context (prompt and steps) with headroom.
    pub fn full_pool_config(&self) -> PoolConfig {
        let w = &self.workload;
        let tokens = w.prompt_len + self.steps;
        let pages_per_seq_layer = tokens.div_ceil(self.page_size) + self.n_shards;
        let ring = (tokens.div_ceil(self.page_size).div_ceil(self.n_shards) * 3 / 2 + 4).max(4);
        PoolConfig {
            layers: w.layers,
            kv_heads: w.kv_heads,
            head_dim: w.head_dim,
            page_size: self.page_size,
            dtype: self.dtype,
            n_pages: if self.scheduler.is_none() { self.pool_pages } else { None }
                .unwrap_or(w.n_seqs * w.layers * w.kv_heads * pages_per_seq_layer),
            max_seqs: w.n_seqs,
            n_shards: self.n_shards,
            ring_capacity: ring,
            top_k: w.top_k,
            shard_map: self.shard_map,
            max_buffer_bytes: None,
            codec: Codec::None,
            codec_pages: 0,
        }
    }
}

/// GPU time of each stage of one step (milliseconds).
#[derive(Clone, Debug, Default, Serialize)]
pub struct StageTimes {
    pub route_ms: f64,
    pub append_ms: f64,
    /// Compressing the pages that filled (a codec's plan and encode passes; empty without one).
    pub compress_ms: f64,
    pub gather_ms: f64,
    pub attend_ms: f64,
    /// Scheduling: utilities, budgets, victims, compaction, freeing.
    pub evict_ms: f64,
    /// Recounting each expert's tokens in the pool (miss rates for the next step's routing).
    pub miss_ms: f64,
}

impl StageTimes {
    /// From a step's timestamp pairs in the timer's order: route, append, gather, one attend
    /// pass per layer, evict, miss recount, compress.
    fn from_pairs(ms: &[f64], layers: u32) -> StageTimes {
        let l = layers as usize;
        StageTimes {
            route_ms: ms[0],
            append_ms: ms[1],
            compress_ms: ms[5 + l],
            gather_ms: ms[2],
            attend_ms: ms[3..3 + l].iter().sum(),
            evict_ms: ms[3 + l],
            miss_ms: ms[4 + l],
        }
    }

    /// The step's GPU time: every stage.
    pub fn total_ms(&self) -> f64 {
        self.route_ms + self.append_ms + self.compress_ms + self.gather_ms + self.attend_ms + self.evict_ms + self.miss_ms
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct StepReport {
    pub step: u32,
    /// Tokens cached per sequence and layer after the step.
    pub context: u32,
    pub gpu: Option<StageTimes>,
    pub host_ms: f64,
    /// Bytes of the pages in use (what the cache occupies).
    pub kv_bytes_resident: u64,
    /// Bytes of K/V actually stored in them (tokens x bytes per token).
    pub kv_bytes_tokens: u64,
    pub pages_in_use: u32,
    pub pages_total: u32,
    /// Pages held by each shard index, summed over layers and sequences.
    pub shard_pages: Vec<u32>,
    pub ring_overflows: u32,
    /// Routing entropy (nats) of the step, averaged over layers.
    pub routing_entropy: f32,
    /// Miss rate averaged over (layer, expert), weighted by tokens appended.
    pub miss_rate: f32,
    /// Moving-average load of each expert, averaged over layers.
    pub expert_load: Vec<f32>,
    /// Per expert, summed over layers: routed (token, expert) pairs whose K/V is still cached
    /// (hits for the next access) and those no longer cached (misses).
    pub expert_hits: Vec<u64>,
    pub expert_misses: Vec<u64>,
    /// Tokens evicted this step (all lists).
    pub evicted: u64,
    /// Pages returned to the free stack by eviction so far.
    pub pages_evicted: u32,
    /// Share of the attention mass the kept tokens held at this step's eviction (mean over lists).
    pub kept_attention: f32,
    /// Relative L2 error of the attention output against the full cache (mean over layers).
    pub attention_error: Option<f64>,
    /// Bytes the full cache would occupy now (pages of the reference pool).
    pub full_kv_bytes: Option<u64>,
    /// K/V bytes the step's attention read (QUEST reads only its selected pages).
    pub kv_bytes_attended: u64,
    /// FlexGen: K/V bytes held in host memory, and moved between the tiers so far.
    pub host_kv_bytes: u64,
    pub tier_bytes_moved: u64,
    /// EKVA: per expert, the tokens its groups may keep at this step's eviction (summed over
    /// lists; empty without the allocator or where lists keep everything).
    pub expert_budget: Vec<u64>,
    /// EKVA: per expert, the allocator's importance (mean over layers; empty without it).
    pub expert_importance: Vec<f32>,
}

impl StepReport {
    /// Column names of [`StepReport::csv_row`].
    pub const CSV_HEADER: &'static str = "step,context,route_ms,append_ms,compress_ms,gather_ms,attend_ms,evict_ms,miss_ms,host_ms,\
kv_bytes_resident,kv_bytes_tokens,kv_bytes_attended,full_kv_bytes,pages_in_use,pages_total,ring_overflows,evicted,pages_evicted,\
kept_attention,attention_error,routing_entropy,miss_rate,host_kv_bytes,tier_bytes_moved,shard_pages,expert_load,expert_hits,expert_misses,expert_budget,expert_importance";

    /// One CSV line (no newline): scalars as numbers, empty when absent; per-shard and
    /// per-expert vectors as `;`-separated values in one field.
    pub fn csv_row(&self) -> String {
        fn join<T: std::fmt::Display>(v: &[T]) -> String {
            v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(";")
        }
        let opt = |v: Option<String>| v.unwrap_or_default();
        let g = self.gpu.as_ref();
        let times: Vec<String> = [
            g.map(|g| g.route_ms),
            g.map(|g| g.append_ms),
            g.map(|g| g.compress_ms),
            g.map(|g| g.gather_ms),
            g.map(|g| g.attend_ms),
            g.map(|g| g.evict_ms),
            g.map(|g| g.miss_ms),
        ]
        .iter()
        .map(|t| opt(t.map(|x| format!("{x:.6}"))))
        .collect();
        format!(
            "{},{},{},{:.3},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            self.step,
            self.context,
            times.join(","),
            self.host_ms,
            self.kv_bytes_resident,
            self.kv_bytes_tokens,
            self.kv_bytes_attended,
            opt(self.full_kv_bytes.map(|b| b.to_string())),
            self.pages_in_use,
            self.pages_total,
            self.ring_overflows,
            self.evicted,
            self.pages_evicted,
            self.kept_attention,
            opt(self.attention_error.map(|e| format!("{e:e}"))),
            self.routing_entropy,
            self.miss_rate,
            self.host_kv_bytes,
            self.tier_bytes_moved,
            join(&self.shard_pages),
            join(&self.expert_load),
            join(&self.expert_hits),
            join(&self.expert_misses),
            join(&self.expert_budget),
            join(&self.expert_importance),
        )
    }
}

/// What the CPU reference check found ([`Pipeline::verify`] returns an error instead where the
/// pool differs, and the lockstep where any attention, selection or eviction does).
#[derive(Clone, Debug, Serialize)]
pub struct VerifyReport {
    pub tokens_checked: u64,
    /// Attention passes (layer and batch or step) checked against the f64 reference.
    pub attention_checked: u64,
    pub attention_max_abs_err: f64,
    /// The worst error's share of its element's tolerance
    /// ([`crate::attend::Attention::output_tolerance`]); at most 1, or the check fails.
    pub attention_worst_share: f64,
}

/// What the CPU lockstep has checked so far.
#[derive(Clone, Copy, Debug, Default)]
struct Checked {
    attention: u64,
    max_abs_err: f64,
    worst_share: f64,
}

fn verify_err(message: String) -> Error {
    Error::Gpu { during: "verification against the CPU reference".into(), message }
}

/// The lockstep's eviction: every slot's utility key and every list's budget against the
/// reference (exactly; LRU+'s float utility within 1e-5, AdaKV's shares within a token), then
/// the reference evicts with the GPU's keys and budgets (and EKVA groups) and the utility
/// threshold as the kernel applies it, and every list's counts must agree (tokens, victims
/// exactly; kept attention and the adaptive threshold within 1e-4). The pool it leaves is
/// compared in [`Pipeline::verify`].
async fn check_eviction(
    rt: &Runtime,
    s: &Scheduler,
    m: &mut PoolModel,
    step: u32,
    lens: &[u32],
    before: &[ListState],
    after: &[ListState],
) -> Result<()> {
    use crate::gpu_data::{from_orderable, policies};
    let p = s.params(step);
    let keys = s.read_utility(rt).await?;
    for (slot, want) in m.evict_scores(&p, lens).iter().enumerate() {
        let (Some(w), g) = (*want, keys[slot]) else { continue };
        let same = if p.policy == policies::LRU_PLUS && w != u32::MAX && g != u32::MAX {
            let (gf, wf) = (from_orderable(g), from_orderable(w));
            (gf - wf).abs() <= 1e-5 * (1.0 + wf.abs())
        } else {
            g == w
        };
        if !same {
            return Err(verify_err(format!("step {step}: utility key of slot {slot} is {g:#010x}, the reference {w:#010x}")));
        }
    }
    for (li, (g, w)) in after.iter().zip(m.evict_budgets(&p, lens, before, &s.layer_budgets)).enumerate() {
        let off = if p.policy == policies::ADAKV { g.budget.abs_diff(w.budget) > 1 } else { g.budget != w.budget || g.kind != w.kind };
        if off {
            return Err(verify_err(format!(
                "step {step}: list {li}'s budget is {} ({}), the reference {} ({})",
                g.budget, g.kind, w.budget, w.kind
            )));
        }
    }
    // The reference starts from the lists as they were, with the budgets the GPU set.
    let mut lists: Vec<ListState> =
        after.iter().zip(before).map(|(a, b)| ListState { tau: b.tau, evicted_total: b.evicted_total, ..*a }).collect();
    match &s.ekva {
        Some(e) => {
            let mut groups = s.read_groups(rt).await?;
            m.evict_grouped(&keys, &mut lists, Some((&mut groups, e.n_experts)));
        }
        None => {
            m.evict_thresholded(&keys, &mut lists, &p, s.select_wg);
        }
    }
    for (li, (g, w)) in after.iter().zip(&lists).enumerate() {
        let floats = (g.hit_rate - w.hit_rate).abs() < 1e-4 && (g.tau - w.tau).abs() < 1e-4;
        if (g.tokens, g.evicted, g.evicted_total) != (w.tokens, w.evicted, w.evicted_total) || !floats {
            return Err(verify_err(format!("step {step}: list {li} after eviction is {g:?}, the reference {w:?}")));
        }
    }
    Ok(())
}

/// The full-cache pool and its attention, kept beside a budgeted pool to measure its error.
struct Reference {
    pool: KvPool,
    attn: Attention,
}

pub struct Pipeline {
    pub cfg: DemoConfig,
    pub pool: KvPool,
    pub attn: Attention,
    pub router: Router,
    pub scheduler: Option<Scheduler>,
    pub quest: Option<Quest>,
    /// FlexGen placement, with the QUEST page bounds it scores host pages by.
    pub flexgen: Option<(FlexGen, Quest)>,
    pub workload: Workload,
    reference: Option<Reference>,
    model: Option<PoolModel>,
    timer: Option<GpuTimer>,
    /// Set by [`Pipeline::probe_steps`] for its last step: the eviction stage's kernels timed
    /// one by one, with the stages' names.
    evict_timer: Option<(GpuTimer, Vec<&'static str>)>,
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

/// Timestamp pairs of a step: route, append, gather, attend per layer, evict, miss, compress.
fn timer_pairs(layers: u32) -> u32 {
    6 + layers
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    if den > 0.0 { (num / den).sqrt() } else { num.sqrt() }
}

impl Pipeline {
    pub async fn new(rt: &Runtime, cfg: DemoConfig) -> Result<Pipeline> {
        let budget = cfg.budget_tokens()?;
        if cfg.codec != Codec::None && cfg.scheduler.is_some() {
            return Err(Error::config(
                "codec",
                cfg.codec.name(),
                "codecs run with the full cache for now (scheduler none): evicting a token from a compressed page would need it re-encoded",
            ));
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
        let timer = GpuTimer::new(rt, timer_pairs(w.layers));
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
            evict_timer: None,
            step: 0,
            routed_tokens: 0,
            last_queries: Vec::new(),
            prefill_chunk: positions,
            checked: Checked::default(),
        })
    }

    fn ts(&self, timed: bool, i: u32) -> Option<wgpu::ComputePassTimestampWrites<'_>> {
        if timed { self.timer.as_ref().and_then(|t| t.pass(i)) } else { None }
    }

    /// Route `tokens` (ordered [layer][token of the layer], `per_layer` per layer) on the GPU and
    /// append them with the routed experts (to the reference pool too). With verification on,
    /// the routed experts are read back (outside the data path) so the CPU reference appends the
    /// same tokens.
    async fn route_and_append(&mut self, rt: &Runtime, tokens: &[GenToken], per_layer: u32, timed: bool) -> Result<()> {
        let layers = self.pool.cfg.layers;
        let e = self.cfg.workload.n_experts as usize;
        for layer in 0..layers {
            let rows = &tokens[(layer * per_layer) as usize..((layer + 1) * per_layer) as usize];
            let logits: Vec<f32> = rows.iter().flat_map(|t| t.logits.iter().copied()).collect();
            debug_assert_eq!(logits.len(), rows.len() * e);
            self.router.set_logits(rt, layer, &logits)?;
            self.router.prepare(rt, layer, per_layer, self.routed_tokens + layer * per_layer)?;
        }
        let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("route") });
        {
            let mut pass =
                enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("route"), timestamp_writes: self.ts(timed, 0) });
            for layer in 0..layers {
                self.router.encode(&mut pass, layer, per_layer);
            }
        }
        rt.queue.submit([enc.finish()]);
        self.routed_tokens = self.routed_tokens.wrapping_add(layers * per_layer);

        let words = kv_words(tokens, self.pool.cfg.dtype);
        let mut new: Vec<NewToken> = tokens.iter().map(|t| t.token.clone()).collect();
        let routed = crate::pool::Routed {
            experts: &self.router.experts,
            gates: &self.router.gates,
            per_layer,
            row_stride: self.router.shape.max_tokens,
        };
        let ts = if timed { self.timer.as_ref().and_then(|t| t.pass(1)) } else { None };
        self.pool.append_timed(rt, &new, &words, self.step, Some(routed), ts)?;
        // A low-rank codec fits its basis on the first batch (the calibration window).
        if self.pool.cfg.codec.is_low_rank() && !self.pool.calibrated {
            self.pool.calibrate(rt, self.cfg.basis_iters)?;
            if let Some(m) = &mut self.model {
                m.codec_basis = self.pool.read_basis(rt).await?;
            }
        }
        // Pages that left their ring's head are compressed right away (no-op without a codec).
        self.pool.compress_timed(rt, if timed { self.timer.as_ref().and_then(|t| t.pass(5 + layers)) } else { None })?;
        if let Some(r) = &mut self.reference {
            r.pool.append_timed(rt, &new, &words, self.step, Some(routed), None)?;
        }
        if self.model.is_some() {
            let k = self.cfg.workload.top_k as usize;
            for layer in 0..layers {
                let ex = self.router.read_experts(rt, layer, per_layer).await?;
                let ga = self.router.read_gates(rt, layer, per_layer).await?;
                for i in 0..per_layer as usize {
                    let t = &mut new[layer as usize * per_layer as usize + i];
                    t.experts = ex[i * k..(i + 1) * k].to_vec();
                    t.gates = ga[i * k..(i + 1) * k].to_vec();
                }
            }
            if let Some(m) = &mut self.model {
                m.append(&new, &words, self.step)?;
                m.compress();
            }
        }
        Ok(())
    }

    /// Gather and attend every layer with this step's queries (the reference pool too); returns
    /// the attention error against the full cache when there is one.
    async fn attend_all(&mut self, rt: &Runtime, timed: bool) -> Result<Option<f64>> {
        let layers = self.pool.cfg.layers;
        let queries: Vec<Vec<f32>> = (0..layers).map(|l| self.workload.queries(l)).collect();
        if self.flexgen.is_some() {
            // Fetch the host pages these queries select before attention reads the pool.
            let bounds = self.refresh_bounds(rt).await?;
            let group = self.cfg.workload.group;
            if let Some((fg, _)) = &mut self.flexgen {
                for (layer, q) in queries.iter().enumerate() {
                    fg.fetch(rt, &self.pool, layer as u32, q, group, &bounds).await?;
                }
            }
        }
        let mut errors = Vec::new();
        for (layer, q) in (0..layers).zip(queries) {
            self.attn.set_queries(rt, &q)?;
            self.attn.prepare(rt, layer, self.step);
            let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("decode step") });
            if layer == 0 {
                self.pool.encode_gather(rt, &mut enc, 0, layers, self.ts(timed, 2));
            }
            if let Some(q) = &self.quest {
                q.prepare(rt, layer, &self.attn);
            }
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("attend"),
                    timestamp_writes: self.ts(timed, 3 + layer),
                });
                if let Some(q) = &self.quest {
                    if layer == 0 {
                        q.encode_summarize(&mut pass);
                    }
                    q.encode_select(&mut pass, layer)?;
                }
                self.attn.encode(&mut pass);
            }
            rt.queue.submit([enc.finish()]);
            if let Some(r) = &self.reference {
                r.attn.set_queries(rt, &q)?;
                r.attn.prepare(rt, layer, self.step);
                let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("reference attend") });
                if layer == 0 {
                    r.pool.encode_gather(rt, &mut enc, 0, layers, None);
                }
                {
                    let mut pass =
                        enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("reference attend"), timestamp_writes: None });
                    r.attn.encode(&mut pass);
                }
                rt.queue.submit([enc.finish()]);
                let got = self.attn.read_output(rt).await?;
                let want = r.attn.read_output(rt).await?;
                errors.push(rel_l2(&got, &want));
            }
            if self.model.is_some() {
                self.check_layer(rt, layer, &q).await?;
            }
            if layer + 1 == layers {
                self.last_queries = q;
            }
        }
        Ok((!errors.is_empty()).then(|| errors.iter().sum::<f64>() / errors.len() as f64))
    }

    /// QUEST's part of the lockstep: every page's key bounds exactly (at layer 0, after they are
    /// summarised), every page's upper bound on
    /// q.k within [`crate::reference::quest::QUEST_BOUND_RTOL`] of the f64 reference, and the
    /// selection exactly the reference's given the GPU's keys.
    #[allow(clippy::too_many_arguments)]
    async fn check_quest(
        &self,
        rt: &Runtime,
        qs: &Quest,
        model: &PoolModel,
        layer: u32,
        q: &[f32],
        sel: &[u32],
        counts: &[u32],
    ) -> Result<()> {
        use crate::reference::quest::{QUEST_BOUND_RTOL, key_bound, page_bounds, select_pages, upper_bound};
        let c = &self.pool.cfg;
        let (d, step) = (c.head_dim as usize, self.step);
        // The bounds are summarised before layer 0's selection: compared there, used everywhere.
        let bounds: Vec<f32> = if layer == 0 { rt.read_all(&qs.bounds).await? } else { Vec::new() };
        let keys: Vec<u32> = rt.read_all(qs.page_keys()).await?;
        let mut refs = vec![None; c.n_pages as usize];
        for (page, r) in refs.iter_mut().enumerate() {
            if model.page_meta[page].owner == u32::MAX {
                continue;
            }
            *r = page_bounds(model, page as u32);
            if let Some(want) = r
                && layer == 0
                && let Some(i) = (0..2 * d).find(|&i| f64::from(bounds[page * 2 * d + i]) != want[i])
            {
                return Err(verify_err(format!(
                    "step {step}: QUEST bound {i} of page {page} is {}, the reference {}",
                    bounds[page * 2 * d + i],
                    want[i]
                )));
            }
        }
        let (group, maxp) = (self.attn.opts.group as usize, c.max_pages_per_seq() as usize);
        for seq in 0..self.attn.opts.n_seqs {
            for head in 0..c.kv_heads {
                let li = model.list_index(layer, seq, head) as usize;
                let list = model.page_list(layer, seq, head);
                let heads: Vec<&[f32]> = (0..group)
                    .map(|g| &q[((seq as usize * self.attn.q_heads() as usize) + head as usize * group + g) * d..][..d])
                    .collect();
                for (j, &page) in list.iter().enumerate() {
                    let Some(b) = &refs[page as usize] else { continue };
                    let (want, got) = (upper_bound(b, &heads), key_bound(keys[li * maxp + j]));
                    let d = (got - want).abs();
                    if d.is_nan() || d > QUEST_BOUND_RTOL * (1.0 + want.abs()) {
                        return Err(verify_err(format!(
                            "step {step}, layer {layer}: QUEST bound of list {li} page {page} is {got}, the reference {want}"
                        )));
                    }
                }
                let want = select_pages(&list, &keys[li * maxp..li * maxp + list.len()], qs.keep_pages as usize);
                if sel[li * maxp..li * maxp + counts[li] as usize] != want[..] {
                    return Err(verify_err(format!(
                        "step {step}, layer {layer}: QUEST selected {:?} of list {li}, the reference {want:?}",
                        &sel[li * maxp..li * maxp + counts[li] as usize]
                    )));
                }
            }
        }
        Ok(())
    }

    /// The CPU lockstep's check of one layer's attention, right after it ran: every output
    /// within its tolerance of the f64 reference over the same pages (QUEST: the GPU's
    /// selection), and the slot metadata equal to the reference's everywhere, with the masses
    /// and accesses this attention recorded (masses within the attention tolerance). The model
    /// then carries the GPU's masses (rounded as the GPU summed them), so that the utilities
    /// eviction derives from them can be compared exactly ([`check_eviction`]).
    async fn check_layer(&mut self, rt: &Runtime, layer: u32, q: &[f32]) -> Result<()> {
        use crate::reference::attend::{ATTENTION_ATOL, ATTENTION_RTOL};
        let Some(model) = &self.model else { return Ok(()) };
        let out = self.attn.read_output(rt).await?;
        let selection = match &self.quest {
            Some(qs) => Some((rt.read_all::<u32>(&qs.sel_list).await?, rt.read_all::<u32>(&qs.sel_counts).await?)),
            None => None,
        };
        let maxp = self.pool.cfg.max_pages_per_seq() as usize;
        let pick = |seq: u32, head: u32| -> Vec<u32> {
            let li = model.list_index(layer, seq, head) as usize;
            selection.as_ref().map_or_else(Vec::new, |(sel, counts)| sel[li * maxp..li * maxp + counts[li] as usize].to_vec())
        };
        let pages: Option<&dyn Fn(u32, u32) -> Vec<u32>> = if selection.is_some() { Some(&pick) } else { None };
        if let (Some(qs), Some((sel, counts))) = (&self.quest, &selection) {
            self.check_quest(rt, qs, model, layer, q, sel, counts).await?;
        }
        let reference = self.attn.cpu_reference(model, layer, q, pages);
        let tol = self.attn.output_tolerance(model, layer, q, pages, &reference.out);
        let step = self.step;
        for (i, ((g, w), t)) in out.iter().zip(&reference.out).zip(&tol).enumerate() {
            let err = (f64::from(*g) - w).abs();
            if err.is_nan() || err > *t {
                return Err(verify_err(format!(
                    "step {step}, layer {layer}: attention output {i} is {g}, the f64 reference {w} (tolerance {t:.1e})"
                )));
            }
            self.checked.max_abs_err = self.checked.max_abs_err.max(err);
            self.checked.worst_share = self.checked.worst_share.max(err / t);
        }
        self.checked.attention += 1;
        let gpu: Vec<u32> = rt.read_all(&self.pool.slot_meta).await?;
        let cfg = &self.pool.cfg;
        let (mw, attn_word) = (cfg.meta_words() as usize, meta::attn(cfg.top_k as usize));
        let mut want = model.slot_meta.clone();
        if want.len() != gpu.len() {
            return Err(verify_err(format!("slot metadata of {} words, the reference {}", gpu.len(), want.len())));
        }
        if self.attn.opts.mass {
            for &(seq, head, page, slot, w) in &reference.mass {
                let m = (page * cfg.page_size + slot) as usize * mw;
                let (prev, got) = (f64::from(f32::from_bits(want[m + attn_word])), f64::from(f32::from_bits(gpu[m + attn_word])));
                let d = (got - (prev + w)).abs();
                if d.is_nan() || d > ATTENTION_ATOL + ATTENTION_RTOL * (prev + w).abs() {
                    return Err(verify_err(format!(
                        "step {step}, layer {layer}: attention mass of sequence {seq}, head {head}, page {page}, slot {slot} is {got}, the reference {}",
                        prev + w
                    )));
                }
                want[m + attn_word] = gpu[m + attn_word];
                want[m + meta::LAST_ACCESS] = step;
                want[m + meta::ACCESS_COUNT] = want[m + meta::ACCESS_COUNT].wrapping_add(1);
            }
        }
        if let Some(i) = (0..want.len()).find(|&i| want[i] != gpu[i]) {
            return Err(verify_err(format!(
                "step {step}, layer {layer}: slot metadata word {} of slot {} is {:#010x}, the reference {:#010x}",
                i % mw,
                i / mw,
                gpu[i],
                want[i]
            )));
        }
        if let Some(m) = &mut self.model {
            m.slot_meta = gpu;
        }
        Ok(())
    }

    /// Summarise changed pages (QUEST bounds) and read every page's bounds back.
    async fn refresh_bounds(&self, rt: &Runtime) -> Result<Vec<f32>> {
        let Some((_, q)) = &self.flexgen else {
            return Ok(Vec::new());
        };
        let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("quest/summarize") });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("quest/summarize"), timestamp_writes: None });
            q.encode_summarize(&mut pass);
        }
        rt.queue.submit([enc.finish()]);
        rt.read_all(&q.bounds).await
    }

    /// Evict down to the budget (after attention recorded this step's masses). The CPU reference,
    /// when kept, takes the GPU's metadata, utilities and budgets and must reach the same pool.
    /// FlexGen instead moves its coldest pages to host memory.
    async fn evict(&mut self, rt: &Runtime, timed: bool) -> Result<Option<Vec<ListState>>> {
        if self.flexgen.is_some() {
            if self.model.is_some() {
                return Err(Error::config("verify", true, "FlexGen moves pages through the host; run it with --no-verify"));
            }
            let bounds = self.refresh_bounds(rt).await?;
            if let Some((fg, _)) = &mut self.flexgen {
                fg.offload(rt, &self.pool, &bounds).await?;
            }
            return Ok(None);
        }
        let Some(s) = &self.scheduler else {
            return Ok(None);
        };
        let lens: Vec<u32> = (0..self.cfg.workload.n_seqs).map(|q| self.workload.position(q)).collect();
        s.prepare(rt, self.step, &lens)?;
        let before = match &self.model {
            Some(m) => {
                // The lockstep carries the metadata attention left (checked in `check_layer`);
                // nothing between attention and eviction may have changed it.
                rt.wait()?;
                if rt.read_all::<u32>(&self.pool.slot_meta).await? != m.slot_meta {
                    return Err(verify_err(format!("step {}: slot metadata changed between attention and eviction", self.step)));
                }
                Some(s.read_lists(rt).await?)
            }
            None => None,
        };
        let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("evict") });
        {
            let ts = if timed { self.timer.as_ref().and_then(|t| t.pass(3 + self.pool.cfg.layers)) } else { None };
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("evict"), timestamp_writes: ts });
            s.encode(&mut pass);
        }
        rt.queue.submit([enc.finish()]);
        let lists = s.read_lists(rt).await?;
        if let (Some(m), Some(before)) = (&mut self.model, before) {
            check_eviction(rt, s, m, self.step, &lens, &before, &lists).await?;
        }
        Ok(Some(lists))
    }

    /// Append the prompt of every sequence, routed on the GPU (with a scheduler: attend and
    /// evict after each batch). `progress(done, total)` after each batch.
    pub async fn prefill(&mut self, rt: &Runtime, progress: &mut dyn FnMut(u64, u64)) -> Result<()> {
        let w = self.cfg.workload.clone();
        let total = u64::from(w.prompt_len) * u64::from(w.n_seqs * w.layers);
        let mut done = 0;
        let mut left = w.prompt_len;
        while left > 0 {
            let positions = self.prefill_chunk.min(left);
            let tokens = self.workload.next_positions(positions);
            self.route_and_append(rt, &tokens, positions * w.n_seqs, false).await?;
            if self.scheduler.is_some() || self.flexgen.is_some() {
                self.attend_all(rt, false).await?;
                self.evict(rt, false).await?;
            }
            left -= positions;
            done += tokens.len() as u64;
            progress(done, total);
        }
        self.update_miss(rt, false)?;
        rt.wait()?;
        self.pool.check_errors(rt, 0).await?;
        if let Some(r) = &self.reference {
            r.pool.check_errors(rt, 0).await?;
        }
        Ok(())
    }

    /// Recount each expert's cached tokens and miss rate; `timed` also resolves the step's timer.
    fn update_miss(&self, rt: &Runtime, timed: bool) -> Result<()> {
        let layers = self.pool.cfg.layers;
        let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("route/miss") });
        let timer = if timed { self.timer.as_ref() } else { None };
        {
            let ts = timer.and_then(|t| t.pass(4 + layers));
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("route/miss"), timestamp_writes: ts });
            self.router.encode_miss(&mut pass)?;
        }
        if let Some(t) = timer {
            // Every pair is written each step (an empty evict pass when there is no scheduler).
            t.resolve(&mut enc, timer_pairs(layers));
        }
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

    /// The whole decode step in one command buffer: route, append, compress, gather, attend
    /// every layer (each layer's queries and parameters copied into place in the stream), evict,
    /// recount miss rates, resolve the timestamps; one submission.
    fn encode_fused_step(&mut self, rt: &Runtime, tokens: &[GenToken], queries: Vec<Vec<f32>>) -> Result<()> {
        let layers = self.pool.cfg.layers;
        let w = self.cfg.workload.clone();
        let per_layer = w.n_seqs;
        let e = w.n_experts as usize;
        for layer in 0..layers {
            let rows = &tokens[(layer * per_layer) as usize..((layer + 1) * per_layer) as usize];
            let logits: Vec<f32> = rows.iter().flat_map(|t| t.logits.iter().copied()).collect();
            debug_assert_eq!(logits.len(), rows.len() * e);
            self.router.set_logits(rt, layer, &logits)?;
            self.router.prepare(rt, layer, per_layer, self.routed_tokens + layer * per_layer)?;
        }
        self.attn.stage_layers(rt, self.step, &queries)?;
        if let Some(s) = &self.scheduler {
            let lens: Vec<u32> = (0..w.n_seqs).map(|q| self.workload.position(q)).collect();
            s.prepare(rt, self.step, &lens)?;
        }
        let timer = self.timer.as_ref();
        let ts = |i: u32| timer.and_then(|t| t.pass(i));
        let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("decode step") });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("route"), timestamp_writes: ts(0) });
            for layer in 0..layers {
                self.router.encode(&mut pass, layer, per_layer);
            }
        }
        self.routed_tokens = self.routed_tokens.wrapping_add(layers * per_layer);
        let words = kv_words(tokens, self.pool.cfg.dtype);
        let new: Vec<NewToken> = tokens.iter().map(|t| t.token.clone()).collect();
        let routed = crate::pool::Routed {
            experts: &self.router.experts,
            gates: &self.router.gates,
            per_layer,
            row_stride: self.router.shape.max_tokens,
        };
        self.pool.encode_append(rt, &mut enc, &new, &words, self.step, Some(routed), ts(1))?;
        {
            let mut pass =
                enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("compress"), timestamp_writes: ts(5 + layers) });
            self.pool.encode_compress(&mut pass);
        }
        self.pool.encode_gather(rt, &mut enc, 0, layers, ts(2));
        for layer in 0..layers {
            self.attn.encode_layer_inputs(&mut enc, layer)?;
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("attend"), timestamp_writes: ts(3 + layer) });
            self.attn.encode(&mut pass);
        }
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("evict"), timestamp_writes: ts(3 + layers) });
            if let (Some(s), None) = (&self.scheduler, &self.evict_timer) {
                s.encode(&mut pass);
            }
        }
        if let (Some(s), Some((t, names))) = (&self.scheduler, &mut self.evict_timer) {
            *names = s.encode_timed(&mut enc, t);
            t.resolve(&mut enc, names.len() as u32);
        }
        {
            let mut pass =
                enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("route/miss"), timestamp_writes: ts(4 + layers) });
            self.router.encode_miss(&mut pass)?;
        }
        if let Some(t) = timer {
            t.resolve(&mut enc, timer_pairs(layers));
        }
        rt.queue.submit([enc.finish()]);
        self.last_queries = queries.into_iter().last().unwrap_or_default();
        rt.check("decode step")
    }

    /// One decode step: route, append, gather, attend every layer, evict, recount miss rates.
    pub async fn step(&mut self, rt: &Runtime) -> Result<StepReport> {
        #[cfg(not(target_arch = "wasm32"))]
        let t0 = std::time::Instant::now();
        let n_seqs = self.cfg.workload.n_seqs;
        let layers = self.pool.cfg.layers;
        let fused = self.fused();
        let attention_error = if fused {
            let (tokens, queries) = self.next_inputs();
            self.encode_fused_step(rt, &tokens, queries)?;
            None
        } else {
            let tokens = self.workload.next_tokens();
            self.route_and_append(rt, &tokens, n_seqs, true).await?;
            self.attend_all(rt, true).await?
        };
        let evicted = if fused {
            match &self.scheduler {
                Some(s) => Some(s.read_lists(rt).await?),
                None => None,
            }
        } else {
            self.evict(rt, true).await?
        };
        let lists = match evicted {
            Some(l) => Some(l),
            None if fused => None,
            None => {
                // Keep the timer's evict pair written.
                let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("no evict") });
                drop(enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("no evict"),
                    timestamp_writes: self.ts(true, 3 + layers),
                }));
                rt.queue.submit([enc.finish()]);
                None
            }
        };
        if !fused {
            self.update_miss(rt, true)?;
        }
        rt.wait()?;
        let ctl = self.pool.check_errors(rt, n_seqs * layers).await?;
        let gpu = match &self.timer {
            Some(t) => Some(StageTimes::from_pairs(&t.read_ms(rt, timer_pairs(layers)).await?, layers)),
            None => None,
        };
        #[cfg(not(target_arch = "wasm32"))]
        let host_ms = t0.elapsed().as_secs_f64() * 1e3;
        #[cfg(target_arch = "wasm32")]
        let host_ms = f64::NAN;
        let mut report = self.report(rt, ctl, gpu, host_ms).await?;
        report.attention_error = attention_error;
        if let Some(lists) = lists {
            report.evicted = lists.iter().map(|l| u64::from(l.evicted)).sum();
            report.kept_attention = lists.iter().map(|l| l.hit_rate).sum::<f32>() / lists.len().max(1) as f32;
        }
        if let Some((s, ekva)) = self.scheduler.as_ref().and_then(|s| s.ekva.as_ref().map(|e| (s, e))) {
            let e = ekva.n_experts as usize;
            let groups = s.read_groups(rt).await?;
            let mut budget = vec![0u64; e];
            for (i, g) in groups.iter().enumerate() {
                if g.budget != crate::gpu_data::KEEP_ALL {
                    budget[i % e] += u64::from(g.budget);
                }
            }
            report.expert_budget = budget;
            let imp = s.read_importance(rt).await?;
            let mut mean = vec![0f32; e];
            for (i, x) in imp.iter().enumerate() {
                mean[i % e] += x / layers as f32;
            }
            report.expert_importance = mean;
        }
        if let Some((fg, _)) = &self.flexgen {
            report.host_kv_bytes = fg.stats.host_bytes;
            report.tier_bytes_moved = fg.stats.bytes_to_host + fg.stats.bytes_to_gpu;
        }
        if let Some(q) = &self.quest {
            let sel: Vec<u32> = rt.read_all(&q.sel_counts).await?;
            report.kv_bytes_attended = sel.iter().map(|c| u64::from(*c)).sum::<u64>() * self.pool.cfg.page_bytes();
        }
        if let Some(r) = &self.reference {
            let c = r.pool.read_ctl(rt).await?;
            report.full_kv_bytes = Some(u64::from(r.pool.cfg.n_pages - c.free_top) * r.pool.cfg.page_bytes());
        }
        self.step += 1;
        Ok(report)
    }
    async fn report(&self, rt: &Runtime, ctl: PoolCtl, gpu: Option<StageTimes>, host_ms: f64) -> Result<StepReport> {
        let cfg = &self.pool.cfg;
        let rings: Vec<crate::gpu_data::RingState> = rt.read_all(&self.pool.rings).await?;
        let mut shard_pages = vec![0u32; cfg.n_shards as usize];
        for (key, r) in rings.iter().enumerate() {
            shard_pages[key % cfg.n_shards as usize] += r.count;
        }
        let raw_pages = cfg.n_pages - ctl.free_top;
        let codec_pages = (cfg.n_ids() - cfg.n_pages) - ctl.codec_free_top;
        let pages_in_use = raw_pages + codec_pages;
        let resident = u64::from(raw_pages) * cfg.page_bytes() + u64::from(codec_pages) * cfg.codec_page_bytes();
        let context = self.workload.position(0);
        // K/V vectors (token x KV head) held in the GPU pool.
        let vectors: u64 = rings.iter().filter(|r| r.count > 0).map(|r| u64::from((r.count - 1) * cfg.page_size + r.fill)).sum();
        let stats = self.router.read_stats(rt).await?;
        let summary = self.router.read_summary(rt).await?;
        let e = self.cfg.workload.n_experts as usize;
        let mut expert_load = vec![0f32; e];
        for (i, s) in stats.iter().enumerate() {
            expert_load[i % e] += s.load / cfg.layers as f32;
        }
        let mut expert_hits = vec![0u64; e];
        let mut expert_misses = vec![0u64; e];
        for (i, s) in stats.iter().enumerate() {
            expert_hits[i % e] += u64::from(s.resident.min(s.appended));
            expert_misses[i % e] += u64::from(s.appended.saturating_sub(s.resident));
        }
        let appended: u64 = stats.iter().map(|s| u64::from(s.appended)).sum();
        let missing: f64 = stats.iter().map(|s| f64::from(s.miss) * f64::from(s.appended)).sum();
        Ok(StepReport {
            routing_entropy: summary.iter().map(|s| s.entropy).sum::<f32>() / summary.len().max(1) as f32,
            miss_rate: if appended > 0 { (missing / appended as f64) as f32 } else { 0.0 },
            expert_load,
            expert_hits,
            expert_misses,
            step: self.step,
            context,
            gpu,
            host_ms,
            kv_bytes_resident: resident,
            kv_bytes_tokens: vectors * cfg.token_kv_bytes() / u64::from(cfg.kv_heads),
            pages_in_use,
            pages_total: cfg.n_ids(),
            shard_pages,
            ring_overflows: ctl.ring_overflows,
            evicted: 0,
            pages_evicted: ctl.pages_evicted,
            kept_attention: 1.0,
            attention_error: None,
            full_kv_bytes: None,
            kv_bytes_attended: resident,
            host_kv_bytes: 0,
            tier_bytes_moved: 0,
            expert_budget: Vec::new(),
            expert_importance: Vec::new(),
        })
    }

    /// Decode `n` steps back to back as a serving loop would: each step one submission, no step
    /// report read between them (the GPU never waits for the host's bookkeeping). The inputs are
    /// drawn first (their cost reported apart), the first half of the steps warms the GPU's
    /// clock, the second half is timed: wall time and host time (uploads, encoding, submission)
    /// per step, and the last step's per-stage GPU times (the only step that writes timestamps).
    /// The fused step only (no CPU lockstep, no reference pool); the pool must have room for the
    /// `n` tokens.
    #[cfg(not(target_arch = "wasm32"))]
    pub async fn probe_steps(&mut self, rt: &Runtime, n: u32) -> Result<serde_json::Value> {
        if !self.fused() {
            return Err(Error::Input("probe_steps runs the fused step: no CPU lockstep, no reference pool, no host tier".into()));
        }
        let layers = self.pool.cfg.layers;
        // The synthetic generator draws its keys, values and queries on the CPU (about 50,000
        // normal samples per step at batch 8); a model's forward pass makes them on the GPU.
        // Draw every step's inputs first and time it apart, so the loop below measures the
        // pipeline: uploads, encoding, submission and the GPU.
        let g0 = std::time::Instant::now();
        let inputs: Vec<_> = (0..n).map(|_| self.next_inputs()).collect();
        let generate_ms = g0.elapsed().as_secs_f64() * 1e3 / f64::from(n.max(1));
        // The first half warms the GPU up to its serving clock (an idle H200 sits at 345 MHz and
        // takes tens of milliseconds of steady work to reach 1980), the second half is timed.
        let warmup = n / 2;
        let timed = n - warmup;
        // A serving loop does not time its steps: the timestamps (a pair around every pass) are
        // written in the last step only. The timer goes back whatever the loop returns.
        let mut timer = self.timer.take();
        let looped = self.probe_loop(rt, inputs, warmup, &mut timer);
        if self.timer.is_none() {
            self.timer = timer;
        }
        let (t0, host) = looped.inspect_err(|_| self.evict_timer = None)?;
        let w0 = std::time::Instant::now();
        rt.wait()?;
        let drain_ms = w0.elapsed().as_secs_f64() * 1e3;
        let wall_ms = t0.elapsed().as_secs_f64() * 1e3 / f64::from(timed.max(1));
        let host_ms = host.as_secs_f64() * 1e3 / f64::from(timed.max(1));
        self.pool.check_errors(rt, self.cfg.workload.n_seqs * layers).await?;
        let stages = match &self.timer {
            Some(t) => Some(StageTimes::from_pairs(&t.read_ms(rt, timer_pairs(layers)).await?, layers)),
            None => None,
        };
        let evict_stages = match self.evict_timer.take() {
            Some((t, names)) => {
                let ms = t.read_ms(rt, names.len() as u32).await?;
                Some(names.iter().zip(ms).map(|(n, m)| (n.to_string(), serde_json::json!(m))).collect::<serde_json::Map<_, _>>())
            }
            None => None,
        };
        Ok(serde_json::json!({
            "probe": "steps",
            "evict_stages_ms": evict_stages,
            "steps": n,
            "warmup_steps": warmup,
            "wall_ms_per_step": wall_ms,
            "host_ms_per_step": host_ms,
            "generate_ms_per_step": generate_ms,
            "drain_ms": drain_ms,
            "last_step_gpu": stages,
            "last_step_gpu_total_ms": stages.as_ref().map(StageTimes::total_ms),
        }))
    }

    /// `probe_steps`' loop: the warm-up steps, a wait, then the timed steps (the last one with
    /// `timer` back in place, and the eviction's kernel timer when asked for). Returns when
    /// the timed steps began and the host time spent encoding them.
    #[cfg(not(target_arch = "wasm32"))]
    fn probe_loop(
        &mut self,
        rt: &Runtime,
        inputs: Vec<(Vec<GenToken>, Vec<Vec<f32>>)>,
        warmup: u32,
        timer: &mut Option<GpuTimer>,
    ) -> Result<(std::time::Instant, std::time::Duration)> {
        let last = inputs.len().saturating_sub(1);
        let mut t0 = std::time::Instant::now();
        let mut host = std::time::Duration::ZERO;
        for (i, (tokens, queries)) in inputs.into_iter().enumerate() {
            if i == warmup as usize {
                rt.wait()?;
                t0 = std::time::Instant::now();
            }
            if i == last {
                self.timer = timer.take();
                // EXPERTKV_PROBE_EVICT: the last step's eviction kernels timed one by one.
                if self.scheduler.is_some() && std::env::var("EXPERTKV_PROBE_EVICT").is_ok() {
                    self.evict_timer = GpuTimer::new(rt, Scheduler::TIMED_STAGES).map(|t| (t, Vec::new()));
                }
            }
            let h0 = std::time::Instant::now();
            self.encode_fused_step(rt, &tokens, queries)?;
            if i >= warmup as usize {
                host += h0.elapsed();
            }
            self.step += 1;
        }
        Ok((t0, host))
    }

    /// Time the pipeline's own attention over its own pool (layer 0) the way `bench attend`
    /// times its kernel: `reps` passes back to back in one submission, with this step's
    /// queries, with the split pass alone, and with random normal queries as the benchmark
    /// uses. Tells the kernel's cost apart from the cost of its place in a step.
    pub async fn probe_attention(&mut self, rt: &Runtime, warmup: u32, reps: u32) -> Result<serde_json::Value> {
        let q = self.workload.queries(0);
        self.attn.set_queries(rt, &q)?;
        self.attn.prepare(rt, 0, self.step);
        let with_workload = crate::bench::time_passes(rt, warmup, reps, &|p| self.attn.encode(p)).await?;
        let split = crate::bench::time_passes(rt, warmup, reps, &|p| self.attn.encode_split(p)).await?;
        let mut rng = crate::rng::Rng::new(11);
        let random: Vec<f32> = (0..q.len()).map(|_| rng.normal() as f32).collect();
        self.attn.set_queries(rt, &random)?;
        let with_random = crate::bench::time_passes(rt, warmup, reps, &|p| self.attn.encode(p)).await?;
        let q_abs = q.iter().map(|x| x.abs()).fold(0f32, f32::max);
        // How full the listed pages are.
        let (lists, counts) = self.pool.read_page_lists(rt).await?;
        let metas: Vec<crate::gpu_data::PageMeta> = rt.read_all(&self.pool.page_meta).await?;
        let mpl = self.pool.cfg.max_pages_per_seq() as usize;
        let (mut listed, mut slots_filled, mut partial) = (0u64, 0u64, 0u64);
        for (li, &c) in counts.iter().enumerate() {
            for &pg in &lists[li * mpl..li * mpl + c as usize] {
                listed += 1;
                let f = metas.get(pg as usize).map_or(0, |m| m.fill);
                slots_filled += u64::from(f);
                partial += u64::from(f < self.pool.cfg.page_size);
            }
        }
        // The same pool configuration filled the way `bench attend` fills its pool.
        let bench_fill_ms = if std::env::var("EXPERTKV_PROBE_BENCH_FILL").is_ok() {
            let mut pool = KvPool::new(rt, self.pool.cfg.clone()).await?;
            let w = &self.cfg.workload;
            crate::bench::fill_random(rt, &mut pool, w.n_seqs, self.workload.position(0), 7, 0, &mut |_, _| {})?;
            pool.gather(rt)?;
            let attn = Attention::new(rt, &pool, AttendOptions { mass: false, ..self.attn.opts.clone() }).await?;
            attn.set_queries(rt, &q)?;
            attn.prepare(rt, 0, 0);
            Some(crate::bench::time_passes(rt, warmup, reps, &|p| attn.encode(p)).await?.median_ms)
        } else {
            None
        };
        Ok(serde_json::json!({
            "probe": "attention",
            "bench_fill_ms": bench_fill_ms,
            "variant": self.attn.describe(),
            "median_ms": with_workload.median_ms,
            "split_ms": split.median_ms,
            "random_queries_ms": with_random.median_ms,
            "max_abs_query": q_abs,
            "chunks": self.attn.n_chunks,
            "pool_buffers": self.pool.n_buffers(),
            "max_pages_per_seq": self.pool.cfg.max_pages_per_seq(),
            "pages_in_pool": self.pool.cfg.n_pages,
            "pages_listed": listed,
            "partial_pages": partial,
            "mean_fill": slots_filled as f64 / listed.max(1) as f64,
        }))
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
                        let basis = crate::reference::codec::basis_slice(c, &basis, meta[page as usize].owner);
                        let got = crate::reference::codec::decode_vector(c, &codec_kv[c0..c0 + cw], basis, kv, s);
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

    /// What the last step did at every layer, for a trace (`crate::trace`): call right after
    /// [`Pipeline::step`].
    pub async fn trace_records(&self, rt: &Runtime) -> Result<Vec<crate::trace::LayerRecord>> {
        let c = &self.pool.cfg;
        let w = &self.cfg.workload;
        let lists_per_layer = (c.max_seqs * c.kv_heads) as usize;
        let maxp = c.max_pages_per_seq() as usize;
        let (lists, counts) = match &self.quest {
            Some(q) => (rt.read_all::<u32>(&q.sel_list).await?, rt.read_all::<u32>(&q.sel_counts).await?),
            None => self.pool.read_page_lists(rt).await?,
        };
        let rings: Vec<crate::gpu_data::RingState> = rt.read_all(&self.pool.rings).await?;
        let keys_per_layer = lists_per_layer * c.n_shards as usize;
        let (sched_lists, ring_counts) = match &self.scheduler {
            Some(s) => (s.read_lists(rt).await?, s.read_ring_counts(rt).await?),
            None => (Vec::new(), Vec::new()),
        };
        let slot_bytes = 2 * u64::from(c.vec_words()) * 4;
        let mut out = Vec::new();
        for layer in 0..c.layers {
            let l = layer as usize;
            let mut pages_read = 0u64;
            let mut bytes_read = 0u64;
            for li in l * lists_per_layer..(l + 1) * lists_per_layer {
                let n = counts[li] as usize;
                pages_read += n as u64;
                for &page in &lists[li * maxp..li * maxp + n.min(maxp)] {
                    bytes_read += if page < c.n_pages { c.page_bytes() } else { c.codec_page_bytes() };
                }
            }
            let keys = l * keys_per_layer..(l + 1) * keys_per_layer;
            let pages_in_use = rings[keys.clone()].iter().map(|r| u64::from(r.count)).sum();
            let tokens_evicted = sched_lists
                .get(l * lists_per_layer..(l + 1) * lists_per_layer)
                .map_or(0, |ls| ls.iter().map(|s| u64::from(s.evicted)).sum());
            let (slots_moved, pages_freed) = ring_counts
                .get(keys)
                .map_or((0, 0), |rc| rc.iter().fold((0u64, 0u64), |(m, f), x| (m + u64::from(x[0]), f + u64::from(x[1]))));
            out.push(crate::trace::LayerRecord {
                step: self.step.saturating_sub(1),
                layer,
                experts: self.router.read_experts(rt, layer, w.n_seqs).await?,
                pages_read,
                bytes_read,
                pages_in_use,
                tokens_evicted,
                slots_moved,
                pages_freed,
                bytes_moved: slots_moved * slot_bytes,
            });
        }
        Ok(out)
    }

    /// Compare the GPU pool with the CPU reference (exactly: rings, page tables, free lists,
    /// page and slot metadata, control words, K/V and compressed pages) and report the
    /// attention checks the lockstep made at every layer of every attended batch and step.
    pub async fn verify(&self, rt: &Runtime) -> Result<Option<VerifyReport>> {
        let Some(model) = &self.model else {
            return Ok(None);
        };
        let snap = self.pool.snapshot(rt).await?;
        let kv = self.pool.read_kv(rt).await?;
        let codec_kv = self.pool.read_codec_kv(rt).await?;
        let parts = [
            ("rings", snap.rings == model.rings),
            ("compressed free list", snap.codec_free == model.codec_free),
            ("compressed pages", codec_kv.is_empty() || codec_kv == model.codec_kv),
            ("ring pages", snap.ring_pages == model.ring_pages),
            ("page metadata", snap.page_meta == model.page_meta),
            ("slot metadata", snap.slot_meta == model.slot_meta),
            ("free list", snap.free_stack == model.free_stack),
            ("control words", snap.ctl == model.ctl),
            ("K/V", kv == model.kv),
        ];
        if let Some((name, _)) = parts.iter().find(|(_, same)| !same) {
            return Err(verify_err(format!("the GPU pool's {name} differ from the CPU reference's")));
        }
        let layer = self.pool.cfg.layers - 1;
        let tokens_checked = (0..self.cfg.workload.n_seqs).map(|s| model.tokens(layer, s, 0).len() as u64).sum();
        let c = self.checked;
        Ok(Some(VerifyReport {
            tokens_checked,
            attention_checked: c.attention,
            attention_max_abs_err: c.max_abs_err,
            attention_worst_share: c.worst_share,
        }))
    }
}
