// route: recount, from the KV pool itself, how many K/V vectors (token x KV head) of tokens routed
// to each (layer, expert) are still cached (every slot holding one counts for each of its top-k
// experts), then set each expert's miss rate = 1 - resident / (appended x kv_heads). Pass
// "count": one invocation per pool slot; pass "finish": one invocation per (layer, expert).

//!import common/pool.wgsl
//!import common/route.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: RouteParams;
@group(0) @binding(2) var<storage, read> page_meta: array<PageMeta>;
@group(0) @binding(3) var<storage, read> slot_meta: array<u32>;
@group(0) @binding(4) var<storage, read_write> resident: array<atomic<u32>>;
@group(0) @binding(5) var<storage, read_write> stats: array<ExpertStats>;

@compute @workgroup_size(64)
fn count(@builtin(global_invocation_id) gid: vec3<u32>) {
    let slot = gid.x + gid.y * 65535u * 64u;
    let page = slot / geo.page_size;
    if (page >= geo.n_pages + geo.codec_pages) {
        return;
    }
    let pm = page_meta[page];
    if (pm.owner == NO_OWNER || slot % geo.page_size >= pm.fill) {
        return;
    }
    let layer = pm.owner / (geo.max_seqs * geo.kv_heads * geo.n_shards);
    let m = slot * geo.meta_words;
    for (var i = 0u; i < geo.top_k; i++) {
        let e = slot_meta[m + META_EXPERTS + i];
        if (e < params.n_experts) {
            atomicAdd(&resident[layer * params.n_experts + e], 1u);
        }
    }
}

@compute @workgroup_size(64)
fn finish(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= geo.layers * params.n_experts) {
        return;
    }
    let r = atomicExchange(&resident[i], 0u);
    var s = stats[i];
    s.resident = r;
    let vectors = s.appended * geo.kv_heads;
    if (vectors > 0u) {
        s.miss = 1.0 - f32(min(r, vectors)) / f32(vectors);
    } else {
        s.miss = 0.0;
    }
    stats[i] = s;
}
