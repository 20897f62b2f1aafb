// Raw pages (f16 or f32 rows) read a pair of dimensions at a time by the portable kernels that
// attend them (attend/split_tiled, attend/prefill): the scaled queries in workgroup memory, a
// key row's dot product with one of them, and a page's values folded into the value sums the
// invocations own (attend/online_softmax.wgsl's layout: pair slot e = t + k WG of
// (query head, pair of dimensions)).

//!import common/pool.wgsl
//!import common/window.wgsl
//!import attend/online_softmax.wgsl
//!expects @group(0) @binding(0) var<uniform> geo: Geometry;
//!expects @group(0) @binding(1) var<uniform> params: AttendParams;
//!expects @group(0) @binding(2) var<uniform> window: PoolWindow;
//!expects @group(0) @binding(3) var<storage, read> page_list: array<u32>;
//!expects @group(0) @binding(5) var<storage, read> page_meta: array<PageMeta>;
//!expects @group(0) @binding(6) var<storage, read> pool: array<u32>;
//!expects @group(0) @binding(7) var<storage, read> queries: array<f32>;
//!expects @group(0) @binding(8) var<storage, read_write> partials: array<f32>;
//!expects fn attends(page: u32) -> bool { return page > 0u; }

var<workgroup> q_sh: array<f32, 2048>;  // [group][d], pre-scaled

// The n_heads x d scaled queries from word q0 of `queries` on.
fn load_queries(t: u32, q0: u32, n: u32) {
    for (var i = t; i < n; i += WG) {
        q_sh[i] = queries[q0 + i] * params.scale;
    }
}

fn load_pair(word: u32) -> vec2<f32> {
    if (geo.f16_kv != 0u) {
        return unpack2x16float(pool[word]);
    }
    return vec2<f32>(bitcast<f32>(pool[2u * word]), bitcast<f32>(pool[2u * word + 1u]));
}

// The pair index of the page's K block (x) and of its V block (y), in the window's buffer
// (f16: one word a pair).
fn page_pairs(page: u32) -> vec2<u32> {
    let pair_scale = select(2u, 1u, geo.f16_kv != 0u);
    let k_base = ((page - window.first_page) * geo.page_words) / pair_scale;
    return vec2<u32>(k_base, k_base + block_words(geo) / pair_scale);
}

// Query head g's scaled score against the key row whose first pair is `row`.
fn key_dot(row: u32, g: u32, d: u32) -> f32 {
    let half_d = d / 2u;
    var dot = 0.0;
    for (var j = 0u; j < half_d; j++) {
        let kv = load_pair(row + j);
        dot += kv.x * q_sh[g * d + 2u * j] + kv.y * q_sh[g * d + 2u * j + 1u];
    }
    return dot;
}

// The value sums rescaled by the page's factors (f_sh) plus its first `fill` value rows, from
// pair v_base on, weighted by their probabilities (p_sh).
fn fold_values(t: u32, acc: array<vec2<f32>, MAX_PAIRS>, n_heads: u32, d: u32, v_base: u32, fill: u32) -> array<vec2<f32>, MAX_PAIRS> {
    let half_d = d / 2u;
    var r = acc;
    for (var k = 0u; k < MAX_PAIRS; k++) {
        let e = t + k * WG;
        if (e < n_heads * half_d) {
            let g = e / half_d;
            let j = e % half_d;
            var a = r[k] * f_sh[g];
            for (var s = 0u; s < fill; s++) {
                a += p_sh[g * MAX_PAGE + s] * load_pair(v_base + s * half_d + j);
            }
            r[k] = a;
        }
    }
    return r;
}
