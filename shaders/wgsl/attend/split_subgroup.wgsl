// attend_decode, split pass, fast variant (needs subgroups of at least LANES invocations;
// naga takes subgroup builtins without `enable subgroups;`, browsers need it: the runtime
// prepends it on the web):
// LANES invocations of a subgroup share one token, each loading VPL 16-byte words of its K and
// V rows (coalesced), and combine partial dot products with subgroup shuffles. A workgroup of
// WG invocations runs WG / LANES such token groups over a chunk of pages, U tokens in flight
// per group, each group keeping an online softmax; the groups merge in workgroup memory and
// write one partial per query head. Same partial layout and scores as split_tiled.wgsl.

//!import common/pool.wgsl
//!import common/window.wgsl
//!import attend/common.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: AttendParams;
@group(0) @binding(2) var<uniform> window: PoolWindow;
@group(0) @binding(3) var<storage, read> page_list: array<u32>;
@group(0) @binding(4) var<storage, read> page_counts: array<u32>;
@group(0) @binding(5) var<storage, read> page_meta: array<PageMeta>;
@group(0) @binding(6) var<storage, read> pool: array<vec4<u32>>;
@group(0) @binding(7) var<storage, read> queries: array<f32>;
@group(0) @binding(8) var<storage, read_write> partials: array<f32>;
@group(0) @binding(9) var<storage, read_write> scores: array<f32>;

override GROUP: u32 = 4u;   // query heads per KV head
override LANES: u32 = 16u;  // invocations per token (power of two, <= subgroup size)
override VPL: u32 = 1u;     // vec4<u32> per lane per K (or V) row: LANES * VPL * 4 = vec_words
override F16: bool = true;  // K/V as packed f16 pairs (else f32)

const WG: u32 = 128u;
const U: u32 = 2u;          // tokens in flight per token group
const MAX_G: u32 = 8u;
const MAX_VPL: u32 = 4u;
const MAX_NQ: u32 = 8u;     // vec4<f32> of values per lane per row: VPL * (2 if F16 else 1)
const MAX_CHUNK_PAGES: u32 = 64u;

var<workgroup> chunk_page: array<u32, 64>;
var<workgroup> chunk_fill: array<u32, 64>;
var<workgroup> ml_sh: array<vec2<f32>, 256>;   // [token group][query head]
var<workgroup> acc_sh: array<vec4<f32>, 512>;  // [query head][d / 4]
var<workgroup> count_sh: u32;

fn nq() -> u32 {
    return select(VPL, 2u * VPL, F16);
}

// Value n (0..nq) of a lane's row, given the 16-byte word that holds it.
fn unpack_value(w: vec4<u32>, n: u32) -> vec4<f32> {
    if (F16) {
        if ((n & 1u) == 0u) {
            return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
        }
        return vec4<f32>(unpack2x16float(w.z), unpack2x16float(w.w));
    }
    return bitcast<vec4<f32>>(w);
}

// Which of the lane's VPL words holds value n.
fn word_of(n: u32) -> u32 {
    return select(n, n / 2u, F16);
}

// Index (in units of 4 dimensions) of value n of this lane's row.
fn dim4_of(lane: u32, n: u32) -> u32 {
    if (F16) {
        return 2u * (lane + (n / 2u) * LANES) + (n & 1u);
    }
    return lane + n * LANES;
}

fn lane_sum(x: f32) -> f32 {
    var v = x;
    for (var m = LANES / 2u; m > 0u; m = m / 2u) {
        v += subgroupShuffleXor(v, m);
    }
    return v;
}

@compute @workgroup_size(128)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) t: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_id) sg_id: u32,
) {
    let chunk = wg.x;
    let kvh = wg.y;
    let seq = wg.z;
    let D = geo.head_dim;
    let D4 = D / 4u;
    let P = geo.page_size;
    let lane = sg_lane % LANES;
    let groups_per_sg = sg_size / LANES;
    let tg = sg_id * groups_per_sg + sg_lane / LANES;
    let n_tg = WG / LANES;

    if (t == 0u) {
        count_sh = page_counts[params.layer * geo.max_seqs + seq];
    }
    let n_pages = workgroupUniformLoad(&count_sh);
    let first = chunk * params.chunk_pages;
    let list = (params.layer * geo.max_seqs + seq) * geo.max_pages_per_seq;
    for (var c = t; c < params.chunk_pages; c += WG) {
        var page = 0u;
        var fill = 0u;
        if (first + c < n_pages) {
            page = page_list[list + first + c];
            if (in_window(window, page)) {
                fill = page_meta[page].fill;
            }
        }
        chunk_page[c] = page - window.first_page;
        chunk_fill[c] = fill;
    }
    workgroupBarrier();

    // This lane's slice of the query heads of this KV head, pre-scaled.
    var q: array<vec4<f32>, 64>;  // [g * MAX_NQ + n]
    let q0 = (seq * params.q_heads + kvh * GROUP) * D;
    for (var g = 0u; g < GROUP; g++) {
        for (var n = 0u; n < nq(); n++) {
            let d = q0 + g * D + 4u * dim4_of(lane, n);
            q[g * MAX_NQ + n] = vec4<f32>(queries[d], queries[d + 1u], queries[d + 2u], queries[d + 3u]) * params.scale;
        }
    }
    var acc: array<vec4<f32>, 64>;
    var m: array<f32, 8>;
    var l: array<f32, 8>;
    for (var g = 0u; g < GROUP; g++) {
        m[g] = NEG_BIG;
        l[g] = 0.0;
        for (var n = 0u; n < nq(); n++) {
            acc[g * MAX_NQ + n] = vec4<f32>(0.0);
        }
    }

    let vw4 = geo.vec_words / 4u;
    let page_w4 = geo.page_words / 4u;
    let v_off4 = block_words(geo) / 4u;
    let slots = params.chunk_pages * P;
    let iters = (slots + n_tg * U - 1u) / (n_tg * U);
    for (var it = 0u; it < iters; it++) {
        var kraw: array<array<vec4<u32>, 4>, 2>;
        var vraw: array<array<vec4<u32>, 4>, 2>;
        var valid: array<bool, 2>;
        var slot_of: array<u32, 2>;
        for (var u = 0u; u < U; u++) {
            let j = tg + (it * U + u) * n_tg;
            let c = min(j / P, MAX_CHUNK_PAGES - 1u);
            let s = j % P;
            let ok = j < slots && s < chunk_fill[c];
            valid[u] = ok;
            slot_of[u] = j;
            if (ok) {
                let row = chunk_page[c] * page_w4 + (kvh * P + s) * vw4 + lane;
                for (var i = 0u; i < VPL; i++) {
                    kraw[u][i] = pool[row + i * LANES];
                    vraw[u][i] = pool[row + v_off4 + i * LANES];
                }
            } else {
                for (var i = 0u; i < VPL; i++) {
                    kraw[u][i] = vec4<u32>(0u);
                    vraw[u][i] = vec4<u32>(0u);
                }
            }
        }
        for (var g = 0u; g < GROUP; g++) {
            var sc: array<f32, 2>;
            var m_new = m[g];
            for (var u = 0u; u < U; u++) {
                var part = 0.0;
                for (var n = 0u; n < nq(); n++) {
                    part += dot(q[g * MAX_NQ + n], unpack_value(kraw[u][word_of(n)], n));
                }
                let s = lane_sum(part);
                sc[u] = select(NEG_BIG, s, valid[u]);
                m_new = max(m_new, sc[u]);
                if (valid[u] && params.write_scores != 0u && lane == 0u) {
                    let j = slot_of[u];
                    scores[(seq * params.q_heads + kvh * GROUP + g) * params.max_tokens + first * P + j] = s;
                }
            }
            let corr = exp(m[g] - m_new);
            var lsum = l[g] * corr;
            for (var n = 0u; n < nq(); n++) {
                acc[g * MAX_NQ + n] *= corr;
            }
            for (var u = 0u; u < U; u++) {
                let p = select(0.0, exp(sc[u] - m_new), valid[u]);
                lsum += p;
                for (var n = 0u; n < nq(); n++) {
                    acc[g * MAX_NQ + n] += p * unpack_value(vraw[u][word_of(n)], n);
                }
            }
            m[g] = m_new;
            l[g] = lsum;
        }
    }

    // Merge the token groups of this workgroup.
    if (lane == 0u) {
        for (var g = 0u; g < GROUP; g++) {
            ml_sh[tg * GROUP + g] = vec2<f32>(m[g], l[g]);
        }
    }
    workgroupBarrier();
    var big_m: array<f32, 8>;
    var big_l: array<f32, 8>;
    for (var g = 0u; g < GROUP; g++) {
        var mm = NEG_BIG;
        for (var r = 0u; r < n_tg; r++) {
            mm = max(mm, ml_sh[r * GROUP + g].x);
        }
        var ll = 0.0;
        for (var r = 0u; r < n_tg; r++) {
            let e = ml_sh[r * GROUP + g];
            ll += e.y * exp(e.x - mm);
        }
        big_m[g] = mm;
        big_l[g] = ll;
    }
    for (var r = 0u; r < n_tg; r++) {
        if (tg == r) {
            for (var g = 0u; g < GROUP; g++) {
                let f = exp(m[g] - big_m[g]);
                for (var n = 0u; n < nq(); n++) {
                    let a = g * D4 + dim4_of(lane, n);
                    var prev = vec4<f32>(0.0);
                    if (r > 0u) {
                        prev = acc_sh[a];
                    }
                    acc_sh[a] = prev + acc[g * MAX_NQ + n] * f;
                }
            }
        }
        workgroupBarrier();
    }
    let stride = partial_stride(D);
    for (var e = t; e < GROUP * D4; e += WG) {
        let g = e / D4;
        let o = partial_index(params, seq, kvh * GROUP + g, window.buffer_index, chunk) * stride + 4u + 4u * (e % D4);
        let a = acc_sh[e];
        partials[o] = a.x;
        partials[o + 1u] = a.y;
        partials[o + 2u] = a.z;
        partials[o + 3u] = a.w;
    }
    if (t < GROUP) {
        let o = partial_index(params, seq, kvh * GROUP + t, window.buffer_index, chunk) * stride;
        partials[o] = big_m[t];
        partials[o + 1u] = big_l[t];
        partials[o + 2u] = 0.0;
        partials[o + 3u] = 0.0;
    }
}
