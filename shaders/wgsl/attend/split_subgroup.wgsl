// attend_decode, split pass, fast variant (needs subgroups of at least LANES invocations;
// naga takes subgroup builtins without `enable subgroups;`, browsers need it: the runtime
// prepends it on the web):
// LANES invocations of a subgroup share one token, each loading VPL 16-byte words of its K and
// V rows (coalesced), and combine partial dot products with subgroup shuffles. A workgroup of
// WG invocations runs WG / LANES such token groups over a chunk of pages, U tokens in flight
// per group, each group keeping an online softmax; the groups merge in workgroup memory and
// write one partial per query head (attend/lanes.wgsl). Same partial layout and scores as
// split_tiled.wgsl.

//!import common/pool.wgsl
//!import common/window.wgsl
//!import attend/common.wgsl
//!import attend/chunk.wgsl
//!import attend/merge.wgsl
//!import attend/lanes.wgsl

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
const NV: u32 = select(VPL, 2u * VPL, F16);  // vec4<f32> of values per lane per row
const MAX_CHUNK_PAGES: u32 = 64u;

var<workgroup> chunk_page: array<u32, 64>;
var<workgroup> chunk_fill: array<u32, 64>;
var<workgroup> chunk_pos: array<u32, 64>;  // a live page's place in the chunk
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
    let lane = sg_lane % LANES;
    let group_base = sg_lane - lane;
    let tg = sg_id * (sg_size / LANES) + sg_lane / LANES;
    let n_tg = WG / LANES;
    let my_head = head_of_lane(lane);

    let ch = chunk_of(t, seq, kvh, chunk);
    let first = ch.first;
    if (first >= ch.n_pages) {
        write_chunk_empty(t, GROUP, seq, kvh, window.buffer_index, chunk, D);
        return;
    }
    for (var c = t; c < params.chunk_pages; c += WG) {
        var page = 0u;
        var fill = 0u;
        if (first + c < ch.n_pages) {
            page = page_list[ch.list + first + c];
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
        write_chunk_empty(t, GROUP, seq, kvh, window.buffer_index, chunk, D);
        return;
    }

    // This lane's slice of the query heads of this KV head, pre-scaled.
    var q: array<vec4<f32>, GROUP * NV>;  // [g * NV + n]
    let q0 = (seq * params.q_heads + kvh * GROUP) * D;
    for (var g = 0u; g < GROUP; g++) {
        for (var n = 0u; n < NV; n++) {
            let d = q0 + g * D + 4u * dim4_of(lane, n);
            q[g * NV + n] = vec4<f32>(queries[d], queries[d + 1u], queries[d + 2u], queries[d + 3u]) * params.scale;
        }
    }
    var acc: array<vec4<f32>, GROUP * NV>;
    // Running max and sum: TRANSPOSE keeps the lane's own head in slot 0, else one per head.
    var m: array<f32, HEADS_KEPT>;
    var l: array<f32, HEADS_KEPT>;
    for (var g = 0u; g < HEADS_KEPT; g++) {
        m[g] = NEG_BIG;
        l[g] = 0.0;
    }
    for (var i = 0u; i < GROUP * NV; i++) {
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
                for (var n = 0u; n < NV; n++) {
                    x += dot(q[g * NV + n], unpack_value(kraw[u * VPL + word_of(n)], n));
                }
                part[u * GROUP + g] = x;
            }
        }
        let x = lane_scores(part, lane);
        if (params.write_scores != 0u && writes_kept(lane)) {
            for (var u = 0u; u < U; u++) {
                for (var k = 0u; k < HEADS_KEPT; k++) {
                    if (valid[u]) {
                        scores[(seq * params.q_heads + kvh * GROUP + select(k, my_head, TRANSPOSE)) * params.max_tokens + first * PAGE_SIZE + chunk_slot(slot_of[u])] = x[u * HEADS_KEPT + k];
                    }
                }
            }
        }
        let st = lane_softmax(m, l, x, valid, group_base);
        m = st.m;
        l = st.l;
        for (var g = 0u; g < GROUP; g++) {
            for (var n = 0u; n < NV; n++) {
                var a = acc[g * NV + n] * st.corr[g];
                for (var u = 0u; u < U; u++) {
                    a += st.p[u * GROUP + g] * unpack_value(vraw[u * VPL + word_of(n)], n);
                }
                acc[g * NV + n] = a;
            }
        }
    }

    merge_token_groups(t, lane, tg, m, l, acc, seq, kvh, window.buffer_index, chunk, D);
}
