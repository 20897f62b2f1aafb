// codec, pass 1 (one workgroup): every full raw page that is no longer its ring's newest gets a
// compressed page from the codec free stack (rings in key order, pages oldest first: a
// deterministic order); the ring entry and the page metadata move to the compressed id, the raw
// page returns to the raw free stack. When compressed pages run out, the rest stay raw. Writes
// the jobs for codec/encode and the indirect dispatch size.

//!import common/pool.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<storage, read> rings: array<RingState>;
@group(0) @binding(2) var<storage, read_write> ring_pages: array<u32>;
@group(0) @binding(3) var<storage, read_write> page_meta: array<PageMeta>;
@group(0) @binding(4) var<storage, read_write> free_stack: array<u32>;
@group(0) @binding(5) var<storage, read_write> codec_free: array<u32>;
@group(0) @binding(6) var<storage, read_write> ctl: PoolCtl;
@group(0) @binding(7) var<storage, read_write> jobs: array<vec2<u32>>;  // (raw page, compressed id)
@group(0) @binding(8) var<storage, read_write> dispatch: array<u32>;    // x, y, z of codec/encode

const WG: u32 = 256u;
var<workgroup> scan: array<u32, 256>;

fn workgroup_scan(t: u32, v: u32) -> u32 {
    scan[t] = v;
    workgroupBarrier();
    for (var off = 1u; off < WG; off = off * 2u) {
        var add = 0u;
        if (t >= off) {
            add = scan[t - off];
        }
        workgroupBarrier();
        scan[t] += add;
        workgroupBarrier();
    }
    let r = scan[t];
    workgroupBarrier();
    return r;
}

fn candidate(key: u32, ring: RingState, k: u32) -> u32 {
    let page = ring_pages[key * geo.ring_capacity + (ring.head + k) % geo.ring_capacity];
    if (k + 1u < ring.count && page < geo.n_pages && page_meta[page].fill == geo.page_size) {
        return page;
    }
    return NO_OWNER;
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) t: u32) {
    let n_keys = geo.layers * geo.max_seqs * geo.kv_heads * geo.n_shards;
    let rounds = (n_keys + WG - 1u) / WG;
    let avail = ctl.codec_free_top;
    let free_top = ctl.free_top;
    let R = geo.ring_capacity;
    var base = 0u;
    for (var r = 0u; r < rounds; r++) {
        let key = r * WG + t;
        var ring: RingState;
        var n = 0u;
        if (key < n_keys) {
            ring = rings[key];
            for (var k = 0u; k < ring.count; k++) {
                if (candidate(key, ring, k) != NO_OWNER) {
                    n += 1u;
                }
            }
        }
        let incl = workgroup_scan(t, n);
        let round_total = workgroupUniformLoad(&scan[WG - 1u]);
        var idx = base + incl - n;
        if (n > 0u) {
            for (var k = 0u; k < ring.count; k++) {
                let raw = candidate(key, ring, k);
                if (raw == NO_OWNER || idx >= avail) {
                    continue;
                }
                let cid = codec_free[avail - 1u - idx];
                ring_pages[key * R + (ring.head + k) % R] = cid;
                page_meta[cid] = PageMeta(key, geo.page_size);
                page_meta[raw] = PageMeta(NO_OWNER, 0u);
                free_stack[free_top + idx] = raw;
                jobs[idx] = vec2<u32>(raw, cid);
                idx += 1u;
            }
        }
        base += round_total;
        workgroupBarrier();
    }
    if (t == 0u) {
        let taken = min(base, avail);
        ctl.codec_free_top = avail - taken;
        ctl.free_top = free_top + taken;
        dispatch[0] = taken;
        dispatch[1] = 1u;
        dispatch[2] = 1u;
    }
}
