// Shared by the decode-attention kernels (flash-decoding: split over page chunks, then reduce).

// must match `AttendParams` in core/src/gpu_data.rs
struct AttendParams {
    n_seqs: u32,
    layer: u32,
    group: u32,         // query heads per KV head (GQA)
    q_heads: u32,
    n_chunks: u32,      // chunks of `chunk_pages` pages per sequence
    chunk_pages: u32,
    n_buffers: u32,     // pool buffers: partials are kept per (buffer, chunk)
    write_scores: u32,  // 1: store each scaled score q.k for the attention-mass pass
    max_tokens: u32,    // score row length: max_pages_per_seq * page_size
    step: u32,
    scale: f32,         // 1/sqrt(d)
    _pad0: u32,
}

// A partial record is [m, l, 0, 0, acc[d]]: running max, sum of exp, unnormalised output.
fn partial_stride(d: u32) -> u32 { return d + 4u; }

fn partial_index(p: AttendParams, seq: u32, qh: u32, buffer: u32, chunk: u32) -> u32 {
    return ((seq * p.q_heads + qh) * p.n_buffers + buffer) * p.n_chunks + chunk;
}

const NEG_BIG: f32 = -3.0e38;
