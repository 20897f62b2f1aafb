// codec, low-rank fit, pass 1: the d x d Gram matrix sum_t x_t x_t^T of every (layer, KV head)
// (low-rank) or layer (LoRA: pooled over its heads), keys and values apart, over the raw pages
// cached now (the calibration window). One invocation per entry; run once per raw pool buffer,
// adding into a cleared `gram`. Reads the gathered page lists.

//!import common/pool.wgsl
//!import common/window.wgsl
//!import common/compress.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> window: PoolWindow;
@group(0) @binding(2) var<storage, read> page_list: array<u32>;
@group(0) @binding(3) var<storage, read> page_counts: array<u32>;
@group(0) @binding(4) var<storage, read> page_meta: array<PageMeta>;
@group(0) @binding(5) var<storage, read> pool: array<u32>;
@group(0) @binding(6) var<storage, read_write> gram: array<f32>;

fn raw(base: u32, kv: u32, s: u32, i: u32) -> f32 {
    let w = pool[base + kv * block_words(geo) + s * geo.vec_words + i / 2u];
    let pair = unpack2x16float(w);
    return select(pair.x, pair.y, (i & 1u) == 1u);
}

// grid: x = entry (row-major i * d + j) in 64-wide groups, y = fit (layer * heads_fit + head),
// z = K (0) or V (1).
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let D = geo.head_dim;
    let e = gid.x;
    if (e >= D * D) {
        return;
    }
    let i = e / D;
    let j = e % D;
    let kv = gid.z;
    let lora = geo.codec == CODEC_LORA;
    let heads_fit = select(geo.kv_heads, 1u, lora);
    let layer = gid.y / heads_fit;
    var h0 = gid.y % heads_fit;
    var h1 = h0 + 1u;
    if (lora) {
        h0 = 0u;
        h1 = geo.kv_heads;
    }
    var acc = 0.0;
    for (var seq = 0u; seq < geo.max_seqs; seq++) {
        for (var h = h0; h < h1; h++) {
            let li = list_index(geo, layer, seq, h);
            let n = page_counts[li];
            for (var pi = 0u; pi < n; pi++) {
                let page = page_list[li * geo.max_pages_per_seq + pi];
                if (page >= geo.n_pages || !in_window(window, page)) {
                    continue;
                }
                let fill = page_meta[page].fill;
                let base = (page - window.first_page) * geo.page_words;
                for (var s = 0u; s < fill; s++) {
                    acc += raw(base, kv, s, i) * raw(base, kv, s, j);
                }
            }
        }
    }
    let g = (gid.y * 2u + kv) * D * D + e;
    gram[g] += acc;
}
