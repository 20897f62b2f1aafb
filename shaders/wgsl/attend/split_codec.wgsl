// attend_decode, split pass over compressed pages: like split_tiled.wgsl (portable), but reads
// only pages whose id is a compressed page's and decodes them in-kernel (KIVI int8/int4: keys
// per channel, values per token group; FastV dims: the kept key dimensions). No decompressed copy
// is ever written. Its partials go to the last "buffer" index (after the raw pool buffers').

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

var<workgroup> q_sh: array<f32, 2048>;
var<workgroup> kp_sh: array<u32, 256>;  // key (min, scale) per channel of the current page

// Compressed pages only (their ids follow the raw pages').
fn attends(page: u32) -> bool {
    return page >= geo.n_pages;
}

fn kv_word(page: u32, w: u32) -> u32 {
    return codec_kv[(page - geo.n_pages) * geo.codec_page_words + w];
}

// Decoded key dimension i of slot s.
fn key_at(page: u32, s: u32, i: u32) -> f32 {
    if (geo.codec == CODEC_FASTV_DIMS) {
        if (i >= geo.codec_param) {
            return 0.0;
        }
        let pair = unpack2x16float(kv_word(page, s * (geo.codec_param / 2u) + i / 2u));
        return select(pair.x, pair.y, (i & 1u) == 1u);
    }
    let per = 32u / codec_bits(geo);
    let word = kv_word(page, k_codes_off(geo) + s * code_row_words(geo) + i / per);
    return dequantize(code_at(geo, word, i), kp_sh[i]);
}

// Decoded value dimension i of slot s.
fn value_at(page: u32, s: u32, i: u32) -> f32 {
    if (geo.codec == CODEC_FASTV_DIMS) {
        let pair = unpack2x16float(kv_word(page, geo.page_size * (geo.codec_param / 2u) + s * geo.vec_words + i / 2u));
        return select(pair.x, pair.y, (i & 1u) == 1u);
    }
    let per = 32u / codec_bits(geo);
    let word = kv_word(page, v_codes_off(geo) + s * code_row_words(geo) + i / per);
    let prm = kv_word(page, v_params_off(geo) + s * (geo.head_dim / geo.v_group) + i / geo.v_group);
    return dequantize(code_at(geo, word, i), prm);
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let chunk = wg.x;
    let kvh = wg.y;
    let seq = wg.z;
    let G = params.group;
    let D = geo.head_dim;
    let P = geo.page_size;
    let half_d = D / 2u;
    let q0 = (seq * params.q_heads + kvh * G) * D;
    for (var i = t; i < G * D; i += WG) {
        q_sh[i] = queries[q0 + i] * params.scale;
    }
    online_softmax_start(t, G);
    let ch = chunk_of(t, seq, kvh, chunk);
    let n_pairs = G * half_d;
    var acc: array<vec2<f32>, MAX_PAIRS>;
    for (var k = 0u; k < MAX_PAIRS; k++) {
        acc[k] = vec2<f32>(0.0);
    }

    for (var pi = ch.first; pi < ch.last; pi++) {
        let fill = page_fill(t, ch.list + pi);
        if (fill == 0u) {
            continue;
        }
        let page = page_sh;
        if (geo.codec != CODEC_FASTV_DIMS) {
            for (var i = t; i < D; i += WG) {
                kp_sh[i] = kv_word(page, i);
            }
        }
        workgroupBarrier();

        for (var idx = t; idx < P * G; idx += WG) {
            let s = idx / G;
            let g = idx % G;
            var score = NEG_BIG;
            if (s < fill) {
                var dot = 0.0;
                for (var i = 0u; i < D; i++) {
                    dot += key_at(page, s, i) * q_sh[g * D + i];
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

        for (var k = 0u; k < MAX_PAIRS; k++) {
            let e = t + k * WG;
            if (e < n_pairs) {
                let g = e / half_d;
                let j = e % half_d;
                var a = acc[k] * f_sh[g];
                for (var s = 0u; s < fill; s++) {
                    a += p_sh[g * MAX_PAGE + s] * vec2<f32>(value_at(page, s, 2u * j), value_at(page, s, 2u * j + 1u));
                }
                acc[k] = a;
            }
        }
        workgroupBarrier();
    }

    let buffer = params.n_buffers - 1u;
    write_pair_sums(t, acc, G, seq, kvh, buffer, chunk, D);
    write_softmax_stats(t, G, seq, kvh, buffer, chunk, D);
}
