// route: recount, from the KV pool itself, how many K/V vectors (token x KV head) of tokens routed
// to each (layer, expert) are still cached (every slot holding one counts for each of its top-k
// experts), then set each expert's miss rate = 1 - resident / (appended x kv_heads). Pass
// "count": one workgroup per shard ring, walking its pages into a workgroup histogram of experts
// and adding it to the global counts once (one global atomic per ring and expert, instead of one
// per slot and expert: those all hit the same few counters); pass "finish": one invocation per
// (layer, expert).

//!import common/pool.wgsl
//!import common/route.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: RouteParams;
@group(0) @binding(2) var<storage, read> page_meta: array<PageMeta>;
@group(0) @binding(3) var<storage, read> slot_meta: array<u32>;
@group(0) @binding(4) var<storage, read_write> resident: array<atomic<u32>>;
@group(0) @binding(5) var<storage, read_write> stats: array<ExpertStats>;
@group(0) @binding(6) var<storage, read> rings: array<RingState>;
@group(0) @binding(7) var<storage, read> ring_pages: array<u32>;

const COUNT_WG: u32 = 256u;  // also the most experts (router_config checks n_experts <= 256)
var<workgroup> hist: array<atomic<u32>, 256>;

@compute @workgroup_size(256)
fn count(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let key = wg.x + wg.y * 65535u;
    let per_layer = geo.max_seqs * geo.kv_heads * geo.n_shards;
    if (key >= geo.layers * per_layer) {
        return;
    }
    atomicStore(&hist[t], 0u);
    workgroupBarrier();
    let layer = key / per_layer;
    let ring = rings[key];
    let R = geo.ring_capacity;
    let P = geo.page_size;
    for (var i = t; i < ring.count * P; i += COUNT_WG) {
        let page = ring_pages[key * R + (ring.head + i / P) % R];
        let s = i % P;
        if (s < page_meta[page].fill) {
            let m = (page * P + s) * geo.meta_words;
            for (var k = 0u; k < geo.top_k; k++) {
                let e = slot_meta[m + META_EXPERTS + k];
                if (e < params.n_experts) {
                    atomicAdd(&hist[e], 1u);
                }
            }
        }
    }
    workgroupBarrier();
    let c = atomicLoad(&hist[t]);
    if (t < params.n_experts && c > 0u) {
        atomicAdd(&resident[layer * params.n_experts + t], c);
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
        // The missing count first, in integers: 1 - r / v leaves -3e-8 for r = v where division
        // is a reciprocal and a product (NVIDIA), and a miss rate below 0 reads as a hit bonus.
        s.miss = f32(vectors - min(r, vectors)) / f32(vectors);
    } else {
        s.miss = 0.0;
    }
    stats[i] = s;
}
