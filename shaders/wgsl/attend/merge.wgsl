// The flash-decoding records shared by the split kernels (attend/split_*, attend/prefill).
//
// A chunk's partial record for one query head is [m, l, 0, 0, acc[d]]: the running maximum of
// its scaled scores, the sum of exp(score - m), and the unnormalised output sum_s exp(s - m) v_s.
// Two records (m1, l1, a1) and (m2, l2, a2) merge into M = max(m1, m2),
// l = l1 exp(m1 - M) + l2 exp(m2 - M), a = a1 exp(m1 - M) + a2 exp(m2 - M): the split kernels
// apply it page by page (online softmax) and across their token groups, attend/reduce across
// chunks and pool buffers; the factors exp(m - M) come from attend/softmax.wgsl.

//!import attend/common.wgsl
//!expects @group(0) @binding(1) var<uniform> params: AttendParams;
//!expects @group(0) @binding(8) var<storage, read_write> partials: array<f32>;

// The first word of query head qh's record for (buffer, chunk), at head dimension d.
fn partial_at(seq: u32, qh: u32, buffer: u32, chunk: u32, d: u32) -> u32 {
    return partial_index(params, seq, qh, buffer, chunk) * partial_stride(d);
}

// The record's (m, l) words at `o`.
fn write_partial_stats(o: u32, m: f32, l: f32) {
    partials[o] = m;
    partials[o + 1u] = l;
    partials[o + 2u] = 0.0;
    partials[o + 3u] = 0.0;
}

// A chunk with nothing to attend: a record the reduce weighs by exp(NEG_BIG - M) = 0.
fn write_partial_empty(o: u32) {
    partials[o] = NEG_BIG;
    partials[o + 1u] = 0.0;
}

// The empty records of a chunk with nothing to attend (past its list's end, or none of the
// kernel's pages): invocation t < group writes query head kvh * group + t's.
fn write_chunk_empty(t: u32, group: u32, seq: u32, kvh: u32, buffer: u32, chunk: u32, d: u32) {
    if (t < group) {
        write_partial_empty(partial_at(seq, kvh * group + t, buffer, chunk, d));
    }
}

fn write_partial_acc2(o: u32, a: vec2<f32>) {
    partials[o] = a.x;
    partials[o + 1u] = a.y;
}

fn write_partial_acc4(o: u32, a: vec4<f32>) {
    partials[o] = a.x;
    partials[o + 1u] = a.y;
    partials[o + 2u] = a.z;
    partials[o + 3u] = a.w;
}
