// Build each (layer, sequence, KV head)'s page list from its shard rings: shards in order, each
// ring from oldest to newest page. Attention reads these lists. One workgroup per
// (sequence x KV head, layer); its invocations share the list's entries (each finds its shard by
// binary search over the shards' offsets), so a long ring costs no more than many short ones.

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
var<workgroup> offsets: array<u32, 257>;  // [shard] first entry; [n_shards] the total

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
        offsets[geo.n_shards] = acc;
        page_counts[li] = acc;
    }
    workgroupBarrier();
    let list = li * geo.max_pages_per_seq;
    let R = geo.ring_capacity;
    let total = offsets[geo.n_shards];
    for (var i = t; i < total; i += WG) {
        // The last shard whose first entry is <= i (empty shards share offsets: skip them).
        var lo = 0u;
        var hi = geo.n_shards - 1u;
        while (lo < hi) {
            let mid = (lo + hi + 1u) / 2u;
            if (offsets[mid] <= i) {
                lo = mid;
            } else {
                hi = mid - 1u;
            }
        }
        let key = first_key + lo;
        let k = i - offsets[lo];
        page_list[list + i] = ring_pages[key * R + (rings[key].head + k) % R];
    }
}
