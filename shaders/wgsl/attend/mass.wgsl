// attend_decode, attention-mass pass: for every cached token attended this step, add the
// attention it received, summed over the query heads of each KV head, to its slot metadata
// (H2O's accumulated attention), and record the access. x: logical slot of the head's page list,
// y: sequence x KV head.

//!import common/pool.wgsl
//!import attend/common.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: AttendParams;
@group(0) @binding(2) var<storage, read> page_list: array<u32>;
@group(0) @binding(3) var<storage, read> page_counts: array<u32>;
@group(0) @binding(4) var<storage, read> page_meta: array<PageMeta>;
@group(0) @binding(5) var<storage, read> scores: array<f32>;
@group(0) @binding(6) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(7) var<storage, read_write> slot_meta: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let j = gid.x;
    let seq = gid.y / geo.kv_heads;
    let h = gid.y % geo.kv_heads;
    if (seq >= params.n_seqs) {
        return;
    }
    let P = geo.page_size;
    let pi = j / P;
    let s = j % P;
    let li = list_index(geo, params.layer, seq, h);
    let n_pages = page_counts[li];
    if (pi >= n_pages) {
        return;
    }
    let page = page_list[li * geo.max_pages_per_seq + pi];
    if (s >= page_meta[page].fill) {
        return;
    }
    let m = (page * P + s) * geo.meta_words;
    var mass = 0.0;
    for (var g = 0u; g < params.group; g++) {
        let qh = h * params.group + g;
        let st = stats[seq * params.q_heads + qh];
        if (st.y > 0.0) {
            mass += exp(scores[(seq * params.q_heads + qh) * params.max_tokens + j] - st.x) / st.y;
        }
    }
    let attn = meta_attn(geo);
    slot_meta[m + attn] = bitcast<u32>(bitcast<f32>(slot_meta[m + attn]) + mass);
    slot_meta[m + META_LAST_ACCESS] = params.step;
    slot_meta[m + META_ACCESS_COUNT] = slot_meta[m + META_ACCESS_COUNT] + 1u;
}
