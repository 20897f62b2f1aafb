// codec, pass 2: encode each job's raw page into its compressed page and move its slot
// metadata. One workgroup per job (indirect dispatch), once per raw pool buffer.

//!import common/pool.wgsl
//!import common/window.wgsl
//!import common/compress.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> window: PoolWindow;
@group(0) @binding(2) var<storage, read> jobs: array<vec2<u32>>;
@group(0) @binding(3) var<storage, read> pool: array<u32>;
@group(0) @binding(4) var<storage, read_write> codec_kv: array<u32>;
@group(0) @binding(5) var<storage, read_write> slot_meta: array<u32>;
@group(0) @binding(6) var<storage, read> page_meta: array<PageMeta>;
@group(0) @binding(7) var<storage, read> basis: array<f32>;

const WG: u32 = 64u;
var<workgroup> kparams: array<u32, 256>;
var<workgroup> vparams: array<u32, 512>;

// K (kv = 0) or V (kv = 1) value i of slot s of the raw page at word `base`.
fn raw(base: u32, kv: u32, s: u32, i: u32) -> f32 {
    let w = pool[base + kv * block_words(geo) + s * geo.vec_words + i / 2u];
    let pair = unpack2x16float(w);
    return select(pair.x, pair.y, (i & 1u) == 1u);
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let job = jobs[wg.x];
    if (!in_window(window, job.x)) {
        return;
    }
    let P = geo.page_size;
    let D = geo.head_dim;
    let base = (job.x - window.first_page) * geo.page_words;
    let out = (job.y - geo.n_pages) * geo.codec_page_words;
    // Slot metadata follows the page to its new id.
    let mw = geo.meta_words;
    for (var w = t; w < P * mw; w += WG) {
        slot_meta[job.y * P * mw + w] = slot_meta[job.x * P * mw + w];
    }
    if (codec_is_low_rank(geo)) {
        // Coefficients against the page's (layer, head) basis, K block then V block.
        let lh = key_layer_head(geo, page_meta[job.y].owner);
        let half_r = geo.codec_param / 2u;
        for (var w = t; w < 2u * P * half_r; w += WG) {
            let kv = w / (P * half_r);
            let s = (w / half_r) % P;
            let j = 2u * (w % half_r);
            let b0 = basis_off(geo, lh.x, lh.y, kv) + j * D;
            var c0 = 0.0;
            var c1 = 0.0;
            for (var i = 0u; i < D; i++) {
                let x = raw(base, kv, s, i);
                c0 += basis[b0 + i] * x;
                c1 += basis[b0 + D + i] * x;
            }
            codec_kv[out + w] = f16_bits_rne(c0) | (f16_bits_rne(c1) << 16u);
        }
        return;
    }
    if (geo.codec == CODEC_FASTV_DIMS) {
        let kw = geo.codec_param / 2u;
        for (var w = t; w < P * kw; w += WG) {
            codec_kv[out + w] = pool[base + (w / kw) * geo.vec_words + w % kw];
        }
        for (var w = t; w < P * geo.vec_words; w += WG) {
            codec_kv[out + P * kw + w] = pool[base + block_words(geo) + w];
        }
        return;
    }
    // KIVI: key parameters per channel, value parameters per (slot, group).
    let groups = D / geo.v_group;
    for (var i = t; i < D; i += WG) {
        var lo = 3.4e38;
        var hi = -3.4e38;
        for (var s = 0u; s < P; s++) {
            let x = raw(base, 0u, s, i);
            lo = min(lo, x);
            hi = max(hi, x);
        }
        let p = quant_params(geo, lo, hi);
        kparams[i] = p;
        codec_kv[out + i] = p;
    }
    for (var j = t; j < P * groups; j += WG) {
        let s = j / groups;
        let g = j % groups;
        var lo = 3.4e38;
        var hi = -3.4e38;
        for (var i = g * geo.v_group; i < (g + 1u) * geo.v_group; i++) {
            let x = raw(base, 1u, s, i);
            lo = min(lo, x);
            hi = max(hi, x);
        }
        let p = quant_params(geo, lo, hi);
        vparams[j] = p;
        codec_kv[out + v_params_off(geo) + j] = p;
    }
    workgroupBarrier();
    let rw = code_row_words(geo);
    let per = 32u / codec_bits(geo);
    for (var w = t; w < P * rw; w += WG) {
        let s = w / rw;
        let i0 = (w % rw) * per;
        var kword = 0u;
        var vword = 0u;
        for (var c = 0u; c < per; c++) {
            let i = i0 + c;
            let kc = quantize(geo, raw(base, 0u, s, i), kparams[i]);
            let vc = quantize(geo, raw(base, 1u, s, i), vparams[s * groups + i / geo.v_group]);
            kword |= kc << (c * codec_bits(geo));
            vword |= vc << (c * codec_bits(geo));
        }
        codec_kv[out + k_codes_off(geo) + w] = kword;
        codec_kv[out + v_codes_off(geo) + w] = vword;
    }
}
