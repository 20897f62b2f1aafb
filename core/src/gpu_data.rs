//! Host mirrors of every struct the WGSL kernels share with the host.
//!
//! Each is `#[repr(C)]`, `Pod`, with explicit padding and a compile-time size check, and names the
//! WGSL struct it must match. Change both sides together.

use bytemuck::{Pod, Zeroable};

/// Pool geometry, bound as a uniform by every pool kernel.
/// Must match `Geometry` in `shaders/wgsl/common/pool.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct Geometry {
    /// Slots per page (P): tokens one page holds, for one KV head of one layer.
    pub page_size: u32,
    /// KV heads per layer; each has its own shard rings and page lists.
    pub kv_heads: u32,
    /// Dimensions of one K or V vector (d).
    pub head_dim: u32,
    /// u32 words of one token's K (or V) vector for one head: `head_dim / 2` with f16 storage,
    /// `head_dim` with f32.
    pub vec_words: u32,
    /// u32 words of one raw page: `2 * page_size * vec_words`, the K block then the V block.
    pub page_words: u32,
    /// Raw pages in the whole pool, over all pool buffers (page ids `0..n_pages`).
    pub n_pages: u32,
    /// Raw pages in each pool buffer (the last buffer may hold fewer).
    pub pages_per_buffer: u32,
    /// Page entries per shard ring (R); a full ring recycles its oldest page.
    pub ring_capacity: u32,
    /// Shard rings per (layer, sequence, KV head).
    pub n_shards: u32,
    /// Sequences the pool holds (sequence ids `0..max_seqs`).
    pub max_seqs: u32,
    /// Layers the pool caches (layer ids `0..layers`).
    pub layers: u32,
    /// Experts (and gates) kept in each slot's metadata.
    pub top_k: u32,
    /// How a token's shard is chosen: one of [`shard_maps`].
    pub shard_map: u32,
    /// PiKV map: modulus of the token position, a power of two at most `n_shards` (1 under the
    /// other maps).
    pub n_tok: u32,
    /// PiKV map: modulus of the expert id, a power of two at most `n_shards` (1 under the other
    /// maps).
    pub n_exp: u32,
    /// Token-block map: consecutive positions per block (1 under the other maps).
    pub token_block: u32,
    /// u32 words of metadata per slot: [`meta::words`] of `top_k`.
    pub meta_words: u32,
    /// Page list capacity of one (layer, sequence, KV head), in pages: `n_shards * ring_capacity`.
    pub max_pages_per_seq: u32,
    /// 1: K and V stored as packed f16 pairs; 0: stored as f32.
    pub f16_kv: u32,
    /// How full pages are stored compressed: one of [`crate::config::codec_ids`] (0: none, pages stay raw).
    pub codec: u32,
    /// Compressed pages in the pool (0 without a codec); their ids follow the raw pages',
    /// `n_pages..n_pages + codec_pages`.
    pub codec_pages: u32,
    /// u32 words of one compressed page.
    pub codec_page_words: u32,
    /// FastV dims: K dimensions kept; low rank and LoRA: the rank; 0 under the other codecs.
    pub codec_param: u32,
    /// KIVI int8 / int4: dimensions per V quantisation group; 0 under the other codecs.
    pub v_group: u32,
}
const _: () = assert!(std::mem::size_of::<Geometry>() == 96);

/// Must match `RingState` in `shaders/wgsl/common/pool.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct RingState {
    /// Array index (0 to `ring_capacity - 1`) of the ring's oldest page.
    pub head: u32,
    /// Pages in the ring, at most `ring_capacity`.
    pub count: u32,
    /// Slots used in the ring's newest page; `page_size` when the next token needs a new page
    /// (so also for an empty ring).
    pub fill: u32,
    /// Padding to the WGSL struct's 16 bytes; zero.
    pub _pad: u32,
}
const _: () = assert!(std::mem::size_of::<RingState>() == 16);

/// Must match `PageMeta` in `shaders/wgsl/common/pool.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct PageMeta {
    /// Key of the shard ring (layer, sequence, KV head, shard) that holds the page, or [`NO_OWNER`]
    /// when the page is free.
    pub owner: u32,
    /// Valid slots in the page, 0 to `page_size`.
    pub fill: u32,
}
const _: () = assert!(std::mem::size_of::<PageMeta>() == 8);

/// Must match `PoolCtl` in `shaders/wgsl/common/pool.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct PoolCtl {
    /// Entries on the raw pages' free stack: raw pages free to take.
    pub free_top: u32,
    /// [`pool_errors`] bits, sticky until the host clears them.
    pub error_flags: u32,
    /// 1 when the last append batch was refused (nothing of it written), else 0.
    pub abort: u32,
    /// Pages recycled because their ring was full, their tokens dropped; cumulative.
    pub ring_overflows: u32,
    /// Tokens of accepted append batches (one per token, not per KV head); cumulative.
    pub tokens_appended: u32,
    /// Pages, raw and compressed, returned to the free stacks by `append/release`; cumulative.
    pub pages_released: u32,
    /// Pages freed by eviction (compaction); cumulative.
    pub pages_evicted: u32,
    /// Entries on the compressed pages' free stack.
    pub codec_free_top: u32,
}
const _: () = assert!(std::mem::size_of::<PoolCtl>() == 32);

/// Must match `PoolWindow` in `shaders/wgsl/common/window.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct PoolWindow {
    /// Index of the pool buffer the window describes, 0 to `n_buffers - 1`.
    pub buffer_index: u32,
    /// Global id of the buffer's first page.
    pub first_page: u32,
    /// Pages held by the buffer.
    pub page_count: u32,
    /// Pool buffers in all.
    pub n_buffers: u32,
}
const _: () = assert!(std::mem::size_of::<PoolWindow>() == 16);

/// Must match `AppendParams` in `shaders/wgsl/common/append.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct AppendParams {
    /// Tokens in the batch; each is placed once per KV head.
    pub n_tokens: u32,
    /// u32 words per new-token record: `3 + 2 * top_k` (layer, sequence, position, experts, gates).
    pub token_words: u32,
    /// Step of the batch, written as each new slot's last access ([`meta::LAST_ACCESS`]).
    pub step: u32,
    /// Padding to the WGSL struct's 16 bytes; zero.
    pub _pad: u32,
}
const _: () = assert!(std::mem::size_of::<AppendParams>() == 16);

/// Must match `ApplyParams` in `shaders/wgsl/append/apply_routing.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct ApplyParams {
    /// Token records in the batch to fill from the router's output.
    pub n_tokens: u32,
    /// u32 words per new-token record: `3 + 2 * top_k`.
    pub token_words: u32,
    /// Tokens per layer in the batch, which is ordered [layer][token of the layer].
    pub per_layer: u32,
    /// Router rows from one layer's first token to the next layer's (at least `per_layer`).
    pub row_stride: u32,
    /// Router row of the batch's first token (its layer's first row for a staged batch).
    pub first_row: u32,
    /// Padding to the WGSL struct's 32 bytes; zero.
    pub _pad: [u32; 3],
}
const _: () = assert!(std::mem::size_of::<ApplyParams>() == 32);

/// Must match `TokenPlan` in `shaders/wgsl/common/append.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct TokenPlan {
    /// Key of the item's shard ring (layer, sequence, KV head, shard); `u32::MAX` for a refused
    /// token.
    pub key: u32,
    /// Tokens earlier in the batch bound for the same (layer, sequence, shard).
    pub rank: u32,
    /// Fill of the ring's newest page before the batch plus `rank`: the item's slot counted from
    /// the first slot of that page.
    pub u: u32,
    /// Array index in the ring (0 to `ring_capacity - 1`) of the page that receives the token.
    pub ring_index: u32,
    /// Slot inside that page, 0 to `page_size - 1`.
    pub slot: u32,
    /// [`plan_flags`] bits.
    pub flags: u32,
    /// Page the write pass put the token in, for the host's inspection; [`NO_OWNER`] until then.
    pub page: u32,
    /// Padding to the WGSL struct's 32 bytes; zero.
    pub _pad: u32,
}
const _: () = assert!(std::mem::size_of::<TokenPlan>() == 32);

/// Must match `GatherParams` in `shaders/wgsl/append/gather_pages.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct GatherParams {
    /// Layer of the dispatch's first workgroup row: row y gathers layer `first_layer + y`.
    pub first_layer: u32,
    /// Padding to the WGSL struct's 16 bytes; zero.
    pub _pad0: u32,
    /// Padding to the WGSL struct's 16 bytes; zero.
    pub _pad1: u32,
    /// Padding to the WGSL struct's 16 bytes; zero.
    pub _pad2: u32,
}
const _: () = assert!(std::mem::size_of::<GatherParams>() == 16);

/// Must match `TierParams` in `shaders/wgsl/common/recall.wgsl`: the recall tier's shape
/// (`core/src/evict/recall.rs`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct TierParams {
    /// Tier slots per page list, a multiple of the page size.
    pub cap: u32,
    /// Pages recalled per list and layer.
    pub pages: u32,
    /// The attention's partial buffer index the recall pass writes (its last).
    pub slot: u32,
    /// 1: the recall pass also finds the pages the true scores would choose and counts how many
    /// of them the digest chose (`tier_stats`); 0: the digest alone.
    pub audit: u32,
    /// Word of `tier_digest` where the tier pages' key bounds start (0: none kept).
    pub bounds_at: u32,
    /// Padding to 32 bytes (0).
    pub _pad: [u32; 3],
}
const _: () = assert!(std::mem::size_of::<TierParams>() == 32);

/// Words of one tier page's key bounds (`common/recall.wgsl`'s `bound_words`): an exponent, then
/// an i8 minimum and an i8 maximum of every key dimension, four a word.
pub fn bound_words(head_dim: u32) -> u64 {
    1 + 2 * u64::from(head_dim.div_ceil(4))
}

/// Tier tokens a list's key digests calibrate on (`common/recall.wgsl`'s `DIGEST_CALIB_TOKENS`).
pub const DIGEST_CALIB_TOKENS: u32 = 64;

/// The digest calibration words of `lists` lists not yet calibrated (`common/recall.wgsl`): per
/// list, centre 0, spread 1 and key sums 0, `head_dim` floats each.
pub fn uncalibrated_digests(lists: u32, head_dim: u32) -> Vec<f32> {
    let d = head_dim as usize;
    let one: Vec<f32> = (0..3 * d).map(|i| if (d..2 * d).contains(&i) { 1.0 } else { 0.0 }).collect();
    one.repeat(lists as usize)
}

/// Must match `ReleaseParams` in `shaders/wgsl/append/release.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct ReleaseParams {
    /// Shard rings the release walks (all of the pool's: one per layer, sequence, KV head and
    /// shard), with one count of pages to release each.
    pub n_keys: u32,
    /// Padding to the WGSL struct's 16 bytes; zero.
    pub _pad0: u32,
    /// Padding to the WGSL struct's 16 bytes; zero.
    pub _pad1: u32,
    /// Padding to the WGSL struct's 16 bytes; zero.
    pub _pad2: u32,
}
const _: () = assert!(std::mem::size_of::<ReleaseParams>() == 16);

/// Must match `AttendParams` in `shaders/wgsl/attend/common.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct AttendParams {
    /// Sequences attended (ids `0..n_seqs`).
    pub n_seqs: u32,
    /// Layer whose page lists are read.
    pub layer: u32,
    /// Query heads per KV head (the GQA group size).
    pub group: u32,
    /// Query heads per token: `kv_heads * group`.
    pub q_heads: u32,
    /// Chunks of `chunk_pages` pages each that a sequence's page list is split into.
    pub n_chunks: u32,
    /// Pages per chunk of the split pass.
    pub chunk_pages: u32,
    /// Pool buffers; partial results are kept per (buffer, chunk).
    pub n_buffers: u32,
    /// 1: store each scaled score q.k for the attention-mass pass; 0: do not.
    pub write_scores: u32,
    /// Length of one score row (per sequence and query head), in tokens:
    /// `max_pages_per_seq * page_size`.
    pub max_tokens: u32,
    /// Step written as each attended slot's last access by the attention-mass pass.
    pub step: u32,
    /// Score scale, `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// Padding to the WGSL struct's 48 bytes; zero.
    pub _pad0: u32,
}
const _: () = assert!(std::mem::size_of::<AttendParams>() == 48);

/// Must match `PrefillParams` in `shaders/wgsl/attend/prefill.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct PrefillParams {
    /// The sequence whose pages the chunk's queries read.
    pub seq: u32,
    /// Position of the chunk's first query; query `c` sees slots at positions up to this + `c`.
    pub first_position: u32,
    /// Padding to 16 bytes; zero.
    pub _pad0: u32,
    /// Padding to 16 bytes; zero.
    pub _pad1: u32,
}
const _: () = assert!(std::mem::size_of::<PrefillParams>() == 16);

/// Must match `CopyParams` in `shaders/wgsl/bench/copy.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CopyParams {
    /// 16-byte words (`vec4<u32>`) to copy.
    pub n_vec4: u32,
    /// Invocations in the whole dispatch (workgroups x 256): the grid-stride step.
    pub stride: u32,
    /// Padding to the WGSL struct's 16 bytes; zero.
    pub _pad0: u32,
    /// Padding to the WGSL struct's 16 bytes; zero.
    pub _pad1: u32,
}
const _: () = assert!(std::mem::size_of::<CopyParams>() == 16);

/// Must match `FmaParams` in `shaders/wgsl/bench/fma.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct FmaParams {
    /// Iterations of each invocation's eight vec4 FMA chains (64 flops per iteration).
    pub iters: u32,
    /// Padding to the WGSL struct's 16 bytes; zero.
    pub _pad0: u32,
    /// Padding to the WGSL struct's 16 bytes; zero.
    pub _pad1: u32,
    /// Padding to the WGSL struct's 16 bytes; zero.
    pub _pad2: u32,
}
const _: () = assert!(std::mem::size_of::<FmaParams>() == 16);

/// `TokenPlan::flags` bits; must match `PLAN_*` in `shaders/wgsl/common/append.wgsl`.
pub mod plan_flags {
    /// First token of a page that was not in the ring before this batch.
    pub const OPENS: u32 = 1;
    /// Opens a page taken from the free stack.
    pub const NEEDS_FREE: u32 = 2;
    /// Opens a page by recycling the ring's oldest (ring full); that page's tokens are dropped.
    pub const RECYCLES: u32 = 4;
    /// Last item of the batch bound for its shard ring: the one that advances the ring's state.
    pub const LAST_IN_KEY: u32 = 8;
    /// Last item of the batch written to its page: the one that sets the page's fill.
    pub const LAST_IN_PAGE: u32 = 16;
    /// Layer or sequence out of range: the token is refused, and with it the batch.
    pub const INVALID: u32 = 32;
}

/// `PoolCtl::error_flags` bits; must match `ERR_*` in `shaders/wgsl/common/pool.wgsl`.
pub mod pool_errors {
    /// An append batch needed more pages than the free stack held; the batch was refused.
    pub const POOL_EXHAUSTED: u32 = 1;
    /// An append batch held a token whose layer or sequence is out of range; the batch was refused.
    pub const BAD_TOKEN: u32 = 2;
    /// A full ring of a pool with a page codec would have recycled a compressed page as a raw
    /// one; the batch was refused.
    pub const RING_FULL: u32 = 4;
}

/// `PageMeta::owner` of a free page; must match `NO_OWNER` in `shaders/wgsl/common/pool.wgsl`.
pub const NO_OWNER: u32 = u32::MAX;

/// Slot metadata word offsets; must match `META_*` in `shaders/wgsl/common/pool.wgsl`.
pub mod meta {
    /// The token's position in its sequence.
    pub const POSITION: usize = 0;
    /// Step of the slot's last write or attention read.
    pub const LAST_ACCESS: usize = 1;
    /// Attention reads of the slot since it was written.
    pub const ACCESS_COUNT: usize = 2;
    /// First of the token's `top_k` expert ids.
    pub const EXPERTS: usize = 3;
    /// Offset of the first of the token's `top_k` gates (f32 bits), after the experts.
    pub fn gates(top_k: usize) -> usize {
        EXPERTS + top_k
    }
    /// Offset of the slot's accumulated attention mass (f32 bits), after the gates.
    pub fn attn(top_k: usize) -> usize {
        EXPERTS + 2 * top_k
    }
    /// Words per slot: position, last access, access count, experts, gates, attention mass.
    pub fn words(top_k: usize) -> usize {
        EXPERTS + 2 * top_k + 1
    }
}

/// Value of the `Geometry::shard_map` field; must match `SHARD_MAP_*` in `common/pool.wgsl`.
pub mod shard_maps {
    /// PiKV: shard `(position mod n_tok) XOR (expert mod n_exp)`, by the token's first expert.
    pub const PIKV: u32 = 0;
    /// By expert: shard `expert mod n_shards`, by the token's first expert.
    pub const EXPERT: u32 = 1;
    /// By token block: shard `(position / token_block) mod n_shards`.
    pub const TOKEN_BLOCK: u32 = 2;
}

/// Must match `RouteParams` in `shaders/wgsl/common/route.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct RouteParams {
    /// Tokens routed by the dispatch.
    pub n_tokens: u32,
    /// Experts of the model, at most 256.
    pub n_experts: u32,
    /// Experts chosen per token, at most 8.
    pub top_k: u32,
    /// Which router runs: one of [`routers`].
    pub router: u32,
    /// Hierarchical router: expert groups, of `n_experts / n_groups` experts each.
    pub n_groups: u32,
    /// Hierarchical router: groups kept per token.
    pub topk_groups: u32,
    /// Hash router: id of the dispatch's first token (tokens are numbered consecutively).
    pub token_offset: u32,
    /// Adaptive router: workgroups of the gradient pass (one per 64 tokens), whose partial sums
    /// the update pass adds.
    pub n_partials: u32,
    /// Load-balance router: strength of the bias `-alpha * (load - mean load)`.
    pub alpha: f32,
    /// Cache-aware router: strength of the bias `-lambda * ln(1 + miss)`.
    pub lambda: f32,
    /// Entropy router: strength of the bias `beta * ln(load + 1 / (16 n_experts))`; above 0 it
    /// favours popular experts, lowering the routing entropy.
    pub beta: f32,
    /// Weight of the newest step in the moving averages, 0 to 1.
    pub ema: f32,
    /// Adaptive router: learning rate of the score bias.
    pub lr: f32,
    /// Adaptive router: weight of KL(router || model gate) in its cost.
    pub kappa: f32,
    /// Adaptive router: cost per unit of miss rate (routing to an expert whose KV is missing).
    pub c_miss: f32,
    /// Adaptive router: cost per unit of load above uniform (`load * n_experts - 1`).
    pub c_lb: f32,
    /// Layer whose statistics are read and updated (they are kept per (layer, expert)).
    pub layer: u32,
    /// Row of the dispatch's first token in the logits, experts and gates buffers:
    /// `layer * max_tokens`.
    pub token_base: u32,
    /// Padding to the WGSL struct's 80 bytes; zero.
    pub _pad1: u32,
    /// Padding to the WGSL struct's 80 bytes; zero.
    pub _pad2: u32,
}
const _: () = assert!(std::mem::size_of::<RouteParams>() == 80);

/// Must match `ExpertStats` in `shaders/wgsl/common/route.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable, serde::Serialize)]
pub struct ExpertStats {
    /// Moving average (weight `ema`) of the share of routing slots the expert receives, 0 to 1.
    pub load: f32,
    /// Share of the K/V vectors of tokens routed to the expert that are no longer cached, 0 to 1.
    pub miss: f32,
    /// Adaptive router: the learned score bias.
    pub bias: f32,
    /// Adaptive router: the last gradient of its cost with respect to `bias`.
    pub grad: f32,
    /// Routing slots the expert received this step; reset by the stats pass.
    pub count: u32,
    /// Routing slots the expert has received since the start (tokens routed to it, counting
    /// every one of the k choices).
    pub appended: u32,
    /// K/V vectors (token x KV head) of tokens routed to the expert still in the cache, recounted
    /// by `route/miss.wgsl`; a slot counts once for each of its `top_k` experts.
    pub resident: u32,
    /// Padding to the WGSL struct's 32 bytes; zero.
    pub _pad: u32,
}
const _: () = assert!(std::mem::size_of::<ExpertStats>() == 32);

/// Must match `RouteSummary` in `shaders/wgsl/common/route.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable, serde::Serialize)]
pub struct RouteSummary {
    /// Entropy (nats) of the last step's distribution of routing slots over experts.
    pub entropy: f32,
    /// Realised cost: mean over the last step's routing slots of the chosen expert's cost.
    pub cost: f32,
    /// Adaptive router: mean over tokens of KL(softmax(logit + bias) || softmax(logit)).
    pub kl: f32,
    /// Adaptive router: mean over tokens of the expected expert cost under softmax(logit + bias).
    pub expected_cost: f32,
    /// Routing steps folded into the layer's statistics so far.
    pub steps: u32,
    /// Padding to the WGSL struct's 32 bytes; zero.
    pub _pad0: u32,
    /// Padding to the WGSL struct's 32 bytes; zero.
    pub _pad1: u32,
    /// Padding to the WGSL struct's 32 bytes; zero.
    pub _pad2: u32,
}
const _: () = assert!(std::mem::size_of::<RouteSummary>() == 32);

/// `RouteParams::router`; must match `ROUTER_*` in `shaders/wgsl/common/route.wgsl`.
pub mod routers {
    /// Experts from a hash of the token id; scores are ignored.
    pub const HASH: u32 = 0;
    /// The top k of the model's router logits, with no bias.
    pub const TOPK: u32 = 1;
    /// Bias `-alpha * (load - mean load)`: steers tokens away from busy experts.
    pub const LOAD_BALANCE: u32 = 2;
    /// Bias `-lambda * ln(1 + miss)` (PiKV): steers tokens away from experts whose KV is missing.
    pub const CACHE_AWARE: u32 = 3;
    /// Bias `beta * ln(load + 1 / (16 n_experts))`: moves the routing entropy.
    pub const ENTROPY: u32 = 4;
    /// A per-expert bias learned online against the expert cost plus `kappa` times the KL to the
    /// model's gate.
    pub const ADAPTIVE: u32 = 5;
    /// The top k within the `topk_groups` expert groups with the best maximum score.
    pub const HIERARCHICAL: u32 = 6;
}

/// Must match `EvictParams` in `shaders/wgsl/common/evict.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct EvictParams {
    /// The scheduler: one of [`policies`].
    pub policy: u32,
    /// Page lists, one per (layer, sequence, KV head).
    pub n_lists: u32,
    /// Current step; LRU+ divides a slot's last access by it for the slot's recency.
    pub step: u32,
    /// Positions `0..sinks` of every sequence (attention sinks) are kept by every policy but LRU.
    pub sinks: u32,
    /// The last `window` positions of a sequence are kept by H2O, AdaKV and LRU+; Duo measures a
    /// head's attention on the sinks and this window.
    pub window: u32,
    /// 1: each list's threshold `ListState::tau` adapts to its hit rate; 0: `threshold` is used.
    pub adaptive: u32,
    /// Tokens per list, the scheduler's configured budget; the kernels take each layer's base
    /// budget from the `layer_budgets` buffer instead.
    pub base_budget: u32,
    /// Layer of the budget pass's first workgroup row (row y: layer `first_layer + y`).
    pub first_layer: u32,
    /// LRU+: weight of recency, `last_access / step`.
    pub w_recency: f32,
    /// LRU+: weight of frequency, `ln(1 + access count)`.
    pub w_freq: f32,
    /// LRU+: weight of the accumulated attention mass.
    pub w_attn: f32,
    /// Duo: share of a head's attention mass on the sinks and the window at or above which it is a
    /// streaming head, 0 to 1.
    pub duo_tau: f32,
    /// AdaKV: share of the base budget every head keeps before the rest is shared out by the
    /// entropy of each head's attention, 0 to 1.
    pub ada_floor: f32,
    /// Fixed threshold of the mass-scored policies (H2O, AdaKV, LRU+): a token whose attention mass
    /// is below `threshold` times the list's mean mass is evicted too; 0: off.
    pub threshold: f32,
    /// Adaptive threshold: the hit rate (share of attention mass kept) to hold.
    pub hit_target: f32,
    /// Adaptive threshold: change of `tau` per unit of hit-rate error, per eviction.
    pub tau_step: f32,
    /// EKVA: expert groups per list (0: the allocator is off).
    pub n_groups: u32,
    /// EKVA: share of a list's budget spread evenly over its groups before importance decides.
    pub ekva_floor: f32,
    /// EKVA: weight of routing frequency (the rest: attention mass) in expert importance.
    pub ekva_alpha: f32,
    /// EKVA: weight of the previous importance in its moving average.
    pub ekva_decay: f32,
}
const _: () = assert!(std::mem::size_of::<EvictParams>() == 80);

/// Must match `GroupState` in `shaders/wgsl/common/evict.wgsl`: one expert group of one page
/// list under the EKVA allocator (tokens whose top-1 expert at that layer is the group's).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable, serde::Serialize)]
pub struct GroupState {
    /// Tokens of the group before eviction.
    pub tokens: u32,
    /// The group's share of the list's attention mass, in units of 2^-24 (rounded).
    pub mass: u32,
    /// Tokens the group may keep (`KEEP_ALL`: the list keeps everything).
    pub budget: u32,
    /// Tokens the last eviction took from the group down to its own budget (not those the list
    /// then took to keep its own budget where protected tokens held a group above its share).
    pub evicted: u32,
}
const _: () = assert!(std::mem::size_of::<GroupState>() == 16);

/// `GroupState::mass` units per unit of mass share.
pub const GROUP_MASS_ONE: f32 = 16_777_216.0;

/// Must match `ListState` in `shaders/wgsl/common/evict.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable, serde::Serialize)]
pub struct ListState {
    /// Tokens the list may keep, set by the budget pass; [`KEEP_ALL`]: no limit.
    pub budget: u32,
    /// Tokens in the list before the last eviction.
    pub tokens: u32,
    /// Tokens evicted by the last eviction.
    pub evicted: u32,
    /// Tokens evicted since the start; cumulative.
    pub evicted_total: u32,
    /// Adaptive threshold, relative to the list's mean attention mass, 0 to 1.
    pub tau: f32,
    /// Share of the list's attention mass kept by the last eviction (1 when it had none).
    pub hit_rate: f32,
    /// Attention mass of the list's tokens before the last eviction.
    pub mass: f32,
    /// Duo: the list's head kind, one of [`duo_kinds`], set by the budget pass.
    pub kind: u32,
}
const _: () = assert!(std::mem::size_of::<ListState>() == 32);

/// `EvictParams::policy`; must match `POLICY_*` in `shaders/wgsl/common/evict.wgsl`.
pub mod policies {
    /// H2O: evicts the lowest accumulated attention mass; sinks and window kept.
    pub const H2O: u32 = 0;
    /// StreamingLLM: keeps the sinks and the most recent tokens; the oldest go first.
    pub const STREAMING: u32 = 1;
    /// Evicts the slots least recently written or read by attention.
    pub const LRU: u32 = 2;
    /// LRU+: a weighted sum of recency, frequency and attention mass (`w_recency`, `w_freq`,
    /// `w_attn`); sinks and window kept.
    pub const LRU_PLUS: u32 = 3;
    /// AdaKV: H2O's utility, with each layer's budget shared over its heads by the entropy of
    /// their attention (floor `ada_floor`).
    pub const ADAKV: u32 = 4;
    /// DuoAttention: streaming heads keep the base budget of sinks and recent tokens, retrieval
    /// heads keep everything.
    pub const DUO: u32 = 5;
}

/// `ListState::budget` of a list that keeps everything; must match `KEEP_ALL`.
pub const KEEP_ALL: u32 = u32::MAX;
/// Utility key no policy evicts; must match `PROTECTED` in `common/evict.wgsl`.
pub const PROTECTED: u32 = u32::MAX;

/// `ListState::kind` under DuoAttention.
pub mod duo_kinds {
    /// A retrieval head: its attention is spread out; it keeps every token.
    pub const RETRIEVAL: u32 = 1;
    /// A streaming head: at least `duo_tau` of its attention mass is on the sinks and the window;
    /// it keeps the base budget.
    pub const STREAMING: u32 = 2;
}

/// f32 to u32 with unsigned order = float order (twin of `orderable` in `common/evict.wgsl`).
pub fn orderable(x: f32) -> u32 {
    let b = x.to_bits();
    if b & 0x8000_0000 != 0 { !b } else { b | 0x8000_0000 }
}

/// Inverse of [`orderable`].
pub fn from_orderable(k: u32) -> f32 {
    if k & 0x8000_0000 != 0 { f32::from_bits(k & 0x7fff_ffff) } else { f32::from_bits(!k) }
}

/// Must match `QuestParams` in `shaders/wgsl/evict/quest_select.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct QuestParams {
    /// Layer whose page lists are selected from.
    pub layer: u32,
    /// Pages kept per (sequence, KV head): those with the highest upper bound of q.k.
    pub keep_pages: u32,
    /// Query heads per KV head (the GQA group size).
    pub group: u32,
    /// Query heads per token: `kv_heads * group`.
    pub q_heads: u32,
    /// Sequences selected for (ids `0..n_seqs`).
    pub n_seqs: u32,
    /// Score scale, `1 / sqrt(head_dim)`; `quest_select.wgsl` does not read it (a positive scale
    /// leaves the ranking unchanged).
    pub scale: f32,
    /// Padding to the WGSL struct's 32 bytes; zero.
    pub _pad0: u32,
    /// Padding to the WGSL struct's 32 bytes; zero.
    pub _pad1: u32,
}
const _: () = assert!(std::mem::size_of::<QuestParams>() == 32);
