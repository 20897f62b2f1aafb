// QUEST, pass 1: per-page bounds of the keys: min and max of every dimension over the page's
// slots. A page is summarised again only when its (owner, fill, generation) changed since its
// last summary: every pass that writes a page's K/V (append, compaction's moves, thaw) raises
// its generation, so a page rewritten with the same owner, fill and positions (a sequence
// released and started again, tokens compacted into a full page) is summarised again. One
// workgroup per page, dispatched once per pool buffer.

//!import common/pool.wgsl
//!import common/window.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> window: PoolWindow;
@group(0) @binding(2) var<storage, read> page_meta: array<PageMeta>;
@group(0) @binding(3) var<storage, read> page_gen: array<u32>;      // [page], raised by every write
@group(0) @binding(4) var<storage, read> pool: array<u32>;
@group(0) @binding(5) var<storage, read_write> bounds: array<f32>;      // [page][min d | max d]
@group(0) @binding(6) var<storage, read_write> tags: array<vec4<u32>>;  // [page]: owner, fill, generation, valid

var<workgroup> go: u32;

fn value(word: u32, i: u32) -> f32 {
    if (geo.f16_kv != 0u) {
        let pair = unpack2x16float(word);
        return select(pair.x, pair.y, (i & 1u) == 1u);
    }
    return bitcast<f32>(word);
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let page = window.first_page + wg.x + wg.y * 65535u;
    if (wg.x + wg.y * 65535u >= window.page_count) {
        return;
    }
    let pm = page_meta[page];
    if (t == 0u) {
        var g = 0u;
        if (pm.owner != NO_OWNER && pm.fill > 0u) {
            let tag = vec4<u32>(pm.owner, pm.fill, page_gen[page], 1u);
            if (any(tag != tags[page])) {
                tags[page] = tag;
                g = 1u;
            }
        }
        go = g;
    }
    if (workgroupUniformLoad(&go) == 0u) {
        return;
    }
    let D = geo.head_dim;
    let local = page - window.first_page;
    for (var i = t; i < D; i += 64u) {
        var lo = 3.4e38;
        var hi = -3.4e38;
        for (var s = 0u; s < pm.fill; s++) {
            let word_index = local * geo.page_words + s * geo.vec_words + select(i, i / 2u, geo.f16_kv != 0u);
            let v = value(pool[word_index], i);
            lo = min(lo, v);
            hi = max(hi, v);
        }
        bounds[page * 2u * D + i] = lo;
        bounds[page * 2u * D + D + i] = hi;
    }
}
