// attend_prefill, split pass: causal attention of a chunk of one sequence's queries (a prompt
// fed many tokens per forward pass) over that sequence's pages, whose K/V the chunk has just
// appended. One workgroup per (chunk of pages, KV head, query token c) for the pool buffer bound
// in `window`, as the decode split (attend/split_tiled) is laid out with the chunk's queries in
// place of sequences; a slot is seen by query c only when its token's position is at most the
// query's (first_position + c), read from the slot's metadata, so the mask holds whatever order
// the pages are in. Writes one partial per (query token, query head); attend/reduce merges them.
// Raw pages only (f16 or f32): a pool with a page codec prefills token by token.

//!import common/pool.wgsl
//!import common/window.wgsl
//!import attend/common.wgsl
//!import attend/merge.wgsl
//!import attend/online_softmax.wgsl

// must match `PrefillParams` in core/src/gpu_data.rs
struct PrefillParams {
    seq: u32,            // the sequence whose pages are read
    first_position: u32, // position of the chunk's first query
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: AttendParams;
@group(0) @binding(2) var<uniform> window: PoolWindow;
@group(0) @binding(3) var<storage, read> page_list: array<u32>;
@group(0) @binding(4) var<storage, read> page_counts: array<u32>;
@group(0) @binding(5) var<storage, read> page_meta: array<PageMeta>;
@group(0) @binding(6) var<storage, read> pool: array<u32>;
@group(0) @binding(7) var<storage, read> queries: array<f32>;     // [query token][q_heads][d]
@group(0) @binding(8) var<storage, read_write> partials: array<f32>;
@group(0) @binding(9) var<storage, read> slot_meta: array<u32>;
@group(0) @binding(10) var<uniform> prefill: PrefillParams;

const WG: u32 = 64u;
const MAX_GROUP: u32 = 8u;
const MAX_PAGE: u32 = 64u;
const MAX_PAIRS: u32 = 16u;  // MAX_GROUP * MAX_DIM / 2 / WG

var<workgroup> q_sh: array<f32, 2048>;  // [group][d], pre-scaled
var<workgroup> fill_sh: u32;
var<workgroup> count_sh: u32;

fn load_pair(word: u32) -> vec2<f32> {
    if (geo.f16_kv != 0u) {
        return unpack2x16float(pool[word]);
    }
    return vec2<f32>(bitcast<f32>(pool[2u * word]), bitcast<f32>(pool[2u * word + 1u]));
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let chunk = wg.x;
    let kvh = wg.y;
    let c = wg.z;
    let G = params.group;
    let D = geo.head_dim;
    let P = geo.page_size;
    let half_d = D / 2u;
    let seq = prefill.seq;
    let q_pos = prefill.first_position + c;
    let q0 = (c * params.q_heads + kvh * G) * D;
    for (var i = t; i < G * D; i += WG) {
        q_sh[i] = queries[q0 + i] * params.scale;
    }
    if (t < G) {
        m_sh[t] = NEG_BIG;
        l_sh[t] = 0.0;
    }
    if (t == 0u) {
        count_sh = page_counts[list_index(geo, params.layer, seq, kvh)];
    }
    let n_pages = workgroupUniformLoad(&count_sh);
    let first = chunk * params.chunk_pages;
    let last = min(first + params.chunk_pages, n_pages);
    let list = list_index(geo, params.layer, seq, kvh) * geo.max_pages_per_seq;
    let pair_scale = select(2u, 1u, geo.f16_kv != 0u);
    let n_pairs = G * half_d;

    var acc: array<vec2<f32>, 16>;
    for (var k = 0u; k < MAX_PAIRS; k++) {
        acc[k] = vec2<f32>(0.0);
    }

    for (var pi = first; pi < last; pi++) {
        let page = page_list[list + pi];
        if (t == 0u) {
            var fill = 0u;
            if (in_window(window, page)) {
                fill = page_meta[page].fill;
            }
            fill_sh = fill;
        }
        let fill = workgroupUniformLoad(&fill_sh);
        if (fill == 0u) {
            continue;
        }
        let local_page = page - window.first_page;
        let k_base = (local_page * geo.page_words) / pair_scale;
        let v_base = k_base + block_words(geo) / pair_scale;

        // Scores, one (slot, query head) per invocation; a slot past the query's position is
        // masked (NEG_BIG, and probability 0 below).
        for (var idx = t; idx < P * G; idx += WG) {
            let s = idx / G;
            let g = idx % G;
            var score = NEG_BIG;
            if (s < fill && slot_meta[(page * P + s) * geo.meta_words + META_POSITION] <= q_pos) {
                var dot = 0.0;
                let row = k_base + s * half_d;
                for (var j = 0u; j < half_d; j++) {
                    let kv = load_pair(row + j);
                    dot += kv.x * q_sh[g * D + 2u * j] + kv.y * q_sh[g * D + 2u * j + 1u];
                }
                score = dot;
            }
            p_sh[g * MAX_PAGE + s] = score;
        }
        workgroupBarrier();

        // Online softmax per query head over the page's slots (a masked one weighs 0).
        online_softmax_page(t, G, fill);

        // Fold the page's values into the accumulators.
        for (var k = 0u; k < MAX_PAIRS; k++) {
            let e = t + k * WG;
            if (e < n_pairs) {
                let g = e / half_d;
                let j = e % half_d;
                var a = acc[k] * f_sh[g];
                for (var s = 0u; s < fill; s++) {
                    a += p_sh[g * MAX_PAGE + s] * load_pair(v_base + s * half_d + j);
                }
                acc[k] = a;
            }
        }
        workgroupBarrier();
    }

    let stride = partial_stride(D);
    for (var k = 0u; k < MAX_PAIRS; k++) {
        let e = t + k * WG;
        if (e < n_pairs) {
            let g = e / half_d;
            let j = e % half_d;
            let o = partial_index(params, c, kvh * G + g, window.buffer_index, chunk) * stride + 4u + 2u * j;
            write_partial_acc2(o, acc[k]);
        }
    }
    if (t < G) {
        let o = partial_index(params, c, kvh * G + t, window.buffer_index, chunk) * stride;
        write_partial_stats(o, m_sh[t], l_sh[t]);
    }
}
