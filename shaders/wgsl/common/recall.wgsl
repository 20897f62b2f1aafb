// The recall tier's shared definitions (evict/capture.wgsl writes it, attend/recall.wgsl reads it).

// must match `TierParams` in core/src/gpu_data.rs
struct TierParams {
    cap: u32,          // tier slots per page list, a multiple of the page size
    pages: u32,        // pages recalled per list and layer (R)
    slot: u32,         // the attention's partial buffer index the recall writes
    _pad0: u32,
}

const TIER_NONE: u32 = 0xffffffffu;
// tier_stats words
const TIER_DROPPED: u32 = 0u;   // victims past a full tier (lost: reported)
const TIER_CAPTURED: u32 = 1u;  // victims captured so far
