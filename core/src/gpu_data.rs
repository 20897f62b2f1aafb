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
    pub page_size: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub vec_words: u32,
    pub page_words: u32,
    pub n_pages: u32,
    pub pages_per_buffer: u32,
    pub ring_capacity: u32,
    pub n_shards: u32,
    pub max_seqs: u32,
    pub layers: u32,
    pub top_k: u32,
    pub shard_map: u32,
    pub n_tok: u32,
    pub n_exp: u32,
    pub token_block: u32,
    pub meta_words: u32,
    pub max_pages_per_seq: u32,
    pub f16_kv: u32,
    pub codec: u32,
    pub codec_pages: u32,
    pub codec_page_words: u32,
    pub codec_param: u32,
    pub v_group: u32,
}
const _: () = assert!(std::mem::size_of::<Geometry>() == 96);

/// Must match `RingState` in `shaders/wgsl/common/pool.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct RingState {
    pub head: u32,
    pub count: u32,
    pub fill: u32,
    pub _pad: u32,
}
const _: () = assert!(std::mem::size_of::<RingState>() == 16);

/// Must match `PageMeta` in `shaders/wgsl/common/pool.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct PageMeta {
    pub owner: u32,
    pub fill: u32,
}
const _: () = assert!(std::mem::size_of::<PageMeta>() == 8);

/// Must match `PoolCtl` in `shaders/wgsl/common/pool.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct PoolCtl {
    pub free_top: u32,
    pub error_flags: u32,
    pub abort: u32,
    pub ring_overflows: u32,
    pub tokens_appended: u32,
    pub pages_released: u32,
    pub pages_evicted: u32,
    pub codec_free_top: u32,
}
const _: () = assert!(std::mem::size_of::<PoolCtl>() == 32);

/// Must match `PoolWindow` in `shaders/wgsl/common/window.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct PoolWindow {
    pub buffer_index: u32,
    pub first_page: u32,
    pub page_count: u32,
    pub n_buffers: u32,
}
const _: () = assert!(std::mem::size_of::<PoolWindow>() == 16);

/// Must match `AppendParams` in `shaders/wgsl/common/append.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct AppendParams {
    pub n_tokens: u32,
    pub token_words: u32,
    pub step: u32,
    pub _pad: u32,
}
const _: () = assert!(std::mem::size_of::<AppendParams>() == 16);

/// Must match `ApplyParams` in `shaders/wgsl/append/apply_routing.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct ApplyParams {
    pub n_tokens: u32,
    pub token_words: u32,
    pub per_layer: u32,
    pub row_stride: u32,
    /// Router row of the batch's first token (its layer's first row for a staged batch).
    pub first_row: u32,
    pub _pad: [u32; 3],
}
const _: () = assert!(std::mem::size_of::<ApplyParams>() == 32);

/// Must match `TokenPlan` in `shaders/wgsl/common/append.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct TokenPlan {
    pub key: u32,
    pub rank: u32,
    pub u: u32,
    pub ring_index: u32,
    pub slot: u32,
    pub flags: u32,
    pub page: u32,
    pub _pad: u32,
}
const _: () = assert!(std::mem::size_of::<TokenPlan>() == 32);

/// Must match `GatherParams` in `shaders/wgsl/append/gather_pages.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct GatherParams {
    pub first_layer: u32,
    pub _pad0: u32,
    pub _pad1: u32,
    pub _pad2: u32,
}
const _: () = assert!(std::mem::size_of::<GatherParams>() == 16);

/// Must match `ReleaseParams` in `shaders/wgsl/append/release.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct ReleaseParams {
    pub n_keys: u32,
    pub _pad0: u32,
    pub _pad1: u32,
    pub _pad2: u32,
}
const _: () = assert!(std::mem::size_of::<ReleaseParams>() == 16);

/// Must match `AttendParams` in `shaders/wgsl/attend/common.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct AttendParams {
    pub n_seqs: u32,
    pub layer: u32,
    pub group: u32,
    pub q_heads: u32,
    pub n_chunks: u32,
    pub chunk_pages: u32,
    pub n_buffers: u32,
    pub write_scores: u32,
    pub max_tokens: u32,
    pub step: u32,
    pub scale: f32,
    pub _pad0: u32,
}
const _: () = assert!(std::mem::size_of::<AttendParams>() == 48);

/// Must match `CopyParams` in `shaders/wgsl/bench/copy.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CopyParams {
    pub n_vec4: u32,
    pub stride: u32,
    pub _pad0: u32,
    pub _pad1: u32,
}
const _: () = assert!(std::mem::size_of::<CopyParams>() == 16);

/// Must match `FmaParams` in `shaders/wgsl/bench/fma.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct FmaParams {
    pub iters: u32,
    pub _pad0: u32,
    pub _pad1: u32,
    pub _pad2: u32,
}
const _: () = assert!(std::mem::size_of::<FmaParams>() == 16);

/// `TokenPlan::flags` bits; must match `PLAN_*` in `shaders/wgsl/common/append.wgsl`.
pub mod plan_flags {
    pub const OPENS: u32 = 1;
    pub const NEEDS_FREE: u32 = 2;
    pub const RECYCLES: u32 = 4;
    pub const LAST_IN_KEY: u32 = 8;
    pub const LAST_IN_PAGE: u32 = 16;
    pub const INVALID: u32 = 32;
}

/// `PoolCtl::error_flags` bits; must match `ERR_*` in `shaders/wgsl/common/pool.wgsl`.
pub mod pool_errors {
    pub const POOL_EXHAUSTED: u32 = 1;
    pub const BAD_TOKEN: u32 = 2;
}

/// `PageMeta::owner` of a free page; must match `NO_OWNER` in `shaders/wgsl/common/pool.wgsl`.
pub const NO_OWNER: u32 = u32::MAX;

/// Slot metadata word offsets; must match `META_*` in `shaders/wgsl/common/pool.wgsl`.
pub mod meta {
    pub const POSITION: usize = 0;
    pub const LAST_ACCESS: usize = 1;
    pub const ACCESS_COUNT: usize = 2;
    pub const EXPERTS: usize = 3;
    pub fn gates(top_k: usize) -> usize {
        EXPERTS + top_k
    }
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
    pub const PIKV: u32 = 0;
    pub const EXPERT: u32 = 1;
    pub const TOKEN_BLOCK: u32 = 2;
}

/// Must match `RouteParams` in `shaders/wgsl/common/route.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct RouteParams {
    pub n_tokens: u32,
    pub n_experts: u32,
    pub top_k: u32,
    pub router: u32,
    pub n_groups: u32,
    pub topk_groups: u32,
    pub token_offset: u32,
    pub n_partials: u32,
    pub alpha: f32,
    pub lambda: f32,
    pub beta: f32,
    pub ema: f32,
    pub lr: f32,
    pub kappa: f32,
    pub c_miss: f32,
    pub c_lb: f32,
    pub layer: u32,
    pub token_base: u32,
    pub _pad1: u32,
    pub _pad2: u32,
}
const _: () = assert!(std::mem::size_of::<RouteParams>() == 80);

/// Must match `ExpertStats` in `shaders/wgsl/common/route.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable, serde::Serialize)]
pub struct ExpertStats {
    pub load: f32,
    pub miss: f32,
    pub bias: f32,
    pub grad: f32,
    pub count: u32,
    pub appended: u32,
    pub resident: u32,
    pub _pad: u32,
}
const _: () = assert!(std::mem::size_of::<ExpertStats>() == 32);

/// Must match `RouteSummary` in `shaders/wgsl/common/route.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable, serde::Serialize)]
pub struct RouteSummary {
    pub entropy: f32,
    pub cost: f32,
    pub kl: f32,
    pub expected_cost: f32,
    pub steps: u32,
    pub _pad0: u32,
    pub _pad1: u32,
    pub _pad2: u32,
}
const _: () = assert!(std::mem::size_of::<RouteSummary>() == 32);

/// `RouteParams::router`; must match `ROUTER_*` in `shaders/wgsl/common/route.wgsl`.
pub mod routers {
    pub const HASH: u32 = 0;
    pub const TOPK: u32 = 1;
    pub const LOAD_BALANCE: u32 = 2;
    pub const CACHE_AWARE: u32 = 3;
    pub const ENTROPY: u32 = 4;
    pub const ADAPTIVE: u32 = 5;
    pub const HIERARCHICAL: u32 = 6;
}

/// Must match `EvictParams` in `shaders/wgsl/common/evict.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct EvictParams {
    pub policy: u32,
    pub n_lists: u32,
    pub step: u32,
    pub sinks: u32,
    pub window: u32,
    pub adaptive: u32,
    pub base_budget: u32,
    pub first_layer: u32,
    pub w_recency: f32,
    pub w_freq: f32,
    pub w_attn: f32,
    pub duo_tau: f32,
    pub ada_floor: f32,
    pub threshold: f32,
    pub hit_target: f32,
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
    /// Tokens evicted from the group by the last eviction.
    pub evicted: u32,
}
const _: () = assert!(std::mem::size_of::<GroupState>() == 16);

/// `GroupState::mass` units per unit of mass share.
pub const GROUP_MASS_ONE: f32 = 16_777_216.0;

/// Must match `ListState` in `shaders/wgsl/common/evict.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable, serde::Serialize)]
pub struct ListState {
    pub budget: u32,
    pub tokens: u32,
    pub evicted: u32,
    pub evicted_total: u32,
    pub tau: f32,
    pub hit_rate: f32,
    pub mass: f32,
    pub kind: u32,
}
const _: () = assert!(std::mem::size_of::<ListState>() == 32);

/// `EvictParams::policy`; must match `POLICY_*` in `shaders/wgsl/common/evict.wgsl`.
pub mod policies {
    pub const H2O: u32 = 0;
    pub const STREAMING: u32 = 1;
    pub const LRU: u32 = 2;
    pub const LRU_PLUS: u32 = 3;
    pub const ADAKV: u32 = 4;
    pub const DUO: u32 = 5;
}

/// `ListState::budget` of a list that keeps everything; must match `KEEP_ALL`.
pub const KEEP_ALL: u32 = u32::MAX;
/// Utility key no policy evicts; must match `PROTECTED` in `common/evict.wgsl`.
pub const PROTECTED: u32 = u32::MAX;

/// `ListState::kind` under DuoAttention.
pub mod duo_kinds {
    pub const RETRIEVAL: u32 = 1;
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
    pub layer: u32,
    pub keep_pages: u32,
    pub group: u32,
    pub q_heads: u32,
    pub n_seqs: u32,
    pub scale: f32,
    pub _pad0: u32,
    pub _pad1: u32,
}
const _: () = assert!(std::mem::size_of::<QuestParams>() == 32);
