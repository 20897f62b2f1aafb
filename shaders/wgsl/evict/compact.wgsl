// evict, pass 4: compact each shard ring after its victims are marked. One workgroup per ring.
// With n tokens of which v are victims, the ring keeps n' = n - v: the victims among the first n'
// slots (in ring order) are holes, the survivors among the last v are movers; the i-th mover
// fills the i-th hole (evict/move copies them; sources and destinations never overlap). Pages
// past the first ceil(n' / P) are listed for evict/free. Clears the victim marks.

//!import common/pool.wgsl
//!import common/scan.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<storage, read_write> rings: array<RingState>;
@group(0) @binding(2) var<storage, read> ring_pages: array<u32>;
@group(0) @binding(3) var<storage, read_write> page_meta: array<PageMeta>;
@group(0) @binding(4) var<storage, read_write> victim: array<u32>;
@group(0) @binding(5) var<storage, read_write> move_src: array<u32>;
@group(0) @binding(6) var<storage, read_write> move_dst: array<u32>;
@group(0) @binding(7) var<storage, read_write> counts: array<vec2<u32>>;  // per ring: (moves, freed pages)
@group(0) @binding(8) var<storage, read_write> freed: array<u32>;

const WG: u32 = 256u;
var<workgroup> ring_sh: RingState;

fn slot_at(key: u32, ring: RingState, r: u32) -> u32 {
    let R = geo.ring_capacity;
    let page = ring_pages[key * R + (ring.head + r / geo.page_size) % R];
    return page * geo.page_size + r % geo.page_size;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let key = wg.x + wg.y * 65535u;
    let n_keys = geo.layers * geo.max_seqs * geo.kv_heads * geo.n_shards;
    if (key >= n_keys) {
        return;
    }
    if (t == 0u) {
        ring_sh = rings[key];
    }
    let ring = workgroupUniformLoad(&ring_sh);
    let P = geo.page_size;
    let RP = geo.ring_capacity * P;
    var n = 0u;
    if (ring.count > 0u) {
        n = (ring.count - 1u) * P + ring.fill;
    }
    let rounds = (n + WG - 1u) / WG;
    var v = 0u;
    for (var r = 0u; r < rounds; r++) {
        let i = r * WG + t;
        if (i < n && victim[slot_at(key, ring, i)] != 0u) {
            v += 1u;
        }
    }
    let victims = workgroup_scan(t, v);
    let total_v = workgroupUniformLoad(&scan[WG - 1u]);
    _ = victims;
    if (total_v == 0u) {
        if (t == 0u) {
            counts[key] = vec2<u32>(0u, 0u);
        }
        return;
    }
    let keep = n - total_v;
    // Holes (victims before `keep`) and movers (survivors from `keep` on), paired in order.
    var holes_before = 0u;
    var movers_before = 0u;
    for (var r = 0u; r < rounds; r++) {
        let i = r * WG + t;
        var is_hole = 0u;
        var is_mover = 0u;
        var slot = 0u;
        if (i < n) {
            slot = slot_at(key, ring, i);
            let vic = victim[slot] != 0u;
            if (i < keep && vic) {
                is_hole = 1u;
            }
            if (i >= keep && !vic) {
                is_mover = 1u;
            }
        }
        let h_incl = workgroup_scan(t, is_hole);
        let h_round = workgroupUniformLoad(&scan[WG - 1u]);
        let m_incl = workgroup_scan(t, is_mover);
        let m_round = workgroupUniformLoad(&scan[WG - 1u]);
        if (is_hole == 1u) {
            move_dst[key * RP + holes_before + h_incl - 1u] = slot;
        }
        if (is_mover == 1u) {
            move_src[key * RP + movers_before + m_incl - 1u] = slot;
        }
        holes_before += h_round;
        movers_before += m_round;
    }
    // Clear the marks, then the ring keeps ceil(keep / P) pages.
    for (var r = 0u; r < rounds; r++) {
        let i = r * WG + t;
        if (i < n) {
            victim[slot_at(key, ring, i)] = 0u;
        }
    }
    let kept_pages = (keep + P - 1u) / P;
    let R = geo.ring_capacity;
    for (var k = t; k < ring.count; k += WG) {
        let page = ring_pages[key * R + (ring.head + k) % R];
        if (k < kept_pages) {
            page_meta[page].fill = select(P, keep - (kept_pages - 1u) * P, k + 1u == kept_pages);
        } else {
            freed[key * R + k - kept_pages] = page;
        }
    }
    if (t == 0u) {
        var out = ring;
        out.count = kept_pages;
        out.fill = select(P, keep - (kept_pages - 1u) * P, kept_pages > 0u);
        rings[key] = out;
        counts[key] = vec2<u32>(holes_before, ring.count - kept_pages);
    }
}
