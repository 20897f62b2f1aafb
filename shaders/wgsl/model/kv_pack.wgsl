// model: the K and V of a step's tokens (f32, [token][kv_heads * head_dim] each, as the
// projections and RoPE leave them) packed into the pool's append layout: per token all of K, then
// all of V, in storage words: f32 bits, or f16 pairs (low half first) rounded to nearest even with
// integer operations, the bits `half::f16::from_f32` gives (core/src/append/format.rs,
// `encode_values`) except beyond f16's range, which clamps to +-65504 here instead of infinity.
// One invocation per output word. Lets a forward pass append to the pool without the K/V
// crossing to the host.

//!import common/half.wgsl

// must match `KvPackParams` in model/src/gpu_data.rs
struct KvPackParams {
    n_tokens: u32,
    floats: u32,  // K (or V) floats per token: kv_heads * head_dim
    f16: u32,     // 1: f16 pairs, 0: f32 bits
    _pad: u32,
}

@group(0) @binding(0) var<uniform> params: KvPackParams;
@group(0) @binding(1) var<storage, read> k: array<f32>;
@group(0) @binding(2) var<storage, read> v: array<f32>;
@group(0) @binding(3) var<storage, read_write> words: array<u32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let per = select(params.floats, params.floats / 2u, params.f16 != 0u);  // words of K (or V) per token
    let b = gid.y;
    let i = gid.x;
    if (b >= params.n_tokens || i >= 2u * per) {
        return;
    }
    let is_v = i >= per;
    let j = select(i, i - per, is_v);
    var w: u32;
    if (params.f16 != 0u) {
        let o = b * params.floats + 2u * j;
        let lo = select(k[o], v[o], is_v);
        let hi = select(k[o + 1u], v[o + 1u], is_v);
        w = f16_bits_rne(lo) | (f16_bits_rne(hi) << 16u);
    } else {
        let o = b * params.floats + j;
        w = bitcast<u32>(select(k[o], v[o], is_v));
    }
    words[b * 2u * per + i] = w;
}
