// Build each (layer, sequence, KV head)'s page list from its shard rings: shards in order, each
// ring from oldest to newest page. Attention reads these lists. One workgroup per
// (sequence x KV head, layer).

//!import common/pool.wgsl

// must match `GatherParams` in core/src/gpu_data.rs
struct GatherParams {
    first_layer: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: GatherParams;
@group(0) @binding(2) var<storage, read> rings: array<RingState>;
@group(0) @binding(3) var<storage, read> ring_pages: array<u32>;
@group(0) @binding(4) var<storage, read_write> page_list: array<u32>;
@group(0) @binding(5) var<storage, read_write> page_counts: array<u32>;

const WG: u32 = 64u;
const MAX_SHARDS: u32 = 256u;
var<workgroup> offsets: array<u32, 256>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let seq = wg.x / geo.kv_heads;
    let head = wg.x % geo.kv_heads;
    let layer = params.first_layer + wg.y;
    let li = list_index(geo, layer, seq, head);
    let first_key = li * geo.n_shards;
    if (t == 0u) {
        var acc = 0u;
        for (var s = 0u; s < geo.n_shards; s++) {
            offsets[s] = acc;
            acc += rings[first_key + s].count;
        }
        page_counts[li] = acc;
    }
    workgroupBarrier();
    let list = li * geo.max_pages_per_seq;
    let R = geo.ring_capacity;
    for (var s = t; s < geo.n_shards; s += WG) {
        let ring = rings[first_key + s];
        for (var k = 0u; k < ring.count; k++) {
            page_list[list + offsets[s] + k] = ring_pages[(first_key + s) * R + (ring.head + k) % R];
        }
    }
}
