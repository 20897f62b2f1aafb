// codec, pass 1: every full raw page that is no longer its ring's newest gets a compressed page
// from the codec free stack (rings in key order, pages oldest first: a deterministic order); the
// ring entry and the page metadata move to the compressed id, the raw page returns to the raw
// free stack. When compressed pages run out, the rest stay raw. Writes the jobs for
// compress/encode and the indirect dispatch size.
//
// Three entry points, so no invocation walks a whole ring alone (at 32K tokens a ring holds
// hundreds of pages, and a serial walk of dependent loads cost more than the step's attention):
//   count  (a workgroup per ring): its candidates, into counts[key];
//   main   (one workgroup): counts -> each ring's first job index (exclusive scan in key order),
//          the pool counters and the dispatch size; the counters it started from into state;
//   assign (a workgroup per ring): each candidate's job index = its ring's first + its rank
//          among the ring's candidates; those below the compressed pages available are moved.

//!import common/pool.wgsl
//!import common/scan.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<storage, read> rings: array<RingState>;
@group(0) @binding(2) var<storage, read_write> ring_pages: array<u32>;
@group(0) @binding(3) var<storage, read_write> page_meta: array<PageMeta>;
@group(0) @binding(4) var<storage, read_write> free_stack: array<u32>;
@group(0) @binding(5) var<storage, read_write> codec_free: array<u32>;
@group(0) @binding(6) var<storage, read_write> ctl: PoolCtl;
@group(0) @binding(7) var<storage, read_write> jobs: array<vec2<u32>>;  // (raw page, compressed id)
@group(0) @binding(8) var<storage, read_write> dispatch: array<u32>;    // x, y, z of compress/encode
@group(0) @binding(9) var<storage, read_write> counts: array<u32>;      // per ring: candidates, then first job index
@group(0) @binding(10) var<storage, read_write> state: array<u32>;      // compressed pages available, raw free top

const WG: u32 = 256u;

fn n_keys() -> u32 {
    return geo.layers * geo.max_seqs * geo.kv_heads * geo.n_shards;
}

fn candidate(key: u32, ring: RingState, k: u32) -> u32 {
    let page = ring_pages[key * geo.ring_capacity + (ring.head + k) % geo.ring_capacity];
    if (k + 1u < ring.count && page < geo.n_pages && page_meta[page].fill == geo.page_size) {
        return page;
    }
    return NO_OWNER;
}

@compute @workgroup_size(256)
fn count(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let key = wg.x + wg.y * 65535u;
    if (key >= n_keys()) {
        return;
    }
    let ring = rings[key];
    var n = 0u;
    for (var k = t; k < ring.count; k += WG) {
        if (candidate(key, ring, k) != NO_OWNER) {
            n += 1u;
        }
    }
    let total = workgroup_scan(t, n);
    if (t == WG - 1u) {
        counts[key] = total;
    }
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) t: u32) {
    let nk = n_keys();
    let avail = ctl.codec_free_top;
    let free_top = ctl.free_top;
    var base = 0u;
    for (var r = 0u; r < (nk + WG - 1u) / WG; r++) {
        let key = r * WG + t;
        var n = 0u;
        if (key < nk) {
            n = counts[key];
        }
        let incl = workgroup_scan(t, n);
        if (key < nk) {
            counts[key] = base + incl - n;
        }
        base += workgroupUniformLoad(&scan[WG - 1u]);
    }
    if (t == 0u) {
        let taken = min(base, avail);
        state[0] = avail;
        state[1] = free_top;
        ctl.codec_free_top = avail - taken;
        ctl.free_top = free_top + taken;
        dispatch[0] = taken;
        dispatch[1] = 1u;
        dispatch[2] = 1u;
    }
}

@compute @workgroup_size(256)
fn assign(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let key = wg.x + wg.y * 65535u;
    if (key >= n_keys()) {
        return;
    }
    let ring = rings[key];
    let avail = state[0];
    let free_top = state[1];
    let R = geo.ring_capacity;
    var idx0 = counts[key];
    for (var k0 = 0u; k0 < ring.count; k0 += WG) {
        let k = k0 + t;
        var raw = NO_OWNER;
        if (k < ring.count) {
            raw = candidate(key, ring, k);
        }
        let is = u32(raw != NO_OWNER);
        let incl = workgroup_scan(t, is);
        let idx = idx0 + incl - is;
        if (is != 0u && idx < avail) {
            let cid = codec_free[avail - 1u - idx];
            ring_pages[key * R + (ring.head + k) % R] = cid;
            page_meta[cid] = PageMeta(key, geo.page_size);
            page_meta[raw] = PageMeta(NO_OWNER, 0u);
            free_stack[free_top + idx] = raw;
            jobs[idx] = vec2<u32>(raw, cid);
        }
        idx0 += workgroupUniformLoad(&scan[WG - 1u]);
    }
}
