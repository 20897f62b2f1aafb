// route: the adaptive router learns a per-expert score bias b online, on the GPU. Its cost per
// token is the expected expert cost under q = softmax(logit + b) plus kappa * KL(q || p), p the
// model's own gate softmax(logit); expert cost = c_miss * miss + c_lb * (load * E - 1)
// (common/route.wgsl). Pass "grad": one workgroup per 64 tokens writes its partial gradient
// dJ/db_e = sum_t q_te (cost_e - E_q[cost]) + kappa q_te (log(q_te / p_te) - KL_t); pass
// "update" (one workgroup) sums the partials in order (deterministic) and steps b -= lr * grad.

//!import common/route.wgsl

@group(0) @binding(0) var<uniform> params: RouteParams;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> stats: array<ExpertStats>;
@group(0) @binding(4) var<storage, read_write> partials: array<f32>;  // [n_partials][E + 2]
@group(0) @binding(5) var<storage, read_write> summary: array<RouteSummary>;

const BLOCK: u32 = 64u;
var<workgroup> cost_sh: array<f32, 256>;
var<workgroup> bias_sh: array<f32, 256>;
var<workgroup> lse_p: array<f32, 64>;
var<workgroup> lse_q: array<f32, 64>;
var<workgroup> ec_sh: array<f32, 64>;
var<workgroup> kl_sh: array<f32, 64>;

@compute @workgroup_size(64)
fn grad(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let E = params.n_experts;
    for (var e = li; e < E; e += BLOCK) {
        cost_sh[e] = expert_cost(params, stats[params.layer * E + e]);
        bias_sh[e] = bias[e];
    }
    workgroupBarrier();
    let t0 = wg.x * BLOCK;
    let t = t0 + li;
    var lp = 0.0;
    var lq = 0.0;
    var ec = 0.0;
    var kl = 0.0;
    if (t < params.n_tokens) {
        let row = (params.token_base + t) * E;
        var mp = -3.4e38;
        var mq = -3.4e38;
        for (var e = 0u; e < E; e++) {
            let l = logits[row + e];
            mp = max(mp, l);
            mq = max(mq, l + bias_sh[e]);
        }
        var sp = 0.0;
        var sq = 0.0;
        for (var e = 0u; e < E; e++) {
            let l = logits[row + e];
            sp += exp(l - mp);
            sq += exp(l + bias_sh[e] - mq);
        }
        lp = mp + log(sp);
        lq = mq + log(sq);
        for (var e = 0u; e < E; e++) {
            let q = exp(logits[row + e] + bias_sh[e] - lq);
            ec += q * cost_sh[e];
            kl += q * (bias_sh[e] - lq + lp);
        }
    }
    lse_p[li] = lp;
    lse_q[li] = lq;
    ec_sh[li] = ec;
    kl_sh[li] = kl;
    workgroupBarrier();
    let n = min(BLOCK, params.n_tokens - t0);
    let out = wg.x * (E + 2u);
    for (var e = li; e < E; e += BLOCK) {
        var g = 0.0;
        for (var j = 0u; j < n; j++) {
            let q = exp(logits[(params.token_base + t0 + j) * E + e] + bias_sh[e] - lse_q[j]);
            g += q * (cost_sh[e] - ec_sh[j]) + params.kappa * q * (bias_sh[e] - lse_q[j] + lse_p[j] - kl_sh[j]);
        }
        partials[out + e] = g;
    }
    if (li == 0u) {
        var sec = 0.0;
        var skl = 0.0;
        for (var j = 0u; j < n; j++) {
            sec += ec_sh[j];
            skl += kl_sh[j];
        }
        partials[out + E] = sec;
        partials[out + E + 1u] = skl;
    }
}

@compute @workgroup_size(256)
fn update(@builtin(local_invocation_index) e: u32) {
    let E = params.n_experts;
    let T = f32(params.n_tokens);
    if (e < E) {
        var g = 0.0;
        for (var w = 0u; w < params.n_partials; w++) {
            g += partials[w * (E + 2u) + e];
        }
        g = g / T;
        let i = params.layer * E + e;
        stats[i].grad = g;
        stats[i].bias = stats[i].bias - params.lr * g;
    }
    if (e == 0u) {
        var sec = 0.0;
        var skl = 0.0;
        for (var w = 0u; w < params.n_partials; w++) {
            sec += partials[w * (E + 2u) + E];
            skl += partials[w * (E + 2u) + E + 1u];
        }
        var m = summary[params.layer];
        m.expected_cost = sec / T;
        m.kl = skl / T;
        summary[params.layer] = m;
    }
}
