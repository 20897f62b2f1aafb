// route, pass 4 (one workgroup): fold this step's counts into the per-(layer, expert) statistics
// the routers read next step: moving-average load, tokens appended, and the step's routing
// entropy and realised cost. Resets the counts. The miss rate comes from route/miss.wgsl.

//!import common/route.wgsl

@group(0) @binding(0) var<uniform> params: RouteParams;
@group(0) @binding(1) var<storage, read_write> counts: array<u32>;
@group(0) @binding(2) var<storage, read_write> stats: array<ExpertStats>;
@group(0) @binding(3) var<storage, read_write> summary: array<RouteSummary>;

var<workgroup> red_h: array<f32, 256>;
var<workgroup> red_c: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) e: u32) {
    let E = params.n_experts;
    let slots = f32(params.n_tokens * params.top_k);
    var h = 0.0;
    var c = 0.0;
    if (e < E) {
        let i = params.layer * E + e;
        let n = counts[e];
        counts[e] = 0u;
        let share = f32(n) / slots;
        var s = stats[i];
        if (n > 0u) {
            h = -share * log(share);
        }
        c = share * expert_cost(params, s);
        s.load = (1.0 - params.ema) * s.load + params.ema * share;
        s.appended += n;
        stats[i] = s;
    }
    red_h[e] = h;
    red_c[e] = c;
    workgroupBarrier();
    for (var off = 128u; off > 0u; off = off / 2u) {
        if (e < off) {
            red_h[e] += red_h[e + off];
            red_c[e] += red_c[e + off];
        }
        workgroupBarrier();
    }
    if (e == 0u) {
        var m = summary[params.layer];
        m.entropy = red_h[0];
        m.cost = red_c[0];
        m.steps += 1u;
        summary[params.layer] = m;
    }
}
