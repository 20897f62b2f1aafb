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
//!import attend/merge.wgsl

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

// Knobs are true constants (`//!define`, set by the runtime per shape) so that every per-lane
// array below has its exact size and every loop over it unrolls: registers, never local memory.
//!define GROUP 4u
//!define LANES 16u
//!define VPL 1u
//!define F16 true
//!define PAGE_SIZE 16u
//!define U 4u
//!define TRANSPOSE true
// GROUP: query heads per KV head. LANES: invocations per token (power of two, <= subgroup size).
// VPL: vec4<u32> per lane per K (or V) row (LANES * VPL * 4 = vec_words). F16: K/V as packed f16
// pairs (else f32). PAGE_SIZE: the pool's page size. U: tokens in flight per token group.
// TRANSPOSE (GROUP a power of two <= LANES): reduce-scatter the GROUP partial dot products over
// the lanes of a token (GROUP - 1 + log2(LANES / GROUP) shuffles instead of GROUP * log2(LANES)),
// so each lane finishes the score of one query head and runs its softmax alone; probabilities are
// then broadcast back for the value update. Otherwise every lane reduces and keeps every head.

const WG: u32 = 128u;
const NQ: u32 = select(VPL, 2u * VPL, F16);  // vec4<f32> of values per lane per row
const HEADS_KEPT: u32 = select(GROUP, 1u, TRANSPOSE);
const MAX_CHUNK_PAGES: u32 = 64u;

var<workgroup> chunk_page: array<u32, 64>;
var<workgroup> chunk_fill: array<u32, 64>;
var<workgroup> chunk_pos: array<u32, 64>;  // a live page's place in the chunk
var<workgroup> ml_sh: array<vec2<f32>, 256>;   // [token group][query head]: (max, sum)
var<workgroup> acc_sh: array<vec4<f32>, 512>;  // [query head][d / 4]
var<workgroup> count_sh: u32;
var<workgroup> live_sh: u32;

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

fn log2u(x: u32) -> u32 {
    return 31u - countLeadingZeros(x);
}

// TRANSPOSE: the query head whose score lane `lane` ends up holding, and the lane offset (in its
// token group) of a holder of head g.
fn head_of_lane(lane: u32) -> u32 {
    let k = log2u(GROUP);
    var g = 0u;
    for (var i = 0u; i < k; i++) {
        if ((lane & (LANES >> (i + 1u))) != 0u) {
            g |= 1u << (k - 1u - i);
        }
    }
    return g;
}

fn lane_of_head(g: u32) -> u32 {
    let k = log2u(GROUP);
    var l = 0u;
    for (var i = 0u; i < k; i++) {
        if (((g >> (k - 1u - i)) & 1u) != 0u) {
            l |= LANES >> (i + 1u);
        }
    }
    return l;
}

// A slot's place in the chunk, from its place among the live pages' slots.
fn chunk_slot(j: u32) -> u32 {
    return chunk_pos[min(j / PAGE_SIZE, MAX_CHUNK_PAGES - 1u)] * PAGE_SIZE + j % PAGE_SIZE;
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
    let lane = sg_lane % LANES;
    let group_base = sg_lane - lane;
    let tg = sg_id * (sg_size / LANES) + sg_lane / LANES;
    let n_tg = WG / LANES;
    let my_head = head_of_lane(lane);
    let replicas = LANES / GROUP;

    if (t == 0u) {
        count_sh = page_counts[list_index(geo, params.layer, seq, kvh)];
    }
    let n_pages = workgroupUniformLoad(&count_sh);
    let first = chunk * params.chunk_pages;
    if (first >= n_pages) {
        // Past the sequence's end (chunks are sized for the longest sequence): an empty partial.
        if (t < GROUP) {
            let o = partial_index(params, seq, kvh * GROUP + t, window.buffer_index, chunk) * partial_stride(D);
            write_partial_empty(o);
        }
        return;
    }
    let list = list_index(geo, params.layer, seq, kvh) * geo.max_pages_per_seq;
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
        chunk_pos[c] = c;
    }
    workgroupBarrier();
    // The chunk's pages that this kernel reads (not in another buffer, not compressed), moved
    // to the front in order: the token groups walk only those (a chunk of a compressed pool
    // holds a few raw pages at most). A chunk with none leaves an empty partial.
    if (t == 0u) {
        var live = 0u;
        for (var c = 0u; c < params.chunk_pages; c++) {
            live += select(0u, 1u, chunk_fill[c] > 0u);
        }
        if (live < params.chunk_pages) {
            var k = 0u;
            for (var c = 0u; c < params.chunk_pages; c++) {
                if (chunk_fill[c] > 0u) {
                    chunk_page[k] = chunk_page[c];
                    chunk_fill[k] = chunk_fill[c];
                    chunk_pos[k] = c;
                    k++;
                }
            }
        }
        live_sh = live;
    }
    let n_live = workgroupUniformLoad(&live_sh);
    if (n_live == 0u) {
        if (t < GROUP) {
            let o = partial_index(params, seq, kvh * GROUP + t, window.buffer_index, chunk) * partial_stride(D);
            write_partial_empty(o);
        }
        return;
    }

    // This lane's slice of the query heads of this KV head, pre-scaled.
    var q: array<vec4<f32>, GROUP * NQ>;  // [g * NQ + n]
    let q0 = (seq * params.q_heads + kvh * GROUP) * D;
    for (var g = 0u; g < GROUP; g++) {
        for (var n = 0u; n < NQ; n++) {
            let d = q0 + g * D + 4u * dim4_of(lane, n);
            q[g * NQ + n] = vec4<f32>(queries[d], queries[d + 1u], queries[d + 2u], queries[d + 3u]) * params.scale;
        }
    }
    var acc: array<vec4<f32>, GROUP * NQ>;
    // Running max and sum: TRANSPOSE keeps the lane's own head in slot 0, else one per head.
    var m: array<f32, HEADS_KEPT>;
    var l: array<f32, HEADS_KEPT>;
    for (var g = 0u; g < HEADS_KEPT; g++) {
        m[g] = NEG_BIG;
        l[g] = 0.0;
    }
    for (var i = 0u; i < GROUP * NQ; i++) {
        acc[i] = vec4<f32>(0.0);
    }

    let vw4 = geo.vec_words / 4u;
    let page_w4 = geo.page_words / 4u;
    let v_off4 = block_words(geo) / 4u;
    let slots = n_live * PAGE_SIZE;
    let iters = (slots + n_tg * U - 1u) / (n_tg * U);
    // (Software pipelining, loading iteration it + 1 while it computes, was tried on an H200:
    // the driver then kept the carried arrays in local memory and the kernel ran 5x slower.)
    for (var it = 0u; it < iters; it++) {
        var kraw: array<vec4<u32>, U * VPL>;  // [u * VPL + i]
        var vraw: array<vec4<u32>, U * VPL>;
        var valid: array<bool, U>;
        var slot_of: array<u32, U>;
        for (var u = 0u; u < U; u++) {
            let j = tg + (it * U + u) * n_tg;
            let c = min(j / PAGE_SIZE, MAX_CHUNK_PAGES - 1u);
            let s = j % PAGE_SIZE;
            let ok = j < slots && s < chunk_fill[c];
            valid[u] = ok;
            slot_of[u] = j;
            if (ok) {
                let row = chunk_page[c] * page_w4 + s * vw4 + lane;
                for (var i = 0u; i < VPL; i++) {
                    kraw[u * VPL + i] = pool[row + i * LANES];
                    vraw[u * VPL + i] = pool[row + v_off4 + i * LANES];
                }
            } else {
                for (var i = 0u; i < VPL; i++) {
                    kraw[u * VPL + i] = vec4<u32>(0u);
                    vraw[u * VPL + i] = vec4<u32>(0u);
                }
            }
        }
        // Partial dot products of this lane's slice.
        var part: array<f32, U * GROUP>;  // [u * GROUP + g]
        for (var u = 0u; u < U; u++) {
            for (var g = 0u; g < GROUP; g++) {
                var x = 0.0;
                for (var n = 0u; n < NQ; n++) {
                    x += dot(q[g * NQ + n], unpack_value(kraw[u * VPL + word_of(n)], n));
                }
                part[u * GROUP + g] = x;
            }
        }
        var p: array<f32, U * GROUP>;  // [u * GROUP + g] probabilities, relative to the new max
        var corr: array<f32, GROUP>;     // [g] rescale of the old accumulators
        if (TRANSPOSE) {
            var sc: array<f32, U>;
            var m_new = m[0];
            for (var u = 0u; u < U; u++) {
                var mask = LANES / 2u;
                for (var half = GROUP / 2u; half > 0u; half = half / 2u) {
                    let upper = (lane & mask) != 0u;
                    for (var j = 0u; j < half; j++) {
                        let keep = select(part[u * GROUP + j], part[u * GROUP + j + half], upper);
                        let send = select(part[u * GROUP + j + half], part[u * GROUP + j], upper);
                        part[u * GROUP + j] = keep + subgroupShuffleXor(send, mask);
                    }
                    mask = mask / 2u;
                }
                var x = part[u * GROUP];
                for (; mask > 0u; mask = mask / 2u) {
                    x += subgroupShuffleXor(x, mask);
                }
                sc[u] = select(NEG_BIG, x, valid[u]);
                m_new = max(m_new, sc[u]);
                if (valid[u] && params.write_scores != 0u && (lane % replicas) == 0u) {
                    scores[(seq * params.q_heads + kvh * GROUP + my_head) * params.max_tokens + first * PAGE_SIZE + chunk_slot(slot_of[u])] = x;
                }
            }
            let c_own = exp(m[0] - m_new);
            var lsum = l[0] * c_own;
            var p_own: array<f32, U>;
            for (var u = 0u; u < U; u++) {
                p_own[u] = select(0.0, exp(sc[u] - m_new), valid[u]);
                lsum += p_own[u];
            }
            m[0] = m_new;
            l[0] = lsum;
            for (var g = 0u; g < GROUP; g++) {
                let src = group_base + lane_of_head(g);
                corr[g] = subgroupShuffle(c_own, src);
                for (var u = 0u; u < U; u++) {
                    p[u * GROUP + g] = subgroupShuffle(p_own[u], src);
                }
            }
        } else {
            for (var g = 0u; g < GROUP; g++) {
                var sc: array<f32, U>;
                var m_new = m[g];
                for (var u = 0u; u < U; u++) {
                    var x = part[u * GROUP + g];
                    for (var mask = LANES / 2u; mask > 0u; mask = mask / 2u) {
                        x += subgroupShuffleXor(x, mask);
                    }
                    sc[u] = select(NEG_BIG, x, valid[u]);
                    m_new = max(m_new, sc[u]);
                    if (valid[u] && params.write_scores != 0u && lane == 0u) {
                        scores[(seq * params.q_heads + kvh * GROUP + g) * params.max_tokens + first * PAGE_SIZE + chunk_slot(slot_of[u])] = x;
                    }
                }
                corr[g] = exp(m[g] - m_new);
                var lsum = l[g] * corr[g];
                for (var u = 0u; u < U; u++) {
                    p[u * GROUP + g] = select(0.0, exp(sc[u] - m_new), valid[u]);
                    lsum += p[u * GROUP + g];
                }
                m[g] = m_new;
                l[g] = lsum;
            }
        }
        for (var g = 0u; g < GROUP; g++) {
            for (var n = 0u; n < NQ; n++) {
                var a = acc[g * NQ + n] * corr[g];
                for (var u = 0u; u < U; u++) {
                    a += p[u * GROUP + g] * unpack_value(vraw[u * VPL + word_of(n)], n);
                }
                acc[g * NQ + n] = a;
            }
        }
    }

    // Merge the token groups of this workgroup.
    if (TRANSPOSE) {
        if ((lane % replicas) == 0u) {
            ml_sh[tg * GROUP + my_head] = vec2<f32>(m[0], l[0]);
        }
    } else if (lane == 0u) {
        for (var g = 0u; g < GROUP; g++) {
            ml_sh[tg * GROUP + g] = vec2<f32>(m[g], l[g]);
        }
    }
    workgroupBarrier();
    var big_m: array<f32, GROUP>;
    var big_l: array<f32, GROUP>;
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
                let f = exp(ml_sh[tg * GROUP + g].x - big_m[g]);
                for (var n = 0u; n < NQ; n++) {
                    let a = g * D4 + dim4_of(lane, n);
                    var prev = vec4<f32>(0.0);
                    if (r > 0u) {
                        prev = acc_sh[a];
                    }
                    acc_sh[a] = prev + acc[g * NQ + n] * f;
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
        write_partial_acc4(o, a);
    }
    if (t < GROUP) {
        let o = partial_index(params, seq, kvh * GROUP + t, window.buffer_index, chunk) * stride;
        write_partial_stats(o, big_m[t], big_l[t]);
    }
}
