// The online-softmax step of the portable split kernels (attend/split_tiled, split_codec,
// split_lowrank, prefill): a page's scores, one row of `p_sh` per query head, become probabilities
// relative to the head's running maximum, and the head's running (m, l) absorb them (the merge
// of attend/merge.wgsl, one page at a time, its arithmetic from attend/softmax.wgsl). `f_sh` keeps the factor exp(m_old - m_new) that
// the caller applies to its value accumulators.

//!import attend/common.wgsl
//!import attend/softmax.wgsl

const SOFTMAX_MAX_GROUP: u32 = 8u;
const SOFTMAX_MAX_PAGE: u32 = 64u;

var<workgroup> p_sh: array<f32, 512>;  // [query head][token of the page]: scores, then probabilities
var<workgroup> m_sh: array<f32, 8>;
var<workgroup> l_sh: array<f32, 8>;
var<workgroup> f_sh: array<f32, 8>;

// Invocation `t < n_heads` updates query head `t` over the page's first `fill` scores; the whole
// workgroup calls it (it ends with a barrier).
fn online_softmax_page(t: u32, n_heads: u32, fill: u32) {
    if (t < n_heads) {
        var mx = NEG_BIG;
        for (var s = 0u; s < fill; s++) {
            mx = max(mx, p_sh[t * SOFTMAX_MAX_PAGE + s]);
        }
        let mv = softmax_move(m_sh[t], l_sh[t], mx);
        var sum = 0.0;
        for (var s = 0u; s < fill; s++) {
            // A score of NEG_BIG is a masked slot (attend/prefill's causal mask).
            let sc = p_sh[t * SOFTMAX_MAX_PAGE + s];
            let p = softmax_prob(sc, mv.m, sc > NEG_BIG);
            p_sh[t * SOFTMAX_MAX_PAGE + s] = p;
            sum += p;
        }
        l_sh[t] = mv.l + sum;
        m_sh[t] = mv.m;
        f_sh[t] = mv.corr;
    }
    workgroupBarrier();
}
