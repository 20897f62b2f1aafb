// Shared definitions of the paged, sharded KV pool.
// Every struct here is mirrored on the host in core/src/gpu_data.rs; keep both in step.
// Pages are head-major: a page holds K (then V) of P slots of one KV head of one layer, so each
// KV head has its own shard rings and page lists, and per-head policies free real pages.

// must match `Geometry` in core/src/gpu_data.rs
struct Geometry {
    page_size: u32,          // P: slots per page
    kv_heads: u32,           // Hkv
    head_dim: u32,           // d
    vec_words: u32,          // u32 words per token-head vector: d/2 (f16) or d (f32)
    page_words: u32,         // 2 * P * vec_words: K block then V block
    n_pages: u32,            // pages in the whole pool
    pages_per_buffer: u32,   // pages in each pool buffer (the last may hold fewer)
    ring_capacity: u32,      // R: page entries per shard ring
    n_shards: u32,           // shards per (layer, sequence, KV head)
    max_seqs: u32,
    layers: u32,
    top_k: u32,              // experts (and gates) kept per slot
    shard_map: u32,          // SHARD_MAP_*
    n_tok: u32,              // PiKV map: token modulus (power of two <= n_shards)
    n_exp: u32,              // PiKV map: expert modulus (power of two <= n_shards)
    token_block: u32,        // block map: tokens per block
    meta_words: u32,         // u32 words of metadata per slot
    max_pages_per_seq: u32,  // page list capacity per (layer, sequence, KV head) = n_shards * R
    f16_kv: u32,             // 1: K/V stored as packed f16 pairs, 0: f32
    codec: u32,              // CODEC_*: how full pages are stored (common/compress.wgsl)
    codec_pages: u32,        // compressed pages; their ids follow the raw pages' (n_pages + i)
    codec_page_words: u32,   // u32 words of one compressed page
    codec_param: u32,        // FastV: dimensions kept; low rank: rank
    v_group: u32,            // KIVI: dimensions per value quantisation group
}

// must match `RingState` in core/src/gpu_data.rs
struct RingState {
    head: u32,   // array index (mod R) of the oldest page
    count: u32,  // pages in the ring
    fill: u32,   // slots used in the newest page; P when a new token needs a new page
    _pad: u32,
}

// must match `PageMeta` in core/src/gpu_data.rs
struct PageMeta {
    owner: u32,  // shard key (layer, seq, head, shard) or NO_OWNER when free
    fill: u32,   // valid slots
}

// must match `PoolCtl` in core/src/gpu_data.rs
struct PoolCtl {
    free_top: u32,       // entries on the free stack
    error_flags: u32,    // ERR_* bits, sticky until the host clears them
    abort: u32,          // 1 when the current append batch was refused
    ring_overflows: u32, // pages recycled because their ring was full (their tokens dropped)
    tokens_appended: u32,
    pages_released: u32,
    pages_evicted: u32,  // pages freed by eviction (compaction)
    codec_free_top: u32, // entries on the compressed pages' free stack
}

const SHARD_MAP_PIKV: u32 = 0u;
const SHARD_MAP_EXPERT: u32 = 1u;
const SHARD_MAP_TOKEN_BLOCK: u32 = 2u;

const NO_OWNER: u32 = 0xffffffffu;
const ERR_POOL_EXHAUSTED: u32 = 1u;
const ERR_BAD_TOKEN: u32 = 2u;
// A full ring of a pool with a page codec would recycle a compressed page (its oldest) as a raw
// one: the batch is refused (give the rings room for the longest sequence).
const ERR_RING_FULL: u32 = 4u;

// Slot metadata: `meta_words` u32 per slot (of one head's page), laid out as
// [position, last_access, access_count, experts[top_k], gates[top_k] (f32 bits), attn (f32 bits)].
const META_POSITION: u32 = 0u;
const META_LAST_ACCESS: u32 = 1u;
const META_ACCESS_COUNT: u32 = 2u;
const META_EXPERTS: u32 = 3u;

fn meta_gates(geo: Geometry) -> u32 { return META_EXPERTS + geo.top_k; }
fn meta_attn(geo: Geometry) -> u32 { return META_EXPERTS + 2u * geo.top_k; }

// PiKV: s(t, e) = (t mod N_tok) XOR (e mod N_exp); also by expert and by token block.
fn shard_from_token_expert(geo: Geometry, position: u32, expert: u32) -> u32 {
    switch geo.shard_map {
        case 1u: { return expert % geo.n_shards; }
        case 2u: { return (position / geo.token_block) % geo.n_shards; }
        default: { return (position % geo.n_tok) ^ (expert % geo.n_exp); }
    }
}

// Index of one (layer, seq, KV head): its page list and page count.
fn list_index(geo: Geometry, layer: u32, seq: u32, head: u32) -> u32 {
    return (layer * geo.max_seqs + seq) * geo.kv_heads + head;
}

// Key of one shard ring: (layer, seq, KV head, shard).
fn shard_key(geo: Geometry, layer: u32, seq: u32, head: u32, shard: u32) -> u32 {
    return list_index(geo, layer, seq, head) * geo.n_shards + shard;
}

// Words of one K or V block inside a page: P * vec_words.
fn block_words(geo: Geometry) -> u32 {
    return geo.page_size * geo.vec_words;
}
