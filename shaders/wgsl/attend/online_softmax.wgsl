// The portable split kernels' shared walk (attend/split_tiled, split_codec, split_lowrank,
// prefill): WG invocations per workgroup, the chunk's pages one at a time (the importer says
// which pages it reads: `attends`), each page's scores (one row of `p_sh` per query head) turned
// into probabilities against the head's running maximum, the head's running (m, l) absorbing
// them (attend/softmax.wgsl), and the records at the end. `f_sh` keeps the factor
// exp(m_old - m_new) that the caller applies to its value sums.

//!import common/pool.wgsl
//!import attend/common.wgsl
//!import attend/softmax.wgsl
//!import attend/merge.wgsl
//!expects @group(0) @binding(1) var<uniform> params: AttendParams;
//!expects @group(0) @binding(2) var<storage, read> page_list: array<u32>;
//!expects @group(0) @binding(4) var<storage, read> page_meta: array<PageMeta>;
//!expects @group(0) @binding(8) var<storage, read_write> partials: array<f32>;
//!expects fn attends(page: u32) -> bool { return page > 0u; }

const WG: u32 = 64u;
const MAX_GROUP: u32 = 8u;   // query heads per KV head
const MAX_PAGE: u32 = 64u;   // slots per page
const MAX_PAIRS: u32 = 16u;  // (query head, pair of dimensions) per invocation: MAX_GROUP x 256 / 2 / WG

var<workgroup> p_sh: array<f32, MAX_GROUP * MAX_PAGE>;  // [query head][token of the page]: scores, then probabilities
var<workgroup> m_sh: array<f32, MAX_GROUP>;
var<workgroup> l_sh: array<f32, MAX_GROUP>;
var<workgroup> f_sh: array<f32, MAX_GROUP>;
var<workgroup> page_sh: u32;
var<workgroup> fill_sh: u32;

// Invocation `t < n_heads` starts query head `t` with nothing seen.
fn online_softmax_start(t: u32, n_heads: u32) {
    if (t < n_heads) {
        m_sh[t] = NEG_BIG;
        l_sh[t] = 0.0;
    }
}

// The fill of the page at `page_list[at]` where the kernel attends it (0 elsewhere), read once
// for the workgroup (a uniform load); its id is then in `page_sh`.
fn page_fill(t: u32, at: u32) -> u32 {
    if (t == 0u) {
        let page = page_list[at];
        page_sh = page;
        var fill = 0u;
        if (attends(page)) {
            fill = page_meta[page].fill;
        }
        fill_sh = fill;
    }
    return workgroupUniformLoad(&fill_sh);
}

// Invocation `t < n_heads` updates query head `t` over the page's first `fill` scores; the whole
// workgroup calls it (it ends with a barrier).
fn online_softmax_page(t: u32, n_heads: u32, fill: u32) {
    if (t < n_heads) {
        var mx = NEG_BIG;
        for (var s = 0u; s < fill; s++) {
            mx = max(mx, p_sh[t * MAX_PAGE + s]);
        }
        let mv = softmax_move(m_sh[t], l_sh[t], mx);
        var sum = 0.0;
        for (var s = 0u; s < fill; s++) {
            // A score of NEG_BIG is a masked slot (attend/prefill's causal mask).
            let sc = p_sh[t * MAX_PAGE + s];
            let p = softmax_prob(sc, mv.m, sc > NEG_BIG);
            p_sh[t * MAX_PAGE + s] = p;
            sum += p;
        }
        l_sh[t] = mv.l + sum;
        m_sh[t] = mv.m;
        f_sh[t] = mv.corr;
    }
    workgroupBarrier();
}

// The value sums acc[k] of (query head, pair of dimensions) e = t + k WG, e below
// n_heads x d / 2, into their records.
fn write_pair_sums(t: u32, acc: array<vec2<f32>, MAX_PAIRS>, n_heads: u32, seq: u32, kvh: u32, buffer: u32, chunk: u32, d: u32) {
    let half_d = d / 2u;
    for (var k = 0u; k < MAX_PAIRS; k++) {
        let e = t + k * WG;
        if (e < n_heads * half_d) {
            let g = e / half_d;
            let j = e % half_d;
            write_partial_acc2(partial_at(seq, kvh * n_heads + g, buffer, chunk, d) + 4u + 2u * j, acc[k]);
        }
    }
}

// Invocation `t < n_heads` writes query head kvh * n_heads + t's (m, l) to its record.
fn write_softmax_stats(t: u32, n_heads: u32, seq: u32, kvh: u32, buffer: u32, chunk: u32, d: u32) {
    if (t < n_heads) {
        write_partial_stats(partial_at(seq, kvh * n_heads + t, buffer, chunk, d), m_sh[t], l_sh[t]);
    }
}
