// Compressed page layouts and the exact arithmetic of the quantisers, shared by the encoder and
// the decoding attention (mirrored in core/src/reference/compress.rs).
//
// KIVI int8 / int4 page (u32 words), P slots, d dimensions, b bits, G dimensions per V group:
//   [0, d)                     K: per channel i, (min, scale) as f16 pair (low = min)
//   [d, d + P d b / 32)        K codes, row per slot, codes packed from the low bits
//   then P (d / G) words       V: per (slot, group), (min, scale) as f16 pair
//   then P d b / 32 words      V codes
// FastV dims page: K rows of `keep` dimensions (f16 pairs), then V rows of d dimensions.
// Low-rank / LoRA page, rank r: K coefficient rows (r f16, r / 2 words per slot), then V rows.
//   The basis (f32 storage holding f16 values): per (layer, KV head), K then V, r rows of d.
//   A coefficient is sum_i U[j][i] * x[i] in f32, i ascending: each product of two f16 is exact,
//   so fused or not the sum is the same bits everywhere; it is stored rounded to nearest even
//   with integer operations (`f16_bits_rne`), mirrored on the CPU.
//
// Exactness: min is rounded down to f16, scale up (directed rounding done with integer ops);
// codes are found by comparing x with min + (c - 0.5) * scale and decoded as min + c * scale.
// Every product there is exact in f32 (an f16 times a number of at most 9 significant bits), so
// fused or not, GPU and CPU produce the same bits.

//!import common/pool.wgsl
//!import common/half.wgsl

const CODEC_NONE: u32 = 0u;
const CODEC_INT8: u32 = 1u;
const CODEC_INT4: u32 = 2u;
const CODEC_FASTV_DIMS: u32 = 3u;
const CODEC_LOW_RANK: u32 = 4u;
const CODEC_LORA: u32 = 5u;

fn codec_is_low_rank(geo: Geometry) -> bool {
    return geo.codec == CODEC_LOW_RANK || geo.codec == CODEC_LORA;
}

// Word offset of (layer, head, kv)'s rank x d basis block. LoRA's basis is one per layer,
// shared by its KV heads, and stored once.
fn basis_off(geo: Geometry, layer: u32, head: u32, kv: u32) -> u32 {
    let lora = geo.codec == CODEC_LORA;
    let heads = select(geo.kv_heads, 1u, lora);
    let h = select(head, 0u, lora);
    return ((layer * heads + h) * 2u + kv) * geo.codec_param * geo.head_dim;
}

// (layer, KV head) of a shard key.
fn key_layer_head(geo: Geometry, key: u32) -> vec2<u32> {
    let list = key / geo.n_shards;
    return vec2<u32>(list / (geo.max_seqs * geo.kv_heads), list % geo.kv_heads);
}

fn codec_bits(geo: Geometry) -> u32 {
    return select(8u, 4u, geo.codec == CODEC_INT4);
}

fn codec_levels(geo: Geometry) -> u32 {
    return select(255u, 15u, geo.codec == CODEC_INT4);
}

// 1 / levels as the f32 both sides use (1/15 and 1/255 correctly rounded).
fn codec_inv_levels(geo: Geometry) -> f32 {
    return select(bitcast<f32>(0x3b808081u), bitcast<f32>(0x3d888889u), geo.codec == CODEC_INT4);
}

// u32 words of one row of codes.
fn code_row_words(geo: Geometry) -> u32 {
    return geo.head_dim * codec_bits(geo) / 32u;
}

fn k_codes_off(geo: Geometry) -> u32 {
    return geo.head_dim;
}

fn v_params_off(geo: Geometry) -> u32 {
    return geo.head_dim + geo.page_size * code_row_words(geo);
}

fn v_codes_off(geo: Geometry) -> u32 {
    return v_params_off(geo) + geo.page_size * (geo.head_dim / geo.v_group);
}

// Code of dimension i in a row starting at word `row`.
fn code_at(geo: Geometry, word: u32, i: u32) -> u32 {
    let b = codec_bits(geo);
    let per = 32u / b;
    return (word >> ((i % per) * b)) & ((1u << b) - 1u);
}

// (min, scale) f16 bits of a group with values in [lo, hi].
fn quant_params(geo: Geometry, lo: f32, hi: f32) -> u32 {
    let mn = f16_bits_dir(lo, false);
    let range = hi - f16_value(mn);
    let sc = f16_bits_dir(range * codec_inv_levels(geo), true);
    return mn | (sc << 16u);
}

fn quantize(geo: Geometry, x: f32, params: u32) -> u32 {
    let mn = f16_value(params);
    let sc = f16_value(params >> 16u);
    if (sc == 0.0) {
        return 0u;
    }
    var lo = 0u;
    var hi = codec_levels(geo);
    while (lo < hi) {
        let mid = (lo + hi + 1u) / 2u;
        if (x >= mn + (f32(mid) - 0.5) * sc) {
            lo = mid;
        } else {
            hi = mid - 1u;
        }
    }
    return lo;
}

fn dequantize(code: u32, params: u32) -> f32 {
    return f16_value(params) + f32(code) * f16_value(params >> 16u);
}

// 2^e for e in -126..=127, built from its bits: exact, as ldexp(1.0, e) is, but without the
// general ldexp the H200's compiler emits (two exp2 and a dozen branches per call).
fn pow2(e: i32) -> f32 {
    return bitcast<f32>(u32(e + 127) << 23u);
}
