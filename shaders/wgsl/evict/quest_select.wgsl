// QUEST, pass 2: per (sequence, KV head) of one layer, score each page of its list by the upper
// bound of q.k over the page, sum_i max(q_i min_i, q_i max_i), maximised over the query heads of
// the KV head; keep the `keep_pages` best (ties to the lower list index), in list order, as the
// list attention reads. Pages are selected, not evicted. One workgroup per (sequence, head).

//!import common/pool.wgsl
//!import common/scan.wgsl
//!import common/radix.wgsl

// must match `QuestParams` in core/src/gpu_data.rs
struct QuestParams {
    layer: u32,
    keep_pages: u32,
    group: u32,
    q_heads: u32,
    n_seqs: u32,
    scale: f32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: QuestParams;
@group(0) @binding(2) var<storage, read> page_list: array<u32>;
@group(0) @binding(3) var<storage, read> page_counts: array<u32>;
@group(0) @binding(4) var<storage, read> bounds: array<f32>;
@group(0) @binding(5) var<storage, read> queries: array<f32>;
@group(0) @binding(6) var<storage, read_write> sel_list: array<u32>;
@group(0) @binding(7) var<storage, read_write> sel_counts: array<u32>;
@group(0) @binding(8) var<storage, read_write> page_key: array<u32>;  // scratch: [list slot] orderable bound

const WG: u32 = 256u;
var<workgroup> known: u32;
var<workgroup> known_lo: u32;
var<workgroup> rank_sh: u32;
var<workgroup> n_sh: u32;

fn orderable(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x80000000u) != 0u) {
        return ~b;
    }
    return b | 0x80000000u;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let seq = wg.x / geo.kv_heads;
    let head = wg.x % geo.kv_heads;
    if (seq >= params.n_seqs) {
        return;
    }
    let li = list_index(geo, params.layer, seq, head);
    let base = li * geo.max_pages_per_seq;
    if (t == 0u) {
        n_sh = page_counts[li];
    }
    let n = workgroupUniformLoad(&n_sh);
    let D = geo.head_dim;
    // Key per page: descending bound = ascending complement; lower list index first on ties.
    for (var j = t; j < n; j += WG) {
        let page = page_list[base + j];
        var best = -3.4e38;
        for (var g = 0u; g < params.group; g++) {
            let q0 = (seq * params.q_heads + head * params.group + g) * D;
            var ub = 0.0;
            for (var i = 0u; i < D; i++) {
                let q = queries[q0 + i];
                ub += max(q * bounds[page * 2u * D + i], q * bounds[page * 2u * D + D + i]);
            }
            best = max(best, ub);
        }
        page_key[base + j] = ~orderable(best);
    }
    storageBarrier();
    workgroupBarrier();
    let keep = min(params.keep_pages, n);
    // Radix select of the keep-th smallest (key, index) over 8 passes of 8 bits.
    if (t == 0u) {
        known = 0u;
        known_lo = 0u;
        rank_sh = keep;
    }
    workgroupBarrier();
    if (keep > 0u && keep < n) {
        for (var p = 0u; p < 8u; p++) {
            atomicStore(&hist[t], 0u);
            workgroupBarrier();
            let kh = known;
            let kl = known_lo;
            for (var j = t; j < n; j += WG) {
                let hi = page_key[base + j];
                var m = true;
                if (p > 0u && p < 4u) {
                    m = (hi >> (32u - 8u * p)) == (kh >> (32u - 8u * p));
                } else if (p >= 4u) {
                    m = hi == kh && (p == 4u || (j >> (64u - 8u * p)) == (kl >> (64u - 8u * p)));
                }
                if (m) {
                    var d = 0u;
                    if (p < 4u) {
                        d = (hi >> (24u - 8u * p)) & 255u;
                    } else {
                        d = (j >> (56u - 8u * p)) & 255u;
                    }
                    atomicAdd(&hist[d], 1u);
                }
            }
            workgroupBarrier();
            if (t == 0u) {
                let pick = radix_pick(rank_sh);
                let d = pick.x;
                rank_sh = pick.y;
                if (p < 4u) {
                    known |= d << (24u - 8u * p);
                } else {
                    known_lo |= d << (56u - 8u * p);
                }
            }
            workgroupBarrier();
        }
    } else if (t == 0u) {
        known = 0xffffffffu;
        known_lo = 0xffffffffu;
    }
    workgroupBarrier();
    let kh = known;
    let kl = known_lo;
    // Compact the selected pages in list order.
    let rounds = (n + WG - 1u) / WG;
    var before = 0u;
    for (var r = 0u; r < rounds; r++) {
        let j = r * WG + t;
        var sel = 0u;
        if (j < n && keep > 0u) {
            let hi = page_key[base + j];
            if (hi < kh || (hi == kh && j <= kl)) {
                sel = 1u;
            }
        }
        let incl = workgroup_scan(t, sel);
        if (sel == 1u) {
            sel_list[base + before + incl - 1u] = page_list[base + j];
        }
        let round_total = workgroupUniformLoad(&scan[WG - 1u]);
        before += round_total;
    }
    if (t == 0u) {
        sel_counts[li] = before;
    }
}
