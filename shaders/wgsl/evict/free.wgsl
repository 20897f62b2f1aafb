// evict, pass 6: push the pages compaction freed onto the GPU free stack, rings in key order
// (deterministic reuse order), and count them. One workgroup.

//!import common/pool.wgsl
//!import common/scan.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<storage, read> counts: array<vec2<u32>>;
@group(0) @binding(2) var<storage, read> freed: array<u32>;
@group(0) @binding(3) var<storage, read_write> free_stack: array<u32>;
@group(0) @binding(4) var<storage, read_write> ctl: PoolCtl;
@group(0) @binding(5) var<storage, read_write> page_meta: array<PageMeta>;

const WG: u32 = 256u;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) t: u32) {
    let n_keys = geo.layers * geo.max_seqs * geo.kv_heads * geo.n_shards;
    let rounds = (n_keys + WG - 1u) / WG;
    let top = ctl.free_top;
    let R = geo.ring_capacity;
    var base = 0u;
    for (var r = 0u; r < rounds; r++) {
        let key = r * WG + t;
        var n = 0u;
        if (key < n_keys) {
            n = counts[key].y;
        }
        let incl = workgroup_scan(t, n);
        let round_total = workgroupUniformLoad(&scan[WG - 1u]);
        let first = top + base + incl - n;
        for (var k = 0u; k < n; k++) {
            let page = freed[key * R + k];
            free_stack[first + k] = page;
            page_meta[page].owner = NO_OWNER;
            page_meta[page].fill = 0u;
        }
        base += round_total;
        workgroupBarrier();
    }
    if (t == 0u) {
        ctl.free_top = top + base;
        ctl.pages_evicted += base;
    }
}
