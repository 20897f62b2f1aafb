// The recall tier's shared definitions (evict/capture.wgsl and evict/digest.wgsl write it,
// attend/recall.wgsl reads it).

// must match `TierParams` in core/src/gpu_data.rs
struct TierParams {
    cap: u32,          // tier slots per page list, a multiple of the page size
    pages: u32,        // pages recalled per list and layer (R)
    slot: u32,         // the attention's partial buffer index the recall writes
    audit: u32,        // 1: the recall pass also finds the true best pages and counts the digest's hits
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
