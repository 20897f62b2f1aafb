// route, pass 1: each router's per-expert score bias from the statistics (one workgroup).
//   topk, hash, hierarchical: 0
//   load balance:  -alpha * (load_e - mean load)
//   cache-aware:   -lambda * log(1 + miss_e)                      (PiKV)
//   entropy:        beta * log(load_e + 1 / (16 E))  (the marginal effect on the routing entropy;
//                   see ARCHITECTURE.md)
//   adaptive:       the learned bias

//!import common/route.wgsl

@group(0) @binding(0) var<uniform> params: RouteParams;
@group(0) @binding(1) var<storage, read> stats: array<ExpertStats>;
@group(0) @binding(2) var<storage, read_write> bias: array<f32>;

var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) e: u32) {
    let E = params.n_experts;
    let base = params.layer * E;
    var load = 0.0;
    if (e < E) {
        load = stats[base + e].load;
    }
    red[e] = load;
    workgroupBarrier();
    for (var off = 128u; off > 0u; off = off / 2u) {
        if (e < off) {
            red[e] = red[e] + red[e + off];
        }
        workgroupBarrier();
    }
    let mean_load = red[0] / f32(E);
    if (e >= E) {
        return;
    }
    var b = 0.0;
    switch params.router {
        case 2u: { b = -params.alpha * (load - mean_load); }
        case 3u: { b = -params.lambda * log(1.0 + stats[base + e].miss); }
        case 4u: { b = params.beta * log(load + 1.0 / (16.0 * f32(E))); }
        case 5u: { b = stats[base + e].bias; }
        default: { b = 0.0; }
    }
    bias[e] = b;
}
