// evict, pass 5: copy each mover (K, V and slot metadata) into its hole. Dispatched once per
// (source buffer, destination buffer) pair of the pool; an invocation per possible move
// (ring x slot) acts only on moves between those two buffers. `same` binds one pool buffer,
// `cross` a source and a destination buffer. Metadata moves in the dispatch that moves the data;
// the destination page's generation (`page_gen`) rises.

//!import common/pool.wgsl
//!import common/window.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> src_window: PoolWindow;
@group(0) @binding(2) var<uniform> dst_window: PoolWindow;
@group(0) @binding(3) var<storage, read> move_src: array<u32>;
@group(0) @binding(4) var<storage, read> move_dst: array<u32>;
@group(0) @binding(5) var<storage, read> counts: array<vec2<u32>>;
@group(0) @binding(6) var<storage, read_write> slot_meta: array<u32>;
@group(0) @binding(7) var<storage, read_write> pool: array<u32>;
@group(0) @binding(8) var<storage, read> pool_src: array<u32>;
@group(0) @binding(9) var<storage, read_write> page_gen: array<atomic<u32>>;

struct Move {
    ok: bool,
    src: u32,  // global slots
    dst: u32,
}

fn find(gid: vec3<u32>) -> Move {
    var m: Move;
    let g = gid.x + gid.y * 65535u * 64u;
    let RP = geo.ring_capacity * geo.page_size;
    let key = g / RP;
    let i = g % RP;
    let n_keys = geo.layers * geo.max_seqs * geo.kv_heads * geo.n_shards;
    if (key >= n_keys || i >= counts[key].x) {
        return m;
    }
    m.src = move_src[g];
    m.dst = move_dst[g];
    m.ok = in_window(src_window, m.src / geo.page_size) && in_window(dst_window, m.dst / geo.page_size);
    return m;
}

fn move_meta(mv: Move) {
    let w = geo.meta_words;
    for (var k = 0u; k < w; k++) {
        slot_meta[mv.dst * w + k] = slot_meta[mv.src * w + k];
    }
    atomicAdd(&page_gen[mv.dst / geo.page_size], 1u);
}

// Word offset of a slot's K row (V follows block_words later) within its buffer.
fn row(w: PoolWindow, slot: u32) -> u32 {
    let P = geo.page_size;
    return (slot / P - w.first_page) * geo.page_words + (slot % P) * geo.vec_words;
}

@compute @workgroup_size(64)
fn same(@builtin(global_invocation_id) gid: vec3<u32>) {
    let mv = find(gid);
    if (!mv.ok) {
        return;
    }
    let s = row(src_window, mv.src);
    let d = row(dst_window, mv.dst);
    let bw = block_words(geo);
    for (var j = 0u; j < geo.vec_words; j++) {
        pool[d + j] = pool[s + j];
        pool[d + bw + j] = pool[s + bw + j];
    }
    move_meta(mv);
}

@compute @workgroup_size(64)
fn cross(@builtin(global_invocation_id) gid: vec3<u32>) {
    let mv = find(gid);
    if (!mv.ok) {
        return;
    }
    let s = row(src_window, mv.src);
    let d = row(dst_window, mv.dst);
    let bw = block_words(geo);
    for (var j = 0u; j < geo.vec_words; j++) {
        pool[d + j] = pool_src[s + j];
        pool[d + bw + j] = pool_src[s + bw + j];
    }
    move_meta(mv);
}
