// evict, capture into the recall tier, second pass: once per pool buffer, an invocation per slot
// of the buffer copies a slot evict/capture.wgsl planned (K and V words, position) into its tier
// slot and clears the plan.

//!import common/pool.wgsl
//!import common/window.wgsl
//!import common/recall.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> window: PoolWindow;
@group(0) @binding(2) var<storage, read_write> capture_dst: array<u32>;
@group(0) @binding(3) var<storage, read> slot_meta: array<u32>;
@group(0) @binding(4) var<storage, read> pool: array<u32>;
@group(0) @binding(5) var<storage, read_write> tier_kv: array<u32>;
@group(0) @binding(6) var<storage, read_write> tier_pos: array<u32>;

@compute @workgroup_size(64)
fn copy(@builtin(global_invocation_id) gid: vec3<u32>) {
    let P = geo.page_size;
    let i = gid.x + gid.y * 65535u * 64u;
    if (i >= window.page_count * P) {
        return;
    }
    let slot = window.first_page * P + i;
    let at = capture_dst[slot];
    if (at == TIER_NONE) {
        return;
    }
    capture_dst[slot] = TIER_NONE;
    let vw = geo.vec_words;
    let src = (i / P) * geo.page_words + (i % P) * vw;
    let dst = (at / P) * geo.page_words + (at % P) * vw;
    let block = P * vw;
    for (var w = 0u; w < vw; w++) {
        tier_kv[dst + w] = pool[src + w];
        tier_kv[dst + block + w] = pool[src + block + w];
    }
    tier_pos[at] = slot_meta[slot * geo.meta_words + META_POSITION];
}
