// attend_decode, split pass over low-rank pages (codec low-rank or LoRA): scores in the reduced
// space against q_r = U_K^T q, projected once per query head; the probability-weighted sum of
// value coefficients is accumulated in the reduced space and reconstructed with U_V once at the
// end (sum_s p_s U_V c_s = U_V sum_s p_s c_s). Nothing is decompressed to memory. Partials go to
// the last "buffer" index, as in split_codec.wgsl.

//!import common/pool.wgsl
//!import attend/common.wgsl
//!import common/compress.wgsl
//!import attend/chunk.wgsl
//!import attend/online_softmax.wgsl
//!import attend/merge.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: AttendParams;
@group(0) @binding(2) var<storage, read> page_list: array<u32>;
@group(0) @binding(3) var<storage, read> page_counts: array<u32>;
@group(0) @binding(4) var<storage, read> page_meta: array<PageMeta>;
@group(0) @binding(5) var<storage, read> codec_kv: array<u32>;
@group(0) @binding(6) var<storage, read> queries: array<f32>;
@group(0) @binding(7) var<storage, read_write> partials: array<f32>;
@group(0) @binding(8) var<storage, read_write> scores: array<f32>;
@group(0) @binding(9) var<storage, read> basis: array<f32>;

const MAX_GR: u32 = 1024u;   // group * rank
const MAX_SLOTS: u32 = 16u;  // ceil(MAX_GR / WG)

var<workgroup> qr_sh: array<f32, 1024>;
var<workgroup> acc_sh: array<f32, 1024>;

// Compressed pages only (their ids follow the raw pages').
fn attends(page: u32) -> bool {
    return page >= geo.n_pages;
}

// Coefficient j of slot s, K (kv = 0) or V (kv = 1).
fn coef(page: u32, kv: u32, s: u32, j: u32) -> f32 {
    let half_r = geo.codec_param / 2u;
    let w = codec_kv[(page - geo.n_pages) * geo.codec_page_words + (kv * geo.page_size + s) * half_r + j / 2u];
    let pair = unpack2x16float(w);
    return select(pair.x, pair.y, (j & 1u) == 1u);
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let chunk = wg.x;
    let kvh = wg.y;
    let seq = wg.z;
    let G = params.group;
    let D = geo.head_dim;
    let P = geo.page_size;
    let R = geo.codec_param;
    let kb = basis_off(geo, params.layer, kvh, 0u);
    let vb = basis_off(geo, params.layer, kvh, 1u);
    let q0 = (seq * params.q_heads + kvh * G) * D;
    // q_r[g][j] = scale * U_K[j] . q_g
    for (var e = t; e < G * R; e += WG) {
        let g = e / R;
        let j = e % R;
        var d = 0.0;
        for (var i = 0u; i < D; i++) {
            d += basis[kb + j * D + i] * queries[q0 + g * D + i];
        }
        qr_sh[e] = d * params.scale;
    }
    online_softmax_start(t, G);
    let ch = chunk_of(t, seq, kvh, chunk);
    var acc: array<f32, 16>;
    for (var k = 0u; k < MAX_SLOTS; k++) {
        acc[k] = 0.0;
    }

    for (var pi = ch.first; pi < ch.last; pi++) {
        let fill = page_fill(t, ch.list + pi);
        if (fill == 0u) {
            continue;
        }
        let page = page_sh;

        for (var idx = t; idx < P * G; idx += WG) {
            let s = idx / G;
            let g = idx % G;
            var score = NEG_BIG;
            if (s < fill) {
                var dot = 0.0;
                for (var j = 0u; j < R; j++) {
                    dot += coef(page, 0u, s, j) * qr_sh[g * R + j];
                }
                score = dot;
                if (params.write_scores != 0u) {
                    scores[(seq * params.q_heads + kvh * G + g) * params.max_tokens + pi * P + s] = score;
                }
            }
            p_sh[g * MAX_PAGE + s] = score;
        }
        workgroupBarrier();

        online_softmax_page(t, G, fill);

        for (var k = 0u; k < MAX_SLOTS; k++) {
            let e = t + k * WG;
            if (e < G * R) {
                let g = e / R;
                let j = e % R;
                var a = acc[k] * f_sh[g];
                for (var s = 0u; s < fill; s++) {
                    a += p_sh[g * MAX_PAGE + s] * coef(page, 1u, s, j);
                }
                acc[k] = a;
            }
        }
        workgroupBarrier();
    }

    // Reconstruct: out[g][i] = sum_j U_V[j][i] acc[g][j].
    for (var k = 0u; k < MAX_SLOTS; k++) {
        let e = t + k * WG;
        if (e < G * R) {
            acc_sh[e] = acc[k];
        }
    }
    workgroupBarrier();
    let buffer = params.n_buffers - 1u;
    for (var e = t; e < G * D; e += WG) {
        let g = e / D;
        let i = e % D;
        var o = 0.0;
        for (var j = 0u; j < R; j++) {
            o += basis[vb + j * D + i] * acc_sh[g * R + j];
        }
        partials[partial_at(seq, kvh * G + g, buffer, chunk, D) + 4u + i] = o;
    }
    write_softmax_stats(t, G, seq, kvh, buffer, chunk, D);
}
