// Release the oldest pages of shard rings back to the GPU free stack (finished sequences,
// ring-level eviction). counts[key] pages are popped from ring `key` (at most what it holds);
// they are pushed in key order, oldest first, so reuse order is deterministic. One workgroup.

//!import common/pool.wgsl
//!import common/scan.wgsl

// must match `ReleaseParams` in core/src/gpu_data.rs
struct ReleaseParams {
    n_keys: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: ReleaseParams;
@group(0) @binding(2) var<storage, read> counts: array<u32>;
@group(0) @binding(3) var<storage, read_write> rings: array<RingState>;
@group(0) @binding(4) var<storage, read> ring_pages: array<u32>;
@group(0) @binding(5) var<storage, read_write> free_stack: array<u32>;
@group(0) @binding(6) var<storage, read_write> ctl: PoolCtl;
@group(0) @binding(7) var<storage, read_write> page_meta: array<PageMeta>;

const WG: u32 = 256u;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) t: u32) {
    let rounds = (params.n_keys + WG - 1u) / WG;
    let top = ctl.free_top;
    let R = geo.ring_capacity;
    var base = 0u;
    for (var r = 0u; r < rounds; r++) {
        let key = r * WG + t;
        var n = 0u;
        var ring: RingState;
        if (key < params.n_keys) {
            ring = rings[key];
            n = min(counts[key], ring.count);
        }
        let incl = workgroup_scan(t, n);
        let round_total = workgroupUniformLoad(&scan[WG - 1u]);
        if (n > 0u) {
            let first = top + base + incl - n;
            for (var k = 0u; k < n; k++) {
                let page = ring_pages[key * R + (ring.head + k) % R];
                free_stack[first + k] = page;
                page_meta[page].owner = NO_OWNER;
                page_meta[page].fill = 0u;
            }
            ring.head = (ring.head + n) % R;
            ring.count -= n;
            if (ring.count == 0u) {
                ring.fill = geo.page_size;
            }
            rings[key] = ring;
        }
        base += round_total;
        workgroupBarrier();
    }
    if (t == 0u) {
        ctl.free_top = top + base;
        ctl.pages_released += base;
    }
}
