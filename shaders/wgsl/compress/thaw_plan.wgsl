// codec under eviction, pass 1 of 2 (after evict/select, before evict/compact): every compressed
// page a ring's compaction would touch (one holding a victim, or reaching past the ring's new
// length) is thawed. A raw page comes off the raw free stack, the ring entry and the page
// metadata move to it, the compressed id goes back on the codec free stack, and compress/thaw
// decodes the page into it; compaction then sees only raw pages, and the next compress pass
// re-encodes the pages that are full again. Rings in key order, pages oldest first (job index =
// the ring's first + the page's rank): a deterministic order, mirrored by the CPU pool model.
// A ring whose pages do not all fit in the raw pages free is deferred: its victim marks are
// cleared, so it keeps its tokens and evicts at a later step (counted in state).
//
//   count  (a workgroup per ring): touched compressed pages -> counts[key];
//   main   (one workgroup): counts -> each ring's first job index; the rings that fit (a prefix
//          in key order) and their pages; the pool counters and compress/thaw's dispatch size;
//   assign (a workgroup per ring): moves the pages of the rings that fit, clears the victim
//          marks of those that do not.

//!import common/pool.wgsl
//!import common/scan.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<storage, read> rings: array<RingState>;
@group(0) @binding(2) var<storage, read_write> ring_pages: array<u32>;
@group(0) @binding(3) var<storage, read_write> page_meta: array<PageMeta>;
@group(0) @binding(4) var<storage, read_write> free_stack: array<u32>;
@group(0) @binding(5) var<storage, read_write> codec_free: array<u32>;
@group(0) @binding(6) var<storage, read_write> ctl: PoolCtl;
@group(0) @binding(7) var<storage, read_write> jobs: array<vec2<u32>>;  // (compressed id, raw page)
@group(0) @binding(8) var<storage, read_write> dispatch: array<u32>;    // x, y, z of compress/thaw
@group(0) @binding(9) var<storage, read_write> counts: array<u32>;      // per ring: touched, then first job index
// raw free top, codec free top before this pass; pages thawed and rings deferred by it; then
// both summed over every eviction so far.
@group(0) @binding(10) var<storage, read_write> state: array<u32>;
@group(0) @binding(11) var<storage, read_write> victim: array<u32>;

const WG: u32 = 256u;
var<workgroup> ring_sh: RingState;
var<workgroup> taken_sh: atomic<u32>;
var<workgroup> deferred_sh: atomic<u32>;
var<workgroup> fits_sh: u32;

fn n_keys() -> u32 {
    return geo.layers * geo.max_seqs * geo.kv_heads * geo.n_shards;
}

fn page_at(key: u32, ring: RingState, k: u32) -> u32 {
    return ring_pages[key * geo.ring_capacity + (ring.head + k) % geo.ring_capacity];
}

// Tokens in the ring.
fn ring_tokens(ring: RingState) -> u32 {
    if (ring.count == 0u) {
        return 0u;
    }
    return (ring.count - 1u) * geo.page_size + ring.fill;
}

// Victims marked in the ring (the same total in every invocation).
fn ring_victims(key: u32, ring: RingState, t: u32) -> u32 {
    let P = geo.page_size;
    let n = ring_tokens(ring);
    var v = 0u;
    for (var i = t; i < n; i += WG) {
        let slot = page_at(key, ring, i / P) * P + i % P;
        if (victim[slot] != 0u) {
            v += 1u;
        }
    }
    _ = workgroup_scan(t, v);
    return workgroupUniformLoad(&scan[WG - 1u]);
}

// Whether page k of the ring is compressed and compaction will touch it: a victim in it, or a
// slot at or past `keep` (compressed pages are full).
fn touched(key: u32, ring: RingState, k: u32, keep: u32) -> bool {
    let P = geo.page_size;
    let page = page_at(key, ring, k);
    if (k >= ring.count || page < geo.n_pages) {
        return false;
    }
    if ((k + 1u) * P > keep) {
        return true;
    }
    for (var s = 0u; s < P; s++) {
        if (victim[page * P + s] != 0u) {
            return true;
        }
    }
    return false;
}

// Touched pages of the ring (the same total in every invocation).
fn ring_touched(key: u32, ring: RingState, keep: u32, t: u32) -> u32 {
    var n = 0u;
    for (var k = t; k < ring.count; k += WG) {
        if (touched(key, ring, k, keep)) {
            n += 1u;
        }
    }
    _ = workgroup_scan(t, n);
    return workgroupUniformLoad(&scan[WG - 1u]);
}

@compute @workgroup_size(256)
fn count(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let key = wg.x + wg.y * 65535u;
    if (key >= n_keys()) {
        return;
    }
    if (t == 0u) {
        ring_sh = rings[key];
    }
    let ring = workgroupUniformLoad(&ring_sh);
    let v = ring_victims(key, ring, t);
    var n = 0u;
    if (v > 0u) {
        n = ring_touched(key, ring, ring_tokens(ring) - v, t);
    }
    if (t == 0u) {
        counts[key] = n;
    }
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) t: u32) {
    let nk = n_keys();
    let avail = ctl.free_top;
    let codec_top = ctl.codec_free_top;
    if (t == 0u) {
        atomicStore(&taken_sh, 0u);
        atomicStore(&deferred_sh, 0u);
    }
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
            // Ends are non-decreasing in key order, so the rings that fit are a prefix.
            let end = base + incl;
            if (n > 0u) {
                if (end <= avail) {
                    atomicMax(&taken_sh, end);
                } else {
                    atomicAdd(&deferred_sh, 1u);
                }
            }
        }
        base += workgroupUniformLoad(&scan[WG - 1u]);
    }
    workgroupBarrier();
    if (t == 0u) {
        let taken = atomicLoad(&taken_sh);
        let deferred = atomicLoad(&deferred_sh);
        state[0] = avail;
        state[1] = codec_top;
        state[2] = taken;
        state[3] = deferred;
        state[4] += taken;
        state[5] += deferred;
        ctl.free_top = avail - taken;
        ctl.codec_free_top = codec_top + taken;
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
    if (t == 0u) {
        ring_sh = rings[key];
    }
    let ring = workgroupUniformLoad(&ring_sh);
    let v = ring_victims(key, ring, t);
    if (v == 0u) {
        return;
    }
    let P = geo.page_size;
    let n = ring_tokens(ring);
    let keep = n - v;
    let total = ring_touched(key, ring, keep, t);
    if (total == 0u) {
        return;
    }
    let avail = state[0];
    let first = counts[key];
    if (t == 0u) {
        fits_sh = u32(first + total <= avail);
    }
    if (workgroupUniformLoad(&fits_sh) == 0u) {
        // Deferred: the ring keeps every token this step.
        for (var i = t; i < n; i += WG) {
            victim[page_at(key, ring, i / P) * P + i % P] = 0u;
        }
        return;
    }
    let codec_top = state[1];
    let R = geo.ring_capacity;
    var idx0 = first;
    for (var k0 = 0u; k0 < ring.count; k0 += WG) {
        let k = k0 + t;
        let is = u32(touched(key, ring, k, keep));
        let incl = workgroup_scan(t, is);
        if (is != 0u) {
            let idx = idx0 + incl - 1u;
            let cid = page_at(key, ring, k);
            let raw = free_stack[avail - 1u - idx];
            ring_pages[key * R + (ring.head + k) % R] = raw;
            page_meta[raw] = PageMeta(key, P);
            page_meta[cid] = PageMeta(NO_OWNER, 0u);
            codec_free[codec_top + idx] = cid;
            jobs[idx] = vec2<u32>(cid, raw);
        }
        idx0 += workgroupUniformLoad(&scan[WG - 1u]);
    }
}
