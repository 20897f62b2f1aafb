// The recall tier's shared definitions (evict/capture.wgsl and evict/digest.wgsl write it,
// attend/recall.wgsl reads it).

//!import common/compress.wgsl

// must match `TierParams` in core/src/gpu_data.rs
struct TierParams {
    cap: u32,          // tier slots per page list, a multiple of the page size
    pages: u32,        // pages recalled per list and layer (R)
    slot: u32,         // the attention's partial buffer index the recall writes
    audit: u32,        // 1: the recall pass also finds the true best pages and counts the digest's hits
    bounds_at: u32,    // word of `tier_digest` where the pages' key bounds start (0: none kept)
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

const TIER_NONE: u32 = 0xffffffffu;
// tier_stats words
const TIER_DROPPED: u32 = 0u;   // victims past a full tier (lost: reported)
const TIER_CAPTURED: u32 = 1u;  // victims captured so far
const TIER_AUDIT_LISTS: u32 = 2u;  // audited recall passes (lists with tier pages)
const TIER_AUDIT_TOP: u32 = 3u;    // ... whose truly best page the digest recalled
const TIER_AUDIT_WANT: u32 = 4u;   // the truly best pages (up to PAGES a list), summed
const TIER_AUDIT_HITS: u32 = 5u;   // ... of which the digest recalled

// The key digest: one bit a key dimension, set where the key is at least the list's centre, a
// slot's bits in `head_dim / 32` words. A list calibrates its centre and spread once, from the
// first DIGEST_CALIB_TOKENS tokens or more its tier holds; until then the centre is 0 and the
// spread 1. `tier_digested` holds per list the slots digested and the tokens calibrated on (0:
// not yet); `tier_calib` per list the centre (the keys' mean over those tokens, d floats), the
// spread (their mean absolute deviation from it, d floats) and the key sums (d floats): 0, 1
// and 0 until calibrated.
const DIGEST_CALIB_TOKENS: u32 = 64u;

// A tier page's key bounds (kept when the pages' bounds nominate candidates, after the digests in
// `tier_digest` from `tier.bounds_at`, BOUND_WORDS(head_dim) words a page, list after list): an
// exponent e (i32), then each dimension's smallest key over the page's slots as an i8 code c
// (the bound c x 2^e, rounded down) and then its largest (rounded up), four codes a word. e is
// the smallest with every |key| <= 127 x 2^e (at least -126), so codes sit in -127..=127 and
// every scaling is exact: the CPU reference sets the same words, and the bounds hold every key
// of the page (q.k <= sum_i max(q_i lo_i, q_i hi_i)).
fn bound_words(d: u32) -> u32 {
    return 1u + 2u * ((d + 3u) / 4u);
}

// The exponent of a page whose largest |key| is m.
fn bound_exponent(m: f32) -> i32 {
    if (m == 0.0) {
        return 0;
    }
    var e = max(i32((bitcast<u32>(m) >> 23u) & 0xffu) - 127 - 6, -126);
    if (m > 127.0 * pow2(e)) {
        e += 1;
    }
    return e;
}

// Code b (0..4) of a word of i8 codes, sign-extended.
fn bound_code(word: u32, b: u32) -> f32 {
    return f32(extractBits(bitcast<i32>(word), 8u * b, 8u));
}
