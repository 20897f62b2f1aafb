// attend_decode, split pass, portable variant (no subgroups needed): one workgroup per
// (chunk of pages, KV head, sequence) for the pool buffer bound in `window`. Each page is
// scored one token per invocation, then the probabilities are folded into per-invocation
// accumulators that own (query head, pair of dimensions). Writes one partial per query head.

//!import common/pool.wgsl
//!import common/window.wgsl
//!import attend/common.wgsl
//!import attend/chunk.wgsl
//!import attend/online_softmax.wgsl
//!import attend/raw_pairs.wgsl
//!import attend/merge.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: AttendParams;
@group(0) @binding(2) var<uniform> window: PoolWindow;
@group(0) @binding(3) var<storage, read> page_list: array<u32>;
@group(0) @binding(4) var<storage, read> page_counts: array<u32>;
@group(0) @binding(5) var<storage, read> page_meta: array<PageMeta>;
@group(0) @binding(6) var<storage, read> pool: array<u32>;
@group(0) @binding(7) var<storage, read> queries: array<f32>;
@group(0) @binding(8) var<storage, read_write> partials: array<f32>;
@group(0) @binding(9) var<storage, read_write> scores: array<f32>;

fn attends(page: u32) -> bool {
    return in_window(window, page);
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
        let base = page_pairs(page_sh);

        // A: scores, one (token, query head) per invocation.
        for (var idx = t; idx < P * G; idx += WG) {
            let s = idx / G;
            let g = idx % G;
            var score = NEG_BIG;
            if (s < fill) {
                score = key_dot(base.x + s * half_d, g, D);
                if (params.write_scores != 0u) {
                    scores[(seq * params.q_heads + kvh * G + g) * params.max_tokens + pi * P + s] = score;
                }
            }
            p_sh[g * MAX_PAGE + s] = score;
        }
        workgroupBarrier();

        // B: online-softmax update per query head.
        online_softmax_page(t, G, fill);

        // C: fold the page's values into the accumulators.
        acc = fold_values(t, acc, G, D, base.y, fill);
    }

    write_pair_sums(t, acc, G, seq, kvh, window.buffer_index, chunk, D);
    write_softmax_stats(t, G, seq, kvh, window.buffer_index, chunk, D);
}
