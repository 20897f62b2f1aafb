// model (MoEfied FFN): only the chosen experts' neurons are read. At load the FFN was permuted so
// every expert's neurons are contiguous: `w` holds the gate rows of all `ffn` neurons in expert
// order, then their up rows in the same order (whole rows of ggml blocks, copied, not
// requantised), and `down_t` holds Wdown transposed, `[ffn][hidden]` f32, in the same order.
// Expert e owns permuted neurons offsets[e] .. offsets[e + 1]. A MoE file's own experts
// (`slotted`) are all max_size neurons and sit in slots of the gate/up and down buffers (every
// expert resident, slot e, or an expert cache's slots): `offsets[e]` is expert e's slot.
//
//   moe_gate_up: one workgroup per (4 slots s < max_size, choice j < top_k, token b), 16
//     invocations per slot: the gate and up products of neuron offsets[e] + s (e = sel[b][j])
//     with x[b], then
//     act[b][j][s] = silu(gate) * up * wts[b][j]; slots past the expert's size get 0. The weights
//     are 1 for MoEfied experts and the router's softmax for a MoE file's own (model/router.wgsl
//     moe_weights).
//   moe_down (MoEfied experts): one workgroup per (32 output features, token b), 8 slices of the chosen neurons:
//     y[b][h] (+)= sum_j sum_{s < size(e_j)} act[b][j][s] * down_t[offsets[e_j] + s][h]
//     in a fixed order (each slice its neurons s = slice, slice + 8, ..., j then s; then the
//     slices in order), so results do not depend on timing; added to y (the residual stream)
//     when `accumulate` is set, else written.
//   moe_down_q (a MoE file's own experts): the same sum from Wdown as the file stores it (below).

//!import common/quant.wgsl
//!import common/reduce.wgsl
//!define FORMAT 0u

// must match `MoeParams` in model/src/gpu_data.rs
struct MoeParams {
    hidden: u32,     // FFN input and output features (a multiple of 32)
    ffn: u32,        // neurons
    top_k: u32,      // experts chosen per token
    max_size: u32,   // neurons of the largest expert
    n_tokens: u32,
    n_experts: u32,
    accumulate: u32, // 1: y += the FFN's output, 0: y = it
    slotted: u32,    // 1: `offsets` is a slot per expert (a MoE file's experts, see below)
}

@group(0) @binding(0) var<uniform> params: MoeParams;
@group(0) @binding(1) var<storage, read> w: array<u32>;             // [2 * ffn][hidden] in FORMAT
@group(0) @binding(2) var<storage, read> x: array<f32>;             // [n_tokens][hidden]
@group(0) @binding(3) var<storage, read_write> act: array<f32>;     // [n_tokens][top_k][max_size]
@group(0) @binding(4) var<storage, read> sel: array<u32>;           // [n_tokens][top_k]
@group(0) @binding(5) var<storage, read> offsets: array<u32>;       // [n_experts + 1], or slots [n_experts]
@group(0) @binding(6) var<storage, read> down_t: array<f32>;        // [ffn][hidden]
@group(0) @binding(7) var<storage, read_write> y: array<f32>;       // [n_tokens][hidden]
@group(0) @binding(8) var<storage, read> wts: array<f32>;           // [n_tokens][top_k]

fn weight_word(i: u32) -> u32 {
    return w[i];
}

const WG: u32 = 64u;
var<workgroup> red_g: array<f32, WG>;
var<workgroup> red_up: array<f32, WG>;

// moe_gate_up's workgroup: NPW neurons, TPN invocations each (striding over the 32-weight blocks).
const NPW: u32 = 4u;
const TPN: u32 = WG / NPW;

@compute @workgroup_size(64)
fn moe_gate_up(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let r = t / TPN;
    let i = t % TPN;
    let s = wg.x * NPW + r;
    let j = wg.y;
    let b = wg.z;
    // Uniform per workgroup.
    if (j >= params.top_k || b >= params.n_tokens) {
        return;
    }
    let e = min(sel[b * params.top_k + j], params.n_experts - 1u);
    var first = offsets[e];
    var size = 0u;
    if (params.slotted != 0u) {
        // Expert e in slot offsets[e] (every expert max_size neurons); a slot past the
        // resident ones (the host fetches every chosen expert first) reads nothing.
        size = select(0u, params.max_size, first < params.ffn / params.max_size);
        first = first * params.max_size;
    } else {
        size = offsets[e + 1u] - first;
    }
    let live = s < size;
    var g = 0.0;
    var u = 0.0;
    if (live) {
        // The slot's invocations take quarters i, i + TPN, ... of its gate and up rows (4
        // consecutive weights each: neighbours read neighbouring words of W and x).
        let row = first + s;
        for (var qi = i; qi < params.hidden / 4u; qi += TPN) {
            let x0 = b * params.hidden + 4u * qi;
            let xv = vec4<f32>(x[x0], x[x0 + 1u], x[x0 + 2u], x[x0 + 3u]);
            g += dot(weights4(row, qi / 8u, qi % 8u, params.hidden), xv);
            u += dot(weights4(params.ffn + row, qi / 8u, qi % 8u, params.hidden), xv);
        }
    }
    red_g[t] = g;
    red_up[t] = u;
    workgroupBarrier();
    for (var off = TPN / 2u; off > 0u; off = off / 2u) {
        if (i < off) {
            red_g[t] += red_g[t + off];
            red_up[t] += red_up[t + off];
        }
        workgroupBarrier();
    }
    if (i == 0u && s < params.max_size) {
        let out = (b * params.top_k + j) * params.max_size + s;
        let gate = red_g[t];
        // Slots past the expert's size get 0.
        act[out] = select(0.0, gate / (1.0 + exp(-gate)) * red_up[t] * wts[b * params.top_k + j], live);
    }
}

// moe_down's workgroup: DOWN_H consecutive output features (one warp's coalesced row segment)
// by DOWN_S slices of the chosen neurons, summed in workgroup memory.
const DOWN_H: u32 = 32u;
const DOWN_S: u32 = 8u;
var<workgroup> red_d: array<f32, 256>;

@compute @workgroup_size(256)
fn moe_down(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let hl = t % DOWN_H;
    let slice = t / DOWN_H;
    let h = wg.x * DOWN_H + hl;
    let b = wg.y;
    // Uniform per workgroup.
    if (b >= params.n_tokens) {
        return;
    }
    var acc = 0.0;
    if (h < params.hidden) {
        for (var j = 0u; j < params.top_k; j++) {
            let e = min(sel[b * params.top_k + j], params.n_experts - 1u);
            let first = offsets[e];
            let size = offsets[e + 1u] - first;
            let a0 = (b * params.top_k + j) * params.max_size;
            for (var s = slice; s < size; s += DOWN_S) {
                acc += act[a0 + s] * down_t[(first + s) * params.hidden + h];
            }
        }
    }
    red_d[t] = acc;
    workgroupBarrier();
    if (slice == 0u && h < params.hidden) {
        var sum = 0.0;
        for (var i = 0u; i < DOWN_S; i++) {
            sum += red_d[i * DOWN_H + hl];
        }
        let o = b * params.hidden + h;
        y[o] = select(sum, y[o] + sum, params.accumulate != 0u);
    }
}

// moe_down_q (a MoE file's own experts, `slotted`): Wdown kept as the file stores it, `w` bound
// to `ffn_down_exps` or its expert slots ([slots * hidden][max_size] in FORMAT: the output feature
// h of the expert in slot k is row k * hidden + h over its neurons). One workgroup per (output feature h, token b):
//   y[b][h] (+)= sum_j sum_s act[b][j][s] * Wdown_{e_j}[h][s]
// the invocations taking quarters of each chosen expert's row in turn, j then quarters, then
// the fixed tree; no f32 copy of Wdown exists.
@compute @workgroup_size(64)
fn moe_down_q(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let h = wg.x;
    let b = wg.y;
    // Uniform per workgroup.
    if (h >= params.hidden || b >= params.n_tokens) {
        return;
    }
    // Every expert has max_size neurons; expert e sits in slot offsets[e] of ffn / max_size.
    let f = params.max_size;
    var acc = 0.0;
    for (var j = 0u; j < params.top_k; j++) {
        let e = min(sel[b * params.top_k + j], params.n_experts - 1u);
        let slot = offsets[e];
        let row = slot * params.hidden + h;
        let a0 = (b * params.top_k + j) * params.max_size;
        let quarters = select(0u, f / 4u, slot < params.ffn / f);
        for (var qi = t; qi < quarters; qi += WG) {
            let a = a0 + 4u * qi;
            acc += dot(weights4(row, qi / 8u, qi % 8u, f), vec4<f32>(act[a], act[a + 1u], act[a + 2u], act[a + 3u]));
        }
    }
    let total = workgroup_sum(t, acc);
    if (t == 0u) {
        let o = b * params.hidden + h;
        y[o] = select(total, y[o] + total, params.accumulate != 0u);
    }
}
