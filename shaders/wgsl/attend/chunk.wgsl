// The chunk a split workgroup attends (the attend/split_* kernels and attend/prefill): one
// workgroup per (chunk of `chunk_pages` list positions, KV head, sequence), its list's length
// read once for the workgroup. (attend/split_quant_coop writes this out: naga takes a function's
// result for non-uniform, and its cooperative matrices need uniform control flow.)

//!import common/pool.wgsl
//!import attend/common.wgsl
//!expects @group(0) @binding(0) var<uniform> geo: Geometry;
//!expects @group(0) @binding(1) var<uniform> params: AttendParams;
//!expects @group(0) @binding(3) var<storage, read> page_counts: array<u32>;

var<workgroup> count_sh: u32;

// `list`: where the (sequence, KV head) list's page ids start in `page_list`; `n_pages`: its
// length; `first` .. `last`: the chunk's positions in it (first >= n_pages past the list's end,
// as chunks are counted for the longest list).
struct Chunk {
    list: u32,
    n_pages: u32,
    first: u32,
    last: u32,
}

// The whole workgroup calls it (a uniform load).
fn chunk_of(t: u32, seq: u32, kvh: u32, chunk: u32) -> Chunk {
    let li = list_index(geo, params.layer, seq, kvh);
    if (t == 0u) {
        count_sh = page_counts[li];
    }
    let n_pages = workgroupUniformLoad(&count_sh);
    let first = chunk * params.chunk_pages;
    return Chunk(li * geo.max_pages_per_seq, n_pages, first, min(first + params.chunk_pages, n_pages));
}
