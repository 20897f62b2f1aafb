// codec under eviction, pass 2 of 2: decode each job's compressed page into the raw page
// compress/thaw_plan gave it (f16 values rounded to nearest even, as the CPU pool model does),
// and move its slot metadata and victim marks with it. One workgroup per job (indirect
// dispatch), once per raw pool buffer. Decoded values are those attention read from the
// compressed page (KIVI: min + code * scale; FastV dims: the kept dimensions, zeros for the
// dropped key dimensions; low rank: sum over j ascending of basis[j][i] * coefficient j, every
// product exact in f32).

//!import common/pool.wgsl
//!import common/window.wgsl
//!import common/compress.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> window: PoolWindow;
@group(0) @binding(2) var<storage, read> jobs: array<vec2<u32>>;  // (compressed id, raw page)
@group(0) @binding(3) var<storage, read_write> pool: array<u32>;
@group(0) @binding(4) var<storage, read> codec_kv: array<u32>;
@group(0) @binding(5) var<storage, read_write> slot_meta: array<u32>;
@group(0) @binding(6) var<storage, read_write> victim: array<u32>;
@group(0) @binding(7) var<storage, read> page_meta: array<PageMeta>;
@group(0) @binding(8) var<storage, read> basis: array<f32>;
@group(0) @binding(9) var<storage, read_write> page_gen: array<atomic<u32>>;

const WG: u32 = 64u;

fn half_at(w: u32, i: u32) -> f32 {
    return f16_value(select(w & 0xffffu, w >> 16u, (i & 1u) == 1u));
}

// K (kv = 0) or V (kv = 1) value i of slot s of the compressed page at word `src`, owned by
// (layer, head) `lh`.
fn decoded(src: u32, lh: vec2<u32>, kv: u32, s: u32, i: u32) -> f32 {
    let P = geo.page_size;
    let D = geo.head_dim;
    if (codec_is_low_rank(geo)) {
        let r = geo.codec_param;
        let b0 = basis_off(geo, lh.x, lh.y, kv);
        let c0 = src + (kv * P + s) * (r / 2u);
        var x = 0.0;
        for (var j = 0u; j < r; j++) {
            x += basis[b0 + j * D + i] * half_at(codec_kv[c0 + j / 2u], j);
        }
        return x;
    }
    if (geo.codec == CODEC_FASTV_DIMS) {
        let kw = geo.codec_param / 2u;
        if (kv == 0u) {
            if (i >= geo.codec_param) {
                return 0.0;
            }
            return half_at(codec_kv[src + s * kw + i / 2u], i);
        }
        return half_at(codec_kv[src + P * kw + s * geo.vec_words + i / 2u], i);
    }
    let rw = code_row_words(geo);
    let per = 32u / codec_bits(geo);
    if (kv == 0u) {
        let word = codec_kv[src + k_codes_off(geo) + s * rw + i / per];
        return dequantize(code_at(geo, word, i), codec_kv[src + i]);
    }
    let word = codec_kv[src + v_codes_off(geo) + s * rw + i / per];
    return dequantize(code_at(geo, word, i), codec_kv[src + v_params_off(geo) + s * (D / geo.v_group) + i / geo.v_group]);
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let job = jobs[wg.x];
    let cid = job.x;
    let raw = job.y;
    if (!in_window(window, raw)) {
        return;
    }
    let P = geo.page_size;
    let mw = geo.meta_words;
    if (t == 0u) {
        atomicAdd(&page_gen[raw], 1u);  // the raw page is rewritten
    }
    for (var w = t; w < P * mw; w += WG) {
        slot_meta[raw * P * mw + w] = slot_meta[cid * P * mw + w];
    }
    for (var s = t; s < P; s += WG) {
        victim[raw * P + s] = victim[cid * P + s];
        victim[cid * P + s] = 0u;
    }
    let lh = key_layer_head(geo, page_meta[raw].owner);
    let src = (cid - geo.n_pages) * geo.codec_page_words;
    let base = (raw - window.first_page) * geo.page_words;
    let vw = geo.vec_words;
    for (var w = t; w < 2u * P * vw; w += WG) {
        let kv = w / (P * vw);
        let s = (w / vw) % P;
        let j = w % vw;
        let x0 = decoded(src, lh, kv, s, 2u * j);
        let x1 = decoded(src, lh, kv, s, 2u * j + 1u);
        pool[base + kv * block_words(geo) + s * vw + j] = f16_bits_rne(x0) | (f16_bits_rne(x1) << 16u);
    }
}
