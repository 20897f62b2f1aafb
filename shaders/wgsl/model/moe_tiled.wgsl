// model (a MoE file's own experts, in slots: moe.wgsl's `slotted` layout): the experts of a
// prefill chunk grouped by expert, so each expert's weights are dequantised once per 64 of the
// tokens that chose it (moe.wgsl reads them once per token and choice). A (token b, choice j)
// pair is p = b * top_k + j.
//
//   moe_group: one workgroup. Per expert e, the pairs that chose it: lists[e][..counts[e]]
//     (the order within a list is the atomics'; nothing computed depends on it).
//   moe_gate_up_tiled: one workgroup per (64 neurons, 64 of expert e's pairs, e): the gate and
//     up products of the pairs' tokens with the expert's rows, as matmul.wgsl tiles them (16
//     columns a step through workgroup memory, each invocation 4 x 4 outputs of each, summed
//     over the columns in order), then act[p][s] = silu(gate) * up * wts[p], moe.wgsl's layout.
//   moe_down_tiled: one workgroup per (64 output features, 64 of expert e's pairs, e):
//     out[p][h] = sum_s act[p][s] * Wdown_e[h][s], the same tiling over the expert's neurons.
//   moe_combine: y[b][h] (+)= sum_j out[b * top_k + j][h], j in order.
// Every output is one fixed sum whatever the chunk or the grouping, so a token's experts give
// the same bits in any chunk; moe.wgsl sums trees, so the two agree within f32 rounding.

//!import common/quant.wgsl
//!define FORMAT 0u

// must match `MoeParams` in model/src/gpu_data.rs
struct MoeParams {
    hidden: u32,     // FFN input and output features (a multiple of 32)
    ffn: u32,        // neurons of all slots
    top_k: u32,      // experts chosen per token
    max_size: u32,   // neurons of an expert
    n_tokens: u32,
    n_experts: u32,
    accumulate: u32, // 1: y += the FFN's output, 0: y = it
    slotted: u32,    // 1 here
}

@group(0) @binding(0) var<uniform> params: MoeParams;
@group(0) @binding(1) var<storage, read> w: array<u32>;             // gate/up [2 * ffn][hidden], or down [slots * hidden][max_size], in FORMAT
@group(0) @binding(2) var<storage, read> x: array<f32>;             // [n_tokens][hidden]
@group(0) @binding(3) var<storage, read_write> act: array<f32>;     // [n_tokens * top_k][max_size]
@group(0) @binding(4) var<storage, read> sel: array<u32>;           // [n_tokens * top_k]
@group(0) @binding(5) var<storage, read> offsets: array<u32>;       // [n_experts]: expert e's slot
@group(0) @binding(6) var<storage, read_write> lists: array<u32>;   // [n_experts][n_tokens]
@group(0) @binding(7) var<storage, read_write> y: array<f32>;       // [n_tokens][hidden]
@group(0) @binding(8) var<storage, read> wts: array<f32>;           // [n_tokens * top_k]
@group(0) @binding(9) var<storage, read_write> counts: array<u32>;  // [n_experts]
@group(0) @binding(10) var<storage, read_write> out: array<f32>;    // [n_tokens * top_k][hidden]

fn weight_word(i: u32) -> u32 {
    return w[i];
}

// The experts moe_group can sort (its counters live in workgroup memory).
const MAX_EXPERTS: u32 = 128u;
var<workgroup> cnt: array<atomic<u32>, MAX_EXPERTS>;
// The tiled kernels' expert's pair count, read once and made uniform.
var<workgroup> listed: u32;

// Expert e's pair count, uniform across the workgroup (barriers may follow a return on it).
fn pair_count(e: u32, t: u32) -> u32 {
    if (t == 0u) {
        listed = counts[e];
    }
    return workgroupUniformLoad(&listed);
}

// The tiled kernels' pairs: how many of expert e's, from p0 on, the workgroup takes (at most
// TILE; 0 where the list ends before p0), uniform as pair_count.
fn tile_pairs(e: u32, p0: u32, t: u32) -> u32 {
    let count = pair_count(e, t);
    return select(0u, min(count - p0, TILE), p0 < count);
}

// Whether a slot holds weights: one past the resident ones (an expert cache's; the prefill has
// none) reads nothing.
fn resident_slot(slot: u32) -> bool {
    return slot < params.ffn / params.max_size;
}

@compute @workgroup_size(256)
fn moe_group(@builtin(local_invocation_index) t: u32) {
    // Zeroed here: a trusted pipeline may skip zeroing workgroup memory.
    for (var e = t; e < MAX_EXPERTS; e += 256u) {
        atomicStore(&cnt[e], 0u);
    }
    workgroupBarrier();
    let pairs = params.n_tokens * params.top_k;
    for (var p = t; p < pairs; p += 256u) {
        let e = min(sel[p], params.n_experts - 1u);
        let i = atomicAdd(&cnt[e], 1u);
        if (i < params.n_tokens) {
            lists[e * params.n_tokens + i] = p;
        }
    }
    workgroupBarrier();
    for (var e = t; e < params.n_experts; e += 256u) {
        counts[e] = min(atomicLoad(&cnt[e]), params.n_tokens);
    }
}

const TILE: u32 = 64u;
const QUARTERS: u32 = 4u;
const STRIDE: u32 = 5u;
// Shared by the tiled kernels (15.5 KiB with the counters above: within WebGPU's default 16 KiB).
var<workgroup> wa: array<vec4<f32>, 320>;  // [TILE rows][STRIDE]: gate rows, or down rows
var<workgroup> wb: array<vec4<f32>, 320>;  // [TILE rows][STRIDE]: up rows
var<workgroup> xs: array<vec4<f32>, 320>;  // [TILE pairs][STRIDE]: the pairs' inputs

// Quarter j (< 4) of 16-column step `half` of row `row` of a matrix `cols` wide.
fn step4(row: u32, half: u32, j: u32, cols: u32) -> vec4<f32> {
    return weights4(row, half / 2u, 4u * (half % 2u) + j, cols);
}

@compute @workgroup_size(256)
fn moe_gate_up_tiled(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let s0 = wg.x * TILE;
    let p0 = wg.y * TILE;
    let e = wg.z;
    // Uniform per workgroup.
    if (e >= params.n_experts || s0 >= params.max_size) {
        return;
    }
    let np = tile_pairs(e, p0, t);
    if (np == 0u) {
        return;
    }
    let slot = offsets[e];
    let resident = resident_slot(slot);
    let tx = t % 16u;
    let ty = t / 16u;
    var g: array<f32, 16>; // [pair i][neuron c]
    var u: array<f32, 16>;
    let l = t / QUARTERS;
    let j = t % QUARTERS;
    let row = slot * params.max_size + s0 + l;
    var b = 0u;
    if (l < np) {
        b = lists[e * params.n_tokens + p0 + l] / params.top_k;
    }
    for (var half = 0u; half < params.hidden / 16u; half++) {
        var gv = vec4<f32>(0.0);
        var uv = vec4<f32>(0.0);
        if (resident && s0 + l < params.max_size) {
            gv = step4(row, half, j, params.hidden);
            uv = step4(params.ffn + row, half, j, params.hidden);
        }
        wa[l * STRIDE + j] = gv;
        wb[l * STRIDE + j] = uv;
        var xv = vec4<f32>(0.0);
        if (l < np) {
            let x0 = b * params.hidden + 16u * half + 4u * j;
            xv = vec4<f32>(x[x0], x[x0 + 1u], x[x0 + 2u], x[x0 + 3u]);
        }
        xs[l * STRIDE + j] = xv;
        workgroupBarrier();
        for (var q = 0u; q < QUARTERS; q++) {
            var ga: array<vec4<f32>, 4>;
            var ua: array<vec4<f32>, 4>;
            //!unroll
            for (var c = 0u; c < 4u; c++) {
                ga[c] = wa[(tx + 16u * c) * STRIDE + q];
                ua[c] = wb[(tx + 16u * c) * STRIDE + q];
            }
            //!unroll
            for (var i = 0u; i < 4u; i++) {
                let xq = xs[(ty + 16u * i) * STRIDE + q];
                //!unroll
                for (var c = 0u; c < 4u; c++) {
                    g[4u * i + c] += dot(xq, ga[c]);
                    u[4u * i + c] += dot(xq, ua[c]);
                }
            }
        }
        workgroupBarrier();
    }
    //!unroll
    for (var i = 0u; i < 4u; i++) {
        let lp = ty + 16u * i;
        if (lp < np) {
            let p = lists[e * params.n_tokens + p0 + lp];
            //!unroll
            for (var c = 0u; c < 4u; c++) {
                let s = s0 + tx + 16u * c;
                if (s < params.max_size) {
                    let gate = g[4u * i + c];
                    act[p * params.max_size + s] = select(0.0, gate / (1.0 + exp(-gate)) * u[4u * i + c] * wts[p], resident);
                }
            }
        }
    }
}

@compute @workgroup_size(256)
fn moe_down_tiled(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let h0 = wg.x * TILE;
    let p0 = wg.y * TILE;
    let e = wg.z;
    // Uniform per workgroup.
    if (e >= params.n_experts || h0 >= params.hidden) {
        return;
    }
    let np = tile_pairs(e, p0, t);
    if (np == 0u) {
        return;
    }
    let slot = offsets[e];
    let resident = resident_slot(slot);
    let tx = t % 16u;
    let ty = t / 16u;
    var acc: array<f32, 16>; // [pair i][feature c]
    let l = t / QUARTERS;
    let j = t % QUARTERS;
    var a0 = 0u;
    if (l < np) {
        a0 = lists[e * params.n_tokens + p0 + l] * params.max_size;
    }
    for (var half = 0u; half < params.max_size / 16u; half++) {
        var wv = vec4<f32>(0.0);
        if (resident && h0 + l < params.hidden) {
            wv = step4(slot * params.hidden + h0 + l, half, j, params.max_size);
        }
        wa[l * STRIDE + j] = wv;
        var av = vec4<f32>(0.0);
        if (l < np) {
            let i0 = a0 + 16u * half + 4u * j;
            av = vec4<f32>(act[i0], act[i0 + 1u], act[i0 + 2u], act[i0 + 3u]);
        }
        xs[l * STRIDE + j] = av;
        workgroupBarrier();
        for (var q = 0u; q < QUARTERS; q++) {
            var wq: array<vec4<f32>, 4>;
            //!unroll
            for (var c = 0u; c < 4u; c++) {
                wq[c] = wa[(tx + 16u * c) * STRIDE + q];
            }
            //!unroll
            for (var i = 0u; i < 4u; i++) {
                let aq = xs[(ty + 16u * i) * STRIDE + q];
                //!unroll
                for (var c = 0u; c < 4u; c++) {
                    acc[4u * i + c] += dot(aq, wq[c]);
                }
            }
        }
        workgroupBarrier();
    }
    //!unroll
    for (var i = 0u; i < 4u; i++) {
        let lp = ty + 16u * i;
        if (lp < np) {
            let p = lists[e * params.n_tokens + p0 + lp];
            //!unroll
            for (var c = 0u; c < 4u; c++) {
                let h = h0 + tx + 16u * c;
                if (h < params.hidden) {
                    out[p * params.hidden + h] = acc[4u * i + c];
                }
            }
        }
    }
}

@compute @workgroup_size(64)
fn moe_combine(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x + gid.y * 65535u * 64u;
    if (i >= params.n_tokens * params.hidden) {
        return;
    }
    let b = i / params.hidden;
    let h = i % params.hidden;
    var sum = 0.0;
    for (var j = 0u; j < params.top_k; j++) {
        sum += out[(b * params.top_k + j) * params.hidden + h];
    }
    y[i] = select(sum, y[i] + sum, params.accumulate != 0u);
}
