//! What a run of the decode pipeline is made of ([`DemoConfig`], also the TOML file of
//! `expertkv demo --config`), and the pool geometry, budgets and batch sizes it implies.

use serde::{Deserialize, Serialize};

use crate::config::{Codec, KvDtype, PoolConfig, ShardMap};
use crate::error::{Error, Result};
use crate::evict::config::{Budget, EkvaConfig, SchedulerConfig, Threshold};
use crate::route::config::RouterConfig;
use crate::workload::WorkloadConfig;

/// Everything a demo run is made of; also the TOML config file (`expertkv demo --config FILE`),
/// where every field is optional.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DemoConfig {
    /// The synthetic workload: sequences, layers, heads, experts, prompt length and its statistics.
    pub workload: WorkloadConfig,
    /// Decode steps after the prompt (default 16).
    pub steps: u32,
    /// Slots per page (default 16).
    pub page_size: u32,
    /// Storage type of raw K and V (default f16).
    pub dtype: KvDtype,
    /// Shard rings per (layer, sequence, KV head) (default 4).
    pub n_shards: u32,
    /// How tokens are spread over the shards (default PiKV with `n_tok = n_exp = 4`).
    pub shard_map: ShardMap,
    /// Pages in the pool; `None`: enough for prompt + steps with headroom.
    pub pool_pages: Option<u32>,
    /// Pages per chunk of decode attention's split pass (default 8).
    pub chunk_pages: u32,
    /// Keep a CPU reference of the pool in lockstep and check placement and attention.
    pub verify: bool,
    /// The router choosing each token's experts (default cache-aware, `lambda = 2`).
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
    /// Extra eviction of low-mass tokens under the budget: a fixed or an adaptive threshold
    /// (default fixed at 0: the budget alone).
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
    /// Pages of each list's recall tier attended at every layer (0: no tier): what the evicting
    /// scheduler removes is kept (in host memory where the device reads it in place) and each
    /// list's best evicted pages join its attention ([`crate::evict::recall`]).
    pub recall: u32,
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
            basis_iters: crate::compress::DEFAULT_BASIS_ITERS,
            recall: 0,
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
        let tokens = Budget::parse(b)?.tokens(full);
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
                if self.codec != Codec::None {
                    // As many compressed pages as raw ones: a prefill chunk's eviction can touch
                    // (thaw) most of a list's compressed pages at once, so the raw pages stay
                    // sized for the budget here (the model, which evicts a token at a time, keeps
                    // only a few raw pages per list).
                    c.codec = self.codec;
                    c.codec_pages = c.n_pages;
                }
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
