// model: y[b][o] = sum_i W[o][i] x'[b][i] (or y[b][o] += that, with `accumulate`: a residual
// added in the same pass) for the call's tokens b, W in one of the block formats of
// common/quant.wgsl, dequantised in registers as it is read (no f32 copy of W exists). One
// workgroup per (output row, group of MAX_TOKENS tokens: workgroup z); its invocations take the
// row's weights four at a time in turn (common/quant.wgsl's weights4: neighbouring invocations
// read neighbouring words of W and x), each against every token of the group, then sum over the
// workgroup (a fixed tree, so the result does not depend on timing, nor on how many tokens the
// call has).
//
// What x' is (`input`), so the pass before a product needs no dispatch of its own:
//   0: x as given, [n_tokens][cols];
//   1: RMSNorm of x times the gain g (binding 4): x[b][i] * g[i] / sqrt(mean_i x[b][i]^2 + eps),
//      each workgroup summing its tokens' squares first (the same fixed tree), so the norm
//      before the Q/K/V, the FFN and the LM head is folded into their products;
//   2: SwiGLU of x = [n_tokens][2][cols] (gate then up): silu(gate[i]) * up[i], so the down
//      projection reads the FFN's gate and up products directly.
// Rows go to up to three outputs (stacked matrices, one product: Q, K and V): rows below
// `split1` to y ([n_tokens][split1]), the next `split2` to y2, the rest to y3, each output's
// rows contiguous per token.

//!import common/quant.wgsl
//!import model/products.wgsl
//!define FORMAT 0u
//!define MAX_TOKENS 8u

const WG: u32 = 64u;
var<workgroup> red: array<f32, MAX_TOKENS * WG>;  // [token][WG]
var<workgroup> inv_rms: array<f32, MAX_TOKENS>;

// Sums red[b][..] into red[b][0] for each of the group's `nt` tokens (a fixed tree).
fn reduce_tokens(t: u32, nt: u32) {
    for (var off = WG / 2u; off > 0u; off = off / 2u) {
        if (t < off) {
            for (var b = 0u; b < nt; b++) {
                red[b * WG + t] += red[b * WG + t + off];
            }
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let row = wg.x + wg.y * 65535u;
    // The group's tokens: tb + b for b < nt.
    let tb = wg.z * MAX_TOKENS;
    // Uniform: every invocation of a workgroup has the same row and group.
    if (row >= params.rows || tb >= params.n_tokens) {
        return;
    }
    let nt = min(params.n_tokens - tb, MAX_TOKENS);
    if (params.input == 1u) {
        for (var b = 0u; b < nt; b++) {
            var s = 0.0;
            for (var i = t; i < params.cols; i += WG) {
                let v = x[(tb + b) * params.cols + i];
                s += v * v;
            }
            red[b * WG + t] = s;
        }
        workgroupBarrier();
        reduce_tokens(t, nt);
        if (t < nt) {
            inv_rms[t] = inverseSqrt(red[t * WG] / f32(params.cols) + params.eps);
        }
        workgroupBarrier();
    }
    var acc: array<f32, MAX_TOKENS>;
    for (var b = 0u; b < MAX_TOKENS; b++) {
        acc[b] = 0.0;
    }
    // Invocation t takes quarters t, t + WG, ... of the row (4 consecutive weights each), so
    // neighbours read neighbouring words of W and of x.
    for (var qi = t; qi < params.cols / 4u; qi += WG) {
        let wv = weights4(row, qi / 8u, qi % 8u, params.cols);
        let i0 = 4u * qi;
        var gq = vec4<f32>(1.0);
        if (params.input == 1u) {
            gq = vec4<f32>(g[i0], g[i0 + 1u], g[i0 + 2u], g[i0 + 3u]);
        }
        for (var b = 0u; b < MAX_TOKENS; b++) {
            if (b < nt) {
                // One load per input kind (uniform), each as plain as the product itself.
                var xv: vec4<f32>;
                switch params.input {
                    case 1u: {
                        let x0 = (tb + b) * params.cols + i0;
                        xv = vec4<f32>(x[x0], x[x0 + 1u], x[x0 + 2u], x[x0 + 3u]) * gq * inv_rms[b];
                    }
                    case 2u: {
                        let g0 = 2u * (tb + b) * params.cols + i0;
                        let u0 = g0 + params.cols;
                        let gate = vec4<f32>(x[g0], x[g0 + 1u], x[g0 + 2u], x[g0 + 3u]);
                        let up = vec4<f32>(x[u0], x[u0 + 1u], x[u0 + 2u], x[u0 + 3u]);
                        xv = gate / (1.0 + exp(-gate)) * up;
                    }
                    default: {
                        let x0 = (tb + b) * params.cols + i0;
                        xv = vec4<f32>(x[x0], x[x0 + 1u], x[x0 + 2u], x[x0 + 3u]);
                    }
                }
                acc[b] += dot(wv, xv);
            }
        }
    }
    workgroupBarrier();
    for (var b = 0u; b < nt; b++) {
        red[b * WG + t] = acc[b];
    }
    workgroupBarrier();
    reduce_tokens(t, nt);
    if (t < nt) {
        store_output(tb + t, row, red[t * WG]);
    }
}
