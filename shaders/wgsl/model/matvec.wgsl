// model: y[b][o] = sum_i W[o][i] x[b][i] (or y[b][o] += that, with `accumulate`: a residual
// added in the same pass) for the step's tokens b, W in one of the block formats of
// common/quant.wgsl, dequantised in registers as it is read (no f32 copy of W exists). One
// workgroup per output row; its invocations take the row's blocks in turn, each against every
// token, then sum over the workgroup (a fixed tree, so the result does not depend on timing).

//!import common/quant.wgsl
//!define FORMAT 0u
//!define MAX_TOKENS 8u

// must match `MatVecParams` in model/src/gpu_data.rs
struct MatVecParams {
    rows: u32,       // output features
    cols: u32,       // input features (a multiple of the format's block: 32, or 256)
    n_tokens: u32,   // tokens b (at most MAX_TOKENS)
    accumulate: u32, // 1: y += W x, 0: y = W x
}

@group(0) @binding(0) var<uniform> params: MatVecParams;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;       // [n_tokens][cols]
@group(0) @binding(3) var<storage, read_write> y: array<f32>; // [n_tokens][rows]

fn weight_word(i: u32) -> u32 {
    return w[i];
}

const WG: u32 = 64u;
var<workgroup> red: array<f32, MAX_TOKENS * WG>;  // [token][WG]

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let row = wg.x + wg.y * 65535u;
    // Uniform: every invocation of a workgroup has the same row.
    if (row >= params.rows) {
        return;
    }
    let nb = params.cols / 32u;
    var acc: array<f32, MAX_TOKENS>;
    for (var b = 0u; b < MAX_TOKENS; b++) {
        acc[b] = 0.0;
    }
    for (var blk = t; blk < nb; blk += WG) {
        let wv = weights32(row, blk, params.cols);
        for (var b = 0u; b < MAX_TOKENS; b++) {
            if (b < params.n_tokens) {
                let x0 = b * params.cols + blk * 32u;
                var s = 0.0;
                for (var k = 0u; k < 32u; k++) {
                    s += wv[k] * x[x0 + k];
                }
                acc[b] += s;
            }
        }
    }
    for (var b = 0u; b < MAX_TOKENS; b++) {
        red[b * WG + t] = acc[b];
    }
    workgroupBarrier();
    for (var off = WG / 2u; off > 0u; off = off / 2u) {
        if (t < off) {
            for (var b = 0u; b < MAX_TOKENS; b++) {
                red[b * WG + t] += red[b * WG + t + off];
            }
        }
        workgroupBarrier();
    }
    if (t < params.n_tokens) {
        let o = t * params.rows + row;
        if (params.accumulate != 0u) {
            y[o] += red[t * WG];
        } else {
            y[o] = red[t * WG];
        }
    }
}
