// Shared by the routing kernels. Scores are the model's router logits plus a per-expert bias
// that each router derives from GPU-resident statistics; selection ranks by score (ties: lowest
// expert index), gates are the model's softmax renormalised over the chosen experts.

// must match `RouteParams` in core/src/gpu_data.rs
struct RouteParams {
    n_tokens: u32,
    n_experts: u32,
    top_k: u32,
    router: u32,         // ROUTER_*
    n_groups: u32,       // hierarchical: expert groups (n_experts / n_groups experts each)
    topk_groups: u32,    // hierarchical: groups kept
    token_offset: u32,   // hash router: id of token 0 (tokens are numbered consecutively)
    n_partials: u32,     // adaptive: workgroups of the gradient pass
    alpha: f32,          // load balance strength
    lambda: f32,         // cache-aware strength
    beta: f32,           // entropy strength (> 0 favours popular experts: lower routing entropy)
    ema: f32,            // weight of the newest step in the moving averages
    lr: f32,             // adaptive: learning rate of the bias
    kappa: f32,          // adaptive: weight of KL(router || model gate)
    c_miss: f32,         // adaptive: cost of routing to an expert with missing KV
    c_lb: f32,           // adaptive: cost of overload
    layer: u32,          // statistics are kept per (layer, expert)
    token_base: u32,     // row of token 0 in the logits / experts / gates buffers (layer * max_tokens)
    _pad1: u32,
    _pad2: u32,
}

// must match `ExpertStats` in core/src/gpu_data.rs
struct ExpertStats {
    load: f32,       // moving average of the share of routing slots the expert receives
    miss: f32,       // share of the expert's appended tokens no longer in the KV cache
    bias: f32,       // adaptive router: learned score bias
    grad: f32,       // adaptive router: last gradient of its cost
    count: u32,      // routing slots this step (reset by the stats pass)
    appended: u32,   // tokens routed to the expert since the start (all k choices)
    resident: u32,   // of those, K/V vectors (one per token and KV head) still cached (recounted by route/miss)
    _pad: u32,
}

// must match `RouteSummary` in core/src/gpu_data.rs
struct RouteSummary {
    entropy: f32,        // entropy (nats) of this step's routing-slot distribution over experts
    cost: f32,           // realised cost: mean over routing slots of the chosen expert's cost
    kl: f32,             // adaptive: mean KL(softmax(logit + bias) || softmax(logit)) over tokens
    expected_cost: f32,  // adaptive: mean expected cost under softmax(logit + bias)
    steps: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

const ROUTER_HASH: u32 = 0u;
const ROUTER_TOPK: u32 = 1u;
const ROUTER_LOAD_BALANCE: u32 = 2u;
const ROUTER_CACHE_AWARE: u32 = 3u;
const ROUTER_ENTROPY: u32 = 4u;
const ROUTER_ADAPTIVE: u32 = 5u;
const ROUTER_HIERARCHICAL: u32 = 6u;

const MAX_K: u32 = 8u;
const MAX_EXPERTS: u32 = 256u;

// Per-expert cost the adaptive router learns to avoid: missing KV, and load above uniform.
fn expert_cost(p: RouteParams, s: ExpertStats) -> f32 {
    return p.c_miss * s.miss + p.c_lb * (s.load * f32(p.n_experts) - 1.0);
}
