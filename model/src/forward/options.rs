//! What [`GpuLlama::load`] is asked for ([`ModelOptions`]) and the K/V pool it sizes from that
//! ([`pool_config`]), with the checks both share.

#[cfg(doc)]
use super::GpuLlama;
use super::{LOW_RANK_CALIBRATION_TOKENS, MAX_PREFILL_CHUNK, MAX_SEQS, MODEL_PAGE_SIZE, PREFILL_CHUNK};
use crate::experts::ExpertCacheConfig;
use crate::labels::KvRouting;
use crate::{Error, Result, config::LlamaConfig};
use expertkv_core::config::{Codec, KvDtype, PoolConfig, ShardMap};
use expertkv_core::evict::config::{SchedulerConfig, Threshold};
use expertkv_core::evict::quest::Quest;
use expertkv_core::evict::recall::RecallConfig;
use expertkv_core::step::KvSideConfig;

/// How [`GpuLlama::load`] sets the model's K/V pool up.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelOptions {
    /// Sequences decoded together (1 to [`MAX_SEQS`]).
    pub n_seqs: u32,
    /// Tokens per sequence the pool holds.
    pub max_context: u32,
    /// How the pool stores K and V: [`KvDtype::F16`] (the default, packed pairs) or
    /// [`KvDtype::F32`].
    pub dtype: KvDtype,
    /// An evicting scheduler and its budget (tokens per layer x sequence x KV head).
    pub scheduler: Option<(SchedulerConfig, u32)>,
    /// The page codec that compresses every page leaving its ring's head; [`Codec::None`] (the
    /// default) keeps every page raw.
    pub codec: Codec,
    /// Route every layer's tokens to experts before their append (the slot metadata keeps them,
    /// the shard map places them): the route stage's router, shards and allocator. The routing
    /// source is a MoE file's router, else [`GpuLlama::set_moe`] or [`GpuLlama::set_labels`].
    pub routing: Option<KvRouting>,
    /// PyramidKV over the scheduler: the first layer's budget over the last's (linear in depth,
    /// averaging the budget).
    pub pyramid: Option<f32>,
    /// The scheduler's utility threshold (fixed, or adapted to the kept attention share).
    pub threshold: Threshold,
    /// A MoE file's experts in tiers: this many GPU slots per layer, the rest in host memory
    /// (see [`crate::experts`]); `None` uploads every expert.
    pub experts: Option<ExpertCacheConfig>,
    /// The recall tier under an evicting scheduler: what it evicts is kept (in host memory where
    /// the device reads it in place, up to `max_context` tokens a list) and each list attends
    /// this many of its best evicted pages at every layer ([`expertkv_core::evict::recall`]);
    /// `None`: evicted tokens are gone.
    pub recall: Option<u32>,
    /// Of the candidate pages the recall tier nominates, how many the tier pages' key bounds
    /// nominate (the digests the rest; 0, the default: the digests all). See
    /// [`RecallConfig::with_bound_candidates`] for their bytes.
    pub recall_bounds: u32,
    /// Prompt tokens one [`GpuLlama::prefill`] pass takes at most (1 to [`MAX_PREFILL_CHUNK`];
    /// [`PREFILL_CHUNK`] by default): larger chunks make fewer, larger products, smaller ones
    /// hold less scratch memory (llama.cpp's micro-batch). Fixed at load.
    pub prefill_chunk: u32,
}

impl ModelOptions {
    /// `n_seqs` sequences of up to `max_context` tokens, f16 K/V, full cache, no codec.
    pub fn new(n_seqs: u32, max_context: u32) -> Self {
        ModelOptions {
            n_seqs,
            max_context,
            dtype: KvDtype::F16,
            scheduler: None,
            codec: Codec::None,
            routing: None,
            pyramid: None,
            threshold: Threshold::default(),
            experts: None,
            recall: None,
            recall_bounds: 0,
            prefill_chunk: PREFILL_CHUNK,
        }
    }

    /// The pool these options give a model of configuration `cfg` ([`pool_config`]): its bytes
    /// before loading are [`PoolConfig::pool_bytes`].
    pub fn pool_config(&self, cfg: &LlamaConfig) -> PoolConfig {
        pool_config(
            cfg,
            self.n_seqs,
            self.max_context,
            self.dtype,
            self.scheduler.as_ref(),
            self.codec,
            self.routing.as_ref(),
            self.pyramid,
        )
    }

    /// The K/V side these options give a model of configuration `cfg`
    /// ([`expertkv_core::step::KvSide::new`] builds it): the pool ([`pool_config`]), the policy
    /// over it, the route stage, attention over 8 pages a split chunk.
    pub fn kv_side_config(&self, cfg: &LlamaConfig) -> KvSideConfig {
        KvSideConfig {
            pool: self.pool_config(cfg),
            policy: self.scheduler.clone(),
            pyramid: self.pyramid,
            threshold: self.threshold,
            allocator: self.routing.as_ref().and_then(|r| r.allocator),
            group: cfg.head_count / cfg.head_count_kv.max(1),
            chunk_pages: 8,
            route: self.routing.as_ref().map(|r| r.route_spec(self.n_seqs)),
            recall: self.recall.map(|pages| RecallConfig::new(pages, self.max_context).with_bound_candidates(self.recall_bounds)),
        }
    }

    /// Bytes the K/V side of a model of configuration `cfg` allocates with these options, on a
    /// device whose storage bindings hold `max_binding` bytes: the pool's pages and tables, and
    /// QUEST's page bounds and lists under QUEST or FlexGen ([`GpuLlama::kv_bytes_allocated`]
    /// measures them once loaded). Refused where the options would not load (a sequence count
    /// or context out of range, an invalid pool).
    pub fn kv_bytes(&self, cfg: &LlamaConfig, max_binding: u64) -> Result<u64> {
        check_seqs(self.n_seqs)?;
        check_context(cfg, self.max_context)?;
        let pool = self.pool_config(cfg);
        pool.validate()?;
        let quest = match &self.scheduler {
            Some((SchedulerConfig::Quest | SchedulerConfig::FlexGen, _)) => Quest::bytes(&pool),
            _ => 0,
        };
        Ok(pool.pool_bytes(max_binding) + quest)
    }

    /// The same options with a MoE file's experts in tiers (`None`: every expert on the GPU).
    pub fn expert_cache(self, experts: Option<ExpertCacheConfig>) -> Self {
        ModelOptions { experts, ..self }
    }

    /// The same options with K/V stored as `dtype`.
    pub fn dtype(self, dtype: KvDtype) -> Self {
        ModelOptions { dtype, ..self }
    }

    /// The same options with `scheduler`: a scheduler and its budget in tokens per layer x sequence
    /// x KV head, or `None` for the full cache.
    pub fn scheduler(self, scheduler: Option<(SchedulerConfig, u32)>) -> Self {
        ModelOptions { scheduler, ..self }
    }

    /// The same options with the page codec `codec`.
    pub fn codec(self, codec: Codec) -> Self {
        ModelOptions { codec, ..self }
    }

    /// The same options with the route stage `routing` (`None`: no routing labels, one shard).
    pub fn routing(self, routing: Option<KvRouting>) -> Self {
        ModelOptions { routing, ..self }
    }

    /// The same options with PyramidKV's ratio of the first layer's budget to the last's (needs an
    /// evicting scheduler).
    pub fn pyramid(self, pyramid: Option<f32>) -> Self {
        ModelOptions { pyramid, ..self }
    }

    /// The same options with the recall tier attending `recall` pages a list and layer (`None`:
    /// no tier).
    pub fn recall(self, recall: Option<u32>) -> Self {
        ModelOptions { recall, ..self }
    }

    /// The same options with `recall_bounds` of the recall tier's candidates nominated by the
    /// tier pages' key bounds.
    pub fn recall_bounds(self, recall_bounds: u32) -> Self {
        ModelOptions { recall_bounds, ..self }
    }

    /// The same options with prompts prefilled `prefill_chunk` tokens a pass.
    pub fn prefill_chunk(self, prefill_chunk: u32) -> Self {
        ModelOptions { prefill_chunk, ..self }
    }

    /// The same options with the scheduler's utility threshold (anything but the default needs an
    /// evicting scheduler).
    pub fn threshold(self, threshold: Threshold) -> Self {
        ModelOptions { threshold, ..self }
    }
}

/// `n_seqs` sequences decoded together: 1 to [`MAX_SEQS`].
pub(super) fn check_seqs(n_seqs: u32) -> Result<()> {
    if n_seqs == 0 || n_seqs > MAX_SEQS {
        return Err(Error::config("seqs", n_seqs, format!("the model decodes 1 to {MAX_SEQS} sequences together")));
    }
    Ok(())
}

/// `max_context` tokens per sequence: 1 to the model's trained context.
pub(super) fn check_context(cfg: &LlamaConfig, max_context: u32) -> Result<()> {
    if max_context == 0 || max_context > cfg.context_length {
        return Err(Error::config("context", max_context, format!("must be in 1..={} (the model's trained context)", cfg.context_length)));
    }
    Ok(())
}

/// The most tokens a page list holds between evictions when the scheduler bounds every list
/// by its budget ([`SchedulerConfig::keeps_budget_per_list`], with no PyramidKV layer shape and
/// no EKVA split): the budget and the step's new token. `None` when a list may keep more.
pub fn kept_per_list(scheduler: Option<&(SchedulerConfig, u32)>, pyramid: Option<f32>, routing: Option<&KvRouting>) -> Option<u32> {
    let (s, budget) = scheduler?;
    let split = routing.is_some_and(|r| r.allocator.is_some());
    (s.keeps_budget_per_list() && pyramid.is_none() && !split).then(|| budget.saturating_add(1))
}

/// The pool [`GpuLlama::load`] allocates for `cfg` with these options: every list's pages for
/// `max_context` tokens, or, where each list keeps at most its budget ([`kept_per_list`]), for
/// those (an evicting scheduler's memory is then its budget's, not the context's); FlexGen's
/// GPU tier; a codec's compressed pages. Before loading, [`PoolConfig::pool_bytes`] gives its
/// bytes.
#[allow(clippy::too_many_arguments)]
pub fn pool_config(
    cfg: &LlamaConfig,
    n_seqs: u32,
    max_context: u32,
    dtype: KvDtype,
    scheduler: Option<&(SchedulerConfig, u32)>,
    codec: Codec,
    routing: Option<&KvRouting>,
    pyramid: Option<f32>,
) -> PoolConfig {
    let kept = kept_per_list(scheduler, pyramid, routing);
    let (n_shards, top_k, shard_map) = routing.map_or((1, 1, ShardMap::ByExpert), |r| (r.n_shards, r.top_k, r.shard_map));
    let page_size = MODEL_PAGE_SIZE;
    // A ring may hold every page of its list (maps need not spread tokens evenly); every
    // shard has its own newest page.
    // Under a budget every list holds at most `kept` tokens once compacted: their pages, each
    // shard's partial newest page, and one to spare for the step's append.
    let full = max_context.div_ceil(page_size).saturating_add(n_shards);
    let pages_per_list = kept.map_or(full, |k| k.div_ceil(page_size).saturating_add(2 * n_shards + 1).min(full));
    let mut pool_cfg = PoolConfig {
        layers: cfg.block_count,
        kv_heads: cfg.head_count_kv,
        head_dim: cfg.head_dim,
        page_size,
        dtype,
        n_pages: cfg.block_count.saturating_mul(n_seqs).saturating_mul(cfg.head_count_kv).saturating_mul(pages_per_list),
        max_seqs: n_seqs,
        n_shards,
        ring_capacity: pages_per_list.saturating_add(1),
        top_k,
        shard_map,
        max_buffer_bytes: None,
        codec: Codec::None,
        codec_pages: 0,
    };
    // Sizes saturate rather than wrap: a pool past u32 is refused by its validation.
    if let Some((SchedulerConfig::FlexGen, budget)) = scheduler {
        // FlexGen's GPU tier: the budget's pages and every ring's newest, with room for a
        // fetch's swap; the rest of the context lives in host memory.
        let lists = cfg.block_count.saturating_mul(n_seqs).saturating_mul(cfg.head_count_kv);
        pool_cfg.n_pages = pool_cfg.n_pages.min(lists.saturating_mul(budget.div_ceil(page_size).saturating_add(2 * n_shards + 2)));
    }
    if codec != Codec::None {
        // Raw pages only for every list's head page (and one to spare), plus, for the
        // low-rank codecs, the calibration window's pages; the rest compressed. Under an
        // evicting scheduler also the pages an eviction thaws: a token evicted a step
        // touches at most one compressed page of its list (see `compress::Thaw`); a list
        // that needs more than the raw pages free waits a step.
        let lists = cfg.block_count.saturating_mul(n_seqs).saturating_mul(cfg.head_count_kv);
        let window = if codec.is_low_rank() { LOW_RANK_CALIBRATION_TOKENS.min(max_context).div_ceil(page_size) } else { 0 };
        let thaw = if scheduler.is_some() { n_shards + 2 } else { 0 };
        pool_cfg.codec_pages = pool_cfg.n_pages;
        pool_cfg.n_pages = lists.saturating_mul(2 + n_shards + window + thaw);
        pool_cfg.codec = codec;
    }
    pool_cfg
}

/// The checks [`GpuLlama::load`] (and [`GpuLlama::reconfigure`]) make of `o` for the model
/// `cfg` before allocating anything.
pub(super) fn check_options(cfg: &LlamaConfig, o: &ModelOptions) -> Result<()> {
    let ModelOptions { n_seqs, max_context, pyramid, prefill_chunk, .. } = *o;
    if prefill_chunk == 0 || prefill_chunk > MAX_PREFILL_CHUNK {
        return Err(Error::config("prefill_chunk", prefill_chunk, format!("a prefill pass takes 1 to {MAX_PREFILL_CHUNK} tokens")));
    }
    check_seqs(n_seqs)?;
    check_context(cfg, max_context)?;
    if let Some(r) = &o.routing {
        r.validate()?;
        if cfg.expert_count > 0 && (r.n_experts, r.top_k) != (cfg.expert_count, cfg.expert_used_count) {
            return Err(Error::config(
                "routing",
                format!("E{} k{}", r.n_experts, r.top_k),
                format!("a MoE file routes with its own {} experts, top {}", cfg.expert_count, cfg.expert_used_count),
            ));
        }
    }
    // What the K/V side would refuse once made: the policy with the codec, its budget and
    // shapes, EKVA.
    o.kv_side_config(cfg).validate()?;
    if let Some((s, b)) = o.scheduler.as_ref().filter(|(s, _)| s.uses_evict_kernels()) {
        s.layer_budgets(*b, cfg.block_count, pyramid, MODEL_PAGE_SIZE)?;
    }
    if cfg.rope_dimension_count != cfg.head_dim {
        return Err(Error::Model(format!(
            "llama.rope.dimension_count is {} of head_dim {}: partial rotary embeddings are implemented in the CPU reference only, not on the GPU",
            cfg.rope_dimension_count, cfg.head_dim
        )));
    }
    Ok(())
}
