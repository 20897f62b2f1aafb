// The online softmax's and the flash-decoding merge's arithmetic, written once for every
// attention kernel (attend/split_*, attend/prefill through attend/online_softmax, attend/reduce).
// A query head's state is (m, l) with its value sums a: m the running maximum of its scaled
// scores, l = sum exp(score - m), a = sum exp(score - m) v. Moving the state to a larger maximum
// M multiplies l and a by exp(m - M); merging records weighs each by the same factor
// (attend/merge.wgsl writes the rule out). Each function is a few instructions, inlined by the
// compilers; arrays and loops stay in the kernels, laid out for their registers.

//!import attend/common.wgsl

// What a sum relative to the maximum m_old is multiplied by to be relative to m_new (at least
// m_old): the online softmax's rescale of its running sums, and a merged record's weight.
fn softmax_rescale(m_old: f32, m_new: f32) -> f32 {
    return exp(m_old - m_new);
}

// A score's probability against the running maximum m. A masked or empty slot weighs 0, also
// while every slot so far was masked (m still NEG_BIG, where exp would give 1).
fn softmax_prob(score: f32, m: f32, live: bool) -> f32 {
    return select(0.0, exp(score - m), live);
}

// A state (m, l) moved to the maximum max(m, mx): the new maximum, the rescaled sum, and the
// factor the value sums are multiplied by.
struct SoftmaxMove {
    m: f32,
    l: f32,
    corr: f32,
}

fn softmax_move(m: f32, l: f32, mx: f32) -> SoftmaxMove {
    let m_new = max(m, mx);
    let corr = softmax_rescale(m, m_new);
    return SoftmaxMove(m_new, l * corr, corr);
}
