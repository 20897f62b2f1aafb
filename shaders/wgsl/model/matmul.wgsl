// model: model/matvec.wgsl's product for a prefill chunk's tokens, tiled: y[b][o] = sum_i W[o][i]
// x'[b][i] (or y += that), with matvec's parameters, bindings, inputs (x, RMSNorm of x times g,
// SwiGLU of x) and up to three outputs. One workgroup per tile of TILE output rows x TILE tokens
// (rows: workgroups x and y, tokens: z). It walks the columns 16 at a time (half a block): the
// tile's 16 columns of W dequantised once into workgroup memory (common/quant.wgsl's weights4;
// each weight then serves TILE tokens, where matvec re-reads it for every MAX_TOKENS tokens),
// the tokens' 16 inputs beside them (10 KiB together: WebGPU's 16 KiB of workgroup memory
// holds them), and each invocation accumulates a 4 x 4 block of outputs
// (tokens ty + 16 i, rows tx + 16 j). Each output is summed over the columns in order: a fixed
// order, whatever the tile, the call's tokens or timing, so a prompt's products are the same in
// any chunking. matvec sums a tree instead: the two agree within f32 rounding.

//!import common/quant.wgsl
//!import model/products.wgsl
//!define FORMAT 0u

const TILE: u32 = 64u;
// A step's quarters (4 weights each: half a block), and the stride of a tile line in workgroup
// memory (one vec4 of padding, so the 16 lines an invocation group reads at once are spread).
const QUARTERS: u32 = 4u;
const STRIDE: u32 = 5u;
var<workgroup> ws: array<vec4<f32>, 320>;  // [TILE rows][STRIDE]: the step's weights
var<workgroup> xs: array<vec4<f32>, 320>;  // [TILE tokens][STRIDE]: the step's inputs
var<workgroup> part: array<f32, 256>;      // input 1: partial sums of squares, [TILE][4]
var<workgroup> inv_rms: array<f32, TILE>;

// Inputs i0 .. i0 + 3 of token `b` (`lb` within the tile), as the call's input kind makes them.
fn inputs4(b: u32, lb: u32, i0: u32) -> vec4<f32> {
    switch params.input {
        case 1u: {
            let x0 = b * params.cols + i0;
            let gq = vec4<f32>(g[i0], g[i0 + 1u], g[i0 + 2u], g[i0 + 3u]);
            return vec4<f32>(x[x0], x[x0 + 1u], x[x0 + 2u], x[x0 + 3u]) * gq * inv_rms[lb];
        }
        case 2u: {
            let g0 = 2u * b * params.cols + i0;
            let u0 = g0 + params.cols;
            let gate = vec4<f32>(x[g0], x[g0 + 1u], x[g0 + 2u], x[g0 + 3u]);
            let up = vec4<f32>(x[u0], x[u0 + 1u], x[u0 + 2u], x[u0 + 3u]);
            return gate / (1.0 + exp(-gate)) * up;
        }
        default: {
            let x0 = b * params.cols + i0;
            return vec4<f32>(x[x0], x[x0 + 1u], x[x0 + 2u], x[x0 + 3u]);
        }
    }
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let row0 = (wg.x + wg.y * 65535u) * TILE;
    let tok0 = wg.z * TILE;
    // Uniform: every invocation of a workgroup has the same tile.
    if (row0 >= params.rows || tok0 >= params.n_tokens) {
        return;
    }
    let nt = min(params.n_tokens - tok0, TILE);
    if (params.input == 1u) {
        // Four invocations a token, each every fourth input, then a fixed pairwise sum.
        let lb = t / 4u;
        var s = 0.0;
        if (lb < nt) {
            for (var i = t % 4u; i < params.cols; i += 4u) {
                let v = x[(tok0 + lb) * params.cols + i];
                s += v * v;
            }
        }
        part[t] = s;
        workgroupBarrier();
        if (t < TILE) {
            let s4 = (part[4u * t] + part[4u * t + 1u]) + (part[4u * t + 2u] + part[4u * t + 3u]);
            inv_rms[t] = inverseSqrt(s4 / f32(params.cols) + params.eps);
        }
        workgroupBarrier();
    }
    let tx = t % 16u;
    let ty = t / 16u;
    var acc: array<f32, 16>; // [token i][row c]
    for (var half = 0u; half < params.cols / 16u; half++) {
        // The tile's 256 quarters of W and of x, one of each per invocation: neighbours take
        // neighbouring quarters of a line (quarter j of the step is quarter 4 (half % 2) + j of
        // block half / 2).
        let l = t / QUARTERS;
        let j = t % QUARTERS;
        var wv = vec4<f32>(0.0);
        if (row0 + l < params.rows) {
            wv = weights4(row0 + l, half / 2u, 4u * (half % 2u) + j, params.cols);
        }
        ws[l * STRIDE + j] = wv;
        var xv = vec4<f32>(0.0);
        if (l < nt) {
            xv = inputs4(tok0 + l, l, 16u * half + 4u * j);
        }
        xs[l * STRIDE + j] = xv;
        workgroupBarrier();
        for (var j = 0u; j < QUARTERS; j++) {
            var wq: array<vec4<f32>, 4>;
            //!unroll
            for (var c = 0u; c < 4u; c++) {
                wq[c] = ws[(tx + 16u * c) * STRIDE + j];
            }
            //!unroll
            for (var i = 0u; i < 4u; i++) {
                let xv = xs[(ty + 16u * i) * STRIDE + j];
                //!unroll
                for (var c = 0u; c < 4u; c++) {
                    acc[4u * i + c] += dot(xv, wq[c]);
                }
            }
        }
        workgroupBarrier();
    }
    //!unroll
    for (var i = 0u; i < 4u; i++) {
        let lb = ty + 16u * i;
        //!unroll
        for (var c = 0u; c < 4u; c++) {
            let row = row0 + tx + 16u * c;
            if (lb < nt && row < params.rows) {
                store_output(tok0 + lb, row, acc[4u * i + c]);
            }
        }
    }
}
