// model (MoEfied FFN): only the chosen experts' neurons are read. At load the FFN was permuted so
// every expert's neurons are contiguous: `w` holds the gate rows of all `ffn` neurons in expert
// order, then their up rows in the same order (whole rows of ggml blocks, copied, not
// requantised), and `down_t` holds Wdown transposed, `[ffn][hidden]` f32, in the same order.
// Expert e owns permuted neurons offsets[e] .. offsets[e + 1].
//
//   moe_gate_up: one workgroup per (4 slots s < max_size, choice j < top_k, token b), 16
//     invocations per slot: the gate and up products of neuron offsets[e] + s (e = sel[b][j])
//     with x[b], then
//     act[b][j][s] = silu(gate) * up * wts[b][j]; slots past the expert's size get 0. The weights
//     are 1 for MoEfied experts and the router's softmax for a MoE file's own (model/router.wgsl
//     moe_weights).
//   moe_down: one workgroup per (32 output features, token b), 8 slices of the chosen neurons:
//     y[b][h] (+)= sum_j sum_{s < size(e_j)} act[b][j][s] * down_t[offsets[e_j] + s][h]
//     in a fixed order (each slice its neurons s = slice, slice + 8, ..., j then s; then the
//     slices in order), so results do not depend on timing; added to y (the residual stream)
//     when `accumulate` is set, else written.

//!import common/quant.wgsl
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
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: MoeParams;
@group(0) @binding(1) var<storage, read> w: array<u32>;             // [2 * ffn][hidden] in FORMAT
@group(0) @binding(2) var<storage, read> x: array<f32>;             // [n_tokens][hidden]
@group(0) @binding(3) var<storage, read_write> act: array<f32>;     // [n_tokens][top_k][max_size]
@group(0) @binding(4) var<storage, read> sel: array<u32>;           // [n_tokens][top_k]
@group(0) @binding(5) var<storage, read> offsets: array<u32>;       // [n_experts + 1]
@group(0) @binding(6) var<storage, read> down_t: array<f32>;        // [ffn][hidden]
@group(0) @binding(7) var<storage, read_write> y: array<f32>;       // [n_tokens][hidden]
@group(0) @binding(8) var<storage, read> wts: array<f32>;           // [n_tokens][top_k]

fn weight_word(i: u32) -> u32 {
    return w[i];
}

const WG: u32 = 64u;
var<workgroup> red_g: array<f32, WG>;
var<workgroup> red_u: array<f32, WG>;

// Block `blk` of permuted row `row` of `w` against x[b][blk * 32 ..].
fn block_dot(row: u32, blk: u32, b: u32) -> f32 {
    let nb = params.hidden / 32u;
    let base = (row * nb + blk) * block_words(FORMAT);  // the 32-weight formats (0..2)
    let x0 = b * params.hidden + blk * 32u;
    var s = 0.0;
    switch FORMAT {
        case 1u: {
            let d = unpack2x16float(w[base]).x;
            for (var k = 0u; k < 8u; k++) {
                let word = w[base + 1u + k];
                for (var j = 0u; j < 4u; j++) {
                    let q = i32(byte_at(word, j) << 24u) >> 24u;
                    s += d * f32(q) * x[x0 + 4u * k + j];
                }
            }
        }
        case 2u: {
            let dm = unpack2x16float(w[base]);
            for (var k = 0u; k < 4u; k++) {
                let word = w[base + 1u + k];
                for (var j = 0u; j < 4u; j++) {
                    let q = byte_at(word, j);
                    s += (dm.x * f32(q & 15u) + dm.y) * x[x0 + 4u * k + j];
                    s += (dm.x * f32(q >> 4u) + dm.y) * x[x0 + 16u + 4u * k + j];
                }
            }
        }
        case 0u: {
            for (var k = 0u; k < 32u; k++) {
                s += bitcast<f32>(w[base + k]) * x[x0 + k];
            }
        }
        default: {
            let wv = weights32(row, blk, params.hidden);
            for (var k = 0u; k < 32u; k++) {
                s += wv[k] * x[x0 + k];
            }
        }
    }
    return s;
}

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
    let first = offsets[e];
    let size = offsets[e + 1u] - first;
    let live = s < size;
    let nb = params.hidden / 32u;
    var g = 0.0;
    var u = 0.0;
    if (live) {
        let row = first + s;
        for (var blk = i; blk < nb; blk += TPN) {
            g += block_dot(row, blk, b);
            u += block_dot(params.ffn + row, blk, b);
        }
    }
    red_g[t] = g;
    red_u[t] = u;
    workgroupBarrier();
    for (var off = TPN / 2u; off > 0u; off = off / 2u) {
        if (i < off) {
            red_g[t] += red_g[t + off];
            red_u[t] += red_u[t + off];
        }
        workgroupBarrier();
    }
    if (i == 0u && s < params.max_size) {
        let out = (b * params.top_k + j) * params.max_size + s;
        let gate = red_g[t];
        // Slots past the expert's size get 0.
        act[out] = select(0.0, gate / (1.0 + exp(-gate)) * red_u[t] * wts[b * params.top_k + j], live);
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
