// Shared by the eviction kernels (scheduling). A scheduler scores every cached slot with a
// utility; a shared selection enforces each page list's budget by evicting the lowest-utility
// slots (exactly, ties to the older list order); compaction fills the holes with the ring's
// newest survivors and frees emptied pages.

// must match `EvictParams` in core/src/gpu_data.rs
struct EvictParams {
    policy: u32,        // POLICY_*
    n_lists: u32,       // page lists (layer, seq, KV head)
    step: u32,
    sinks: u32,         // StreamingLLM / Duo / protected: first positions always kept
    window: u32,        // recent positions always kept (and Duo's streaming window)
    adaptive: u32,      // 1: per-list utility threshold adapts to the hit rate
    base_budget: u32,   // tokens per list before AdaKV / Duo redistribute
    first_layer: u32,
    w_recency: f32,     // LRU+ weights
    w_freq: f32,
    w_attn: f32,
    duo_tau: f32,       // Duo: share of attention on sinks + window that makes a head streaming
    ada_floor: f32,     // AdaKV: share of the base budget every head keeps
    threshold: f32,     // fixed utility threshold, relative to the list's mean utility (0: off)
    hit_target: f32,    // adaptive threshold: hit rate to hold
    tau_step: f32,      // adaptive threshold: step of tau per unit hit-rate error
    n_groups: u32,      // EKVA: expert groups per list (0: allocator off)
    ekva_floor: f32,    // EKVA: share of a list's budget spread evenly over its groups
    ekva_alpha: f32,    // EKVA: weight of routing frequency in importance (rest: attention mass)
    ekva_decay: f32,    // EKVA: weight of the previous importance in its moving average
}

// must match `GroupState` in core/src/gpu_data.rs: one expert group of one page list (EKVA)
struct GroupState {
    tokens: u32,   // tokens of the group before eviction
    mass: u32,     // the group's share of the list's attention mass, units of 2^-24
    budget: u32,   // tokens the group may keep (KEEP_ALL: the list keeps everything)
    evicted: u32,  // tokens the last eviction took down to the group's own budget
}

const GROUP_MASS_ONE: f32 = 16777216.0;

// EKVA: the group of a cached slot, its top-1 expert at that layer (ids past the last group
// fold into it).
fn expert_group(expert: u32, n_groups: u32) -> u32 {
    return min(expert, n_groups - 1u);
}

// must match `ListState` in core/src/gpu_data.rs
struct ListState {
    budget: u32,         // tokens the list may keep
    tokens: u32,         // tokens before this eviction
    evicted: u32,        // tokens evicted by this eviction
    evicted_total: u32,  // since the start
    tau: f32,            // utility threshold (relative to mean utility)
    hit_rate: f32,       // share of attention mass kept by the last eviction
    mass: f32,           // attention mass of the list's tokens before eviction
    kind: u32,           // Duo: 1 retrieval head, 2 streaming head
}

const POLICY_H2O: u32 = 0u;
const POLICY_STREAMING: u32 = 1u;
const POLICY_LRU: u32 = 2u;
const POLICY_LRU_PLUS: u32 = 3u;
const POLICY_ADAKV: u32 = 4u;
const POLICY_DUO: u32 = 5u;

const KEEP_ALL: u32 = 0xffffffffu;

// Map f32 to u32 so that unsigned order is float order.
fn orderable(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x80000000u) != 0u) {
        return ~b;
    }
    return b | 0x80000000u;
}

const PROTECTED: u32 = 0xffffffffu;  // utility key of a slot no policy may evict
