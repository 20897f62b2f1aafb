// evict, capture into the recall tier: after select (and a codec's thaw), before compaction,
// every victim's K, V and position go to its page list's tier, where attend/recall.wgsl finds
// them again, so an eviction loses nothing. The tier is laid out as the pool's raw pages (K block
// then V block), `tier.cap` slots a list, list after list; the host places it in host memory the
// device reads in place where it can. This pass plans: one workgroup per page list walks its shard
// rings in shard order, each in ring order, and gives each victim the list's next tier slot (so
// the tier's order is the CPU reference's, whatever the scheduling); a victim past the tier's end
// is dropped and counted. evict/capture_copy.wgsl then copies the planned slots.

//!import common/pool.wgsl
//!import common/window.wgsl
//!import common/scan.wgsl
//!import common/recall.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> tier: TierParams;
@group(0) @binding(2) var<storage, read> rings: array<RingState>;
@group(0) @binding(3) var<storage, read> ring_pages: array<u32>;
@group(0) @binding(4) var<storage, read> victim: array<u32>;
@group(0) @binding(5) var<storage, read_write> tier_count: array<u32>;
@group(0) @binding(6) var<storage, read_write> capture_dst: array<u32>;
@group(0) @binding(7) var<storage, read_write> tier_stats: array<atomic<u32>>;

const WG: u32 = 256u;
var<workgroup> ring_sh: RingState;
var<workgroup> base_sh: u32;

@compute @workgroup_size(256)
fn plan(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let li = wg.x + wg.y * 65535u;
    if (li >= geo.layers * geo.max_seqs * geo.kv_heads) {
        return;
    }
    if (t == 0u) {
        base_sh = tier_count[li];
    }
    let first = workgroupUniformLoad(&base_sh);
    var base = first;
    let P = geo.page_size;
    let R = geo.ring_capacity;
    for (var s = 0u; s < geo.n_shards; s++) {
        let key = li * geo.n_shards + s;
        if (t == 0u) {
            ring_sh = rings[key];
        }
        let ring = workgroupUniformLoad(&ring_sh);
        var n = 0u;
        if (ring.count > 0u) {
            n = (ring.count - 1u) * P + ring.fill;
        }
        let rounds = (n + WG - 1u) / WG;
        for (var r = 0u; r < rounds; r++) {
            let i = r * WG + t;
            var v = 0u;
            var slot = 0u;
            if (i < n) {
                slot = ring_pages[key * R + (ring.head + i / P) % R] * P + i % P;
                v = select(0u, 1u, victim[slot] != 0u);
            }
            let rank = workgroup_scan(t, v);
            let total = workgroupUniformLoad(&scan[SCAN_WG - 1u]);
            if (v == 1u) {
                let at = base + rank - 1u;
                if (at < tier.cap) {
                    capture_dst[slot] = li * tier.cap + at;
                } else {
                    atomicAdd(&tier_stats[TIER_DROPPED], 1u);
                }
            }
            base += total;
        }
    }
    if (t == 0u) {
        let kept = min(base, tier.cap);
        tier_count[li] = kept;
        atomicAdd(&tier_stats[TIER_CAPTURED], kept - min(first, tier.cap));
    }
}
