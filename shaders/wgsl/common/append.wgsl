// Shared by the passes of shard_append. A batch of n tokens places n * kv_heads items: item
// i = token (i / kv_heads), KV head (i % kv_heads); each goes to its head's shard ring.

// must match `AppendParams` in core/src/gpu_data.rs
struct AppendParams {
    n_tokens: u32,
    token_words: u32,  // u32 words per new-token record: 3 + 2 * top_k
    step: u32,
    _pad: u32,
}

// must match `TokenPlan` in core/src/gpu_data.rs; one per item (token, KV head)
struct TokenPlan {
    key: u32,         // shard ring of the item
    rank: u32,        // tokens of the same (layer, seq, shard) earlier in the batch
    u: u32,           // fill of the ring's newest page before the batch + rank
    ring_index: u32,  // array index in the ring of the page that receives the token
    slot: u32,        // slot inside that page
    flags: u32,       // PLAN_*
    page: u32,        // filled by the write pass for the host's inspection
    _pad: u32,
}

const PLAN_OPENS: u32 = 1u;       // first token of a page not in the ring before this batch
const PLAN_NEEDS_FREE: u32 = 2u;  // opens a page taken from the free stack
const PLAN_RECYCLES: u32 = 4u;    // opens a page by recycling the ring's oldest (ring full)
const PLAN_LAST_IN_KEY: u32 = 8u;
const PLAN_LAST_IN_PAGE: u32 = 16u;
const PLAN_INVALID: u32 = 32u;    // layer or sequence out of range: token refused

// New-token record: [layer, seq, position, experts[top_k], gates[top_k] (f32 bits)].
const TOKEN_LAYER: u32 = 0u;
const TOKEN_SEQ: u32 = 1u;
const TOKEN_POSITION: u32 = 2u;
const TOKEN_EXPERTS: u32 = 3u;
