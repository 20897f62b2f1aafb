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
//!import attend/chunk.wgsl
//!import attend/merge.wgsl
//!import attend/online_softmax.wgsl
//!import attend/raw_pairs.wgsl

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

fn attends(page: u32) -> bool {
    return in_window(window, page);
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
    load_queries(t, q0, G * D);
    online_softmax_start(t, G);
    let ch = chunk_of(t, seq, kvh, chunk);

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
        let base = page_pairs(page);

        // Scores, one (slot, query head) per invocation; a slot past the query's position is
        // masked (NEG_BIG, and probability 0 below).
        for (var idx = t; idx < P * G; idx += WG) {
            let s = idx / G;
            let g = idx % G;
            var score = NEG_BIG;
            if (s < fill && slot_meta[(page * P + s) * geo.meta_words + META_POSITION] <= q_pos) {
                score = key_dot(base.x + s * half_d, g, D);
            }
            p_sh[g * MAX_PAGE + s] = score;
        }
        workgroupBarrier();

        // Online softmax per query head over the page's slots (a masked one weighs 0).
        online_softmax_page(t, G, fill);

        // Fold the page's values into the accumulators.
        acc = fold_values(t, acc, G, D, base.y, fill);
        workgroupBarrier();
    }

    write_pair_sums(t, acc, G, c, kvh, window.buffer_index, chunk, D);
    write_softmax_stats(t, G, c, kvh, window.buffer_index, chunk, D);
}
