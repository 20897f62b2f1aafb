// Release the oldest pages of shard rings back to the GPU free stacks (finished sequences,
// ring-level eviction). counts[key] pages are popped from ring `key` (at most what it holds);
// raw pages go back to the raw free stack and compressed pages (ids from n_pages on) to the
// compressed one, each in key order, oldest first, so reuse order is deterministic. One
// workgroup.

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
@group(0) @binding(8) var<storage, read_write> codec_free: array<u32>;

const WG: u32 = 256u;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) t: u32) {
    let rounds = (params.n_keys + WG - 1u) / WG;
    let top = ctl.free_top;
    let codec_top = ctl.codec_free_top;
    let R = geo.ring_capacity;
    var base = 0u;
    var codec_base = 0u;
    for (var r = 0u; r < rounds; r++) {
        let key = r * WG + t;
        var n = 0u;
        var n_codec = 0u;
        var ring: RingState;
        if (key < params.n_keys) {
            ring = rings[key];
            n = min(counts[key], ring.count);
            for (var k = 0u; k < n; k++) {
                if (ring_pages[key * R + (ring.head + k) % R] >= geo.n_pages) {
                    n_codec += 1u;
                }
            }
        }
        let incl = workgroup_scan(t, n - n_codec);
        let round_total = workgroupUniformLoad(&scan[WG - 1u]);
        workgroupBarrier();
        let incl_codec = workgroup_scan(t, n_codec);
        let round_codec = workgroupUniformLoad(&scan[WG - 1u]);
        if (n > 0u) {
            var raw_at = top + base + incl - (n - n_codec);
            var codec_at = codec_top + codec_base + incl_codec - n_codec;
            for (var k = 0u; k < n; k++) {
                let page = ring_pages[key * R + (ring.head + k) % R];
                if (page >= geo.n_pages) {
                    codec_free[codec_at] = page;
                    codec_at += 1u;
                } else {
                    free_stack[raw_at] = page;
                    raw_at += 1u;
                }
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
        codec_base += round_codec;
        workgroupBarrier();
    }
    if (t == 0u) {
        ctl.free_top = top + base;
        ctl.codec_free_top = codec_top + codec_base;
        ctl.pages_released += base + codec_base;
    }
}
