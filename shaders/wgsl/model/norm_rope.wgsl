// model: the per-token elementwise passes of a Llama block.
//   rmsnorm: y[b][i] = x[b][i] / sqrt(mean_i x[b][i]^2 + eps) x g[i]; one workgroup per token
//   rope_qk: rotates pairs of every head of every token of the queries and the keys by position
//            x base^(-2i / head_dim): adjacent pairs (x[2i], x[2i+1]) (llama.cpp's "normal"
//            rotation, which GGUF's Llama weights are permuted for) or, with mode 1, pairs half
//            a head apart (x[i], x[i + head_dim/2]: NeoX, Qwen's); one invocation per (token,
//            head, pair), in place, the queries' pairs then the keys'
//   swiglu_gated: y[b] = silu(g) x u x sigmoid(s[b]) (g and u side by side: [b][2][n]), s
//            (aux) one gate logit per token: a shared expert's activations scaled by its gate
//            (qwen2moe)
//   embed:   y[b] = row `tokens[b]` of a block-format matrix, dequantised
//   residual: y += x elementwise

//!import common/quant.wgsl
//!define FORMAT 0u

// must match `ModelOpParams` in model/src/gpu_data.rs
struct ModelOpParams {
    n_tokens: u32,
    dim: u32,        // rmsnorm/embed: features per token; swiglu(_gated): n; rope: head_dim
    n_heads: u32,    // rope: heads of dst
    mode: u32,       // rope: 0 adjacent pairs, 1 NeoX (half a head apart)
    eps: f32,        // rmsnorm
    base: f32,       // rope: frequency base
    n_heads2: u32,   // rope_qk: heads of dst2
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: ModelOpParams;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
@group(0) @binding(3) var<storage, read> aux: array<u32>;  // rmsnorm: g (f32 bits); rope: positions; embed: matrix; swiglu_gated: gate logits (f32 bits)
@group(0) @binding(4) var<storage, read> tokens: array<u32>; // embed
@group(0) @binding(5) var<storage, read_write> dst2: array<f32>; // rope_qk: the keys

fn weight_word(i: u32) -> u32 {
    return aux[i];
}

const WG: u32 = 256u;
var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn rmsnorm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let b = wg.x;
    if (b >= params.n_tokens) {
        return;
    }
    let n = params.dim;
    var s = 0.0;
    for (var i = t; i < n; i += WG) {
        let v = src[b * n + i];
        s += v * v;
    }
    red[t] = s;
    workgroupBarrier();
    for (var off = WG / 2u; off > 0u; off = off / 2u) {
        if (t < off) {
            red[t] += red[t + off];
        }
        workgroupBarrier();
    }
    let scale = inverseSqrt(red[0] / f32(n) + params.eps);
    for (var i = t; i < n; i += WG) {
        dst[b * n + i] = src[b * n + i] * scale * bitcast<f32>(aux[i]);
    }
}

// Pair i (of n_tokens x heads x head_dim/2) of a [n_tokens][heads][head_dim] buffer: the two
// elements it rotates and the angle's cosine and sine.
struct RopePair {
    o0: u32,
    o1: u32,
    c: f32,
    s: f32,
}

fn rope_pair(i: u32, heads: u32) -> RopePair {
    let half_dim = params.dim / 2u;
    let pair = i % half_dim;
    let b = i / (heads * half_dim);
    let theta = f32(aux[b]) * pow(params.base, -2.0 * f32(pair) / f32(params.dim));
    // Adjacent pairs, or with mode 1 pairs half a head apart.
    var r = RopePair(2u * i, 2u * i + 1u, cos(theta), sin(theta));
    if (params.mode == 1u) {
        r.o0 = (i / half_dim) * params.dim + pair;
        r.o1 = r.o0 + half_dim;
    }
    return r;
}

// rope_qk: the queries (dst, n_heads) and the keys (dst2, n_heads2) in one dispatch.
@compute @workgroup_size(256)
fn rope_qk(@builtin(global_invocation_id) gid: vec3<u32>) {
    let half_dim = params.dim / 2u;
    let nq = params.n_tokens * params.n_heads * half_dim;
    let i = gid.x;
    if (i >= nq + params.n_tokens * params.n_heads2 * half_dim) {
        return;
    }
    // The queries' pairs first, then the keys'.
    let is_q = i < nq;
    var r: RopePair;
    var x0: f32;
    var x1: f32;
    if (is_q) {
        r = rope_pair(i, params.n_heads);
        x0 = dst[r.o0];
        x1 = dst[r.o1];
    } else {
        r = rope_pair(i - nq, params.n_heads2);
        x0 = dst2[r.o0];
        x1 = dst2[r.o1];
    }
    let y0 = x0 * r.c - x1 * r.s;
    let y1 = x0 * r.s + x1 * r.c;
    if (is_q) {
        dst[r.o0] = y0;
        dst[r.o1] = y1;
    } else {
        dst2[r.o0] = y0;
        dst2[r.o1] = y1;
    }
}

@compute @workgroup_size(256)
fn swiglu_gated(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let n = params.dim;
    if (i >= params.n_tokens * n) {
        return;
    }
    let b = i / n;
    let g = src[2u * b * n + i % n];
    let u = src[(2u * b + 1u) * n + i % n];
    let gate = 1.0 / (1.0 + exp(-bitcast<f32>(aux[b])));
    dst[i] = g / (1.0 + exp(-g)) * u * gate;
}

@compute @workgroup_size(256)
fn embed(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let b = wg.x;
    if (b >= params.n_tokens) {
        return;
    }
    let n = params.dim;
    let row = tokens[b];
    for (var blk = t; blk < n / 32u; blk += WG) {
        let wv = weights32(row, blk, n);
        for (var k = 0u; k < 32u; k++) {
            dst[b * n + 32u * blk + k] = wv[k];
        }
    }
}

// residual: dst[i] += src[i] over n_tokens x dim values
@compute @workgroup_size(256)
fn residual(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= params.n_tokens * params.dim) {
        return;
    }
    dst[i] = dst[i] + src[i];
}
