// The token groups of the subgroup split kernels (attend/split_subgroup, attend/split_quant):
// LANES invocations of a subgroup share a token, each holding a slice of its rows; the WG / LANES
// token groups of a workgroup walk the chunk U slots at a time, each group keeping an online
// softmax per query head, and merge in workgroup memory at the end. Here: the lanes' partial dot
// products summed into scores, the online-softmax step of U slots, and the token groups' merge
// with the records it writes. The importer's value sums are NV vec4 per head and lane, vec4
// dim4_of(lane, n) of the row. All of it is shuffles and registers; the merge alone uses
// workgroup memory.

//!import attend/common.wgsl
//!import attend/softmax.wgsl
//!import attend/merge.wgsl
//!expects const WG: u32 = 128u;
//!expects const GROUP: u32 = 4u;
//!expects const LANES: u32 = 16u;
//!expects const U: u32 = 4u;
//!expects const TRANSPOSE: bool = true;
//!expects const NV: u32 = 2u;
//!expects fn dim4_of(lane: u32, n: u32) -> u32 { return lane + n * LANES; }
//!expects @group(0) @binding(1) var<uniform> params: AttendParams;
//!expects @group(0) @binding(8) var<storage, read_write> partials: array<f32>;

// The (m, l) states a lane keeps: TRANSPOSE, its own head's (slot 0); else one per head.
const HEADS_KEPT: u32 = select(GROUP, 1u, TRANSPOSE);

var<workgroup> ml_sh: array<vec2<f32>, 256>;   // [token group][query head]: (max, sum)
var<workgroup> acc_sh: array<vec4<f32>, 512>;  // [query head][d / 4]: the merged value sums (the importer's before the merge)

fn log2u(x: u32) -> u32 {
    return 31u - countLeadingZeros(x);
}

// TRANSPOSE: the query head whose score lane `lane` ends up holding, and the lane offset (in its
// token group) of a holder of head g.
fn head_of_lane(lane: u32) -> u32 {
    let k = log2u(GROUP);
    var g = 0u;
    for (var i = 0u; i < k; i++) {
        if ((lane & (LANES >> (i + 1u))) != 0u) {
            g |= 1u << (k - 1u - i);
        }
    }
    return g;
}

fn lane_of_head(g: u32) -> u32 {
    let k = log2u(GROUP);
    var l = 0u;
    for (var i = 0u; i < k; i++) {
        if (((g >> (k - 1u - i)) & 1u) != 0u) {
            l |= LANES >> (i + 1u);
        }
    }
    return l;
}

// Whether this lane writes out the states it keeps, so that each is written once: TRANSPOSE,
// the first of its head's LANES / GROUP replicas; else lane 0, which keeps every head.
fn writes_kept(lane: u32) -> bool {
    // A `let`, as the kernels had it: without TRANSPOSE, GROUP may exceed LANES (0 here, unused).
    let replicas = LANES / GROUP;
    if (TRANSPOSE) {
        return (lane % replicas) == 0u;
    }
    return lane == 0u;
}

// The scores of U slots from this lane's partial dot products part[u * GROUP + g]: at
// [u * HEADS_KEPT + k] the score of head k (TRANSPOSE: of head_of_lane(lane)). TRANSPOSE
// reduce-scatters the GROUP sums over the lanes of a token (GROUP - 1 + log2(LANES / GROUP)
// shuffles instead of GROUP * log2(LANES)); otherwise every lane reduces every head.
fn lane_scores(part: array<f32, U * GROUP>, lane: u32) -> array<f32, U * HEADS_KEPT> {
    var pt = part;
    var x: array<f32, U * HEADS_KEPT>;
    if (TRANSPOSE) {
        for (var u = 0u; u < U; u++) {
            var mask = LANES / 2u;
            for (var half = GROUP / 2u; half > 0u; half = half / 2u) {
                let upper = (lane & mask) != 0u;
                for (var j = 0u; j < half; j++) {
                    let keep = select(pt[u * GROUP + j], pt[u * GROUP + j + half], upper);
                    let send = select(pt[u * GROUP + j + half], pt[u * GROUP + j], upper);
                    pt[u * GROUP + j] = keep + subgroupShuffleXor(send, mask);
                }
                mask = mask / 2u;
            }
            var s = pt[u * GROUP];
            for (; mask > 0u; mask = mask / 2u) {
                s += subgroupShuffleXor(s, mask);
            }
            x[u] = s;
        }
    } else {
        for (var g = 0u; g < GROUP; g++) {
            for (var u = 0u; u < U; u++) {
                var s = pt[u * GROUP + g];
                for (var mask = LANES / 2u; mask > 0u; mask = mask / 2u) {
                    s += subgroupShuffleXor(s, mask);
                }
                x[u * HEADS_KEPT + g] = s;
            }
        }
    }
    return x;
}

// One online-softmax step over U slots (`valid` masks the empty ones): each kept state moves to
// the slots' maximum and absorbs their probabilities. `p` and `corr` cover every head of the
// group; with TRANSPOSE they are broadcast from the lanes that keep each head (group_base: the
// token group's first lane in the subgroup).
struct LaneSoftmax {
    m: array<f32, HEADS_KEPT>,
    l: array<f32, HEADS_KEPT>,
    p: array<f32, U * GROUP>,  // [u * GROUP + g]: probabilities against the new maxima
    corr: array<f32, GROUP>,   // the factor of each head's value sums
}

fn lane_softmax(m: array<f32, HEADS_KEPT>, l: array<f32, HEADS_KEPT>, x: array<f32, U * HEADS_KEPT>, valid: array<bool, U>, group_base: u32) -> LaneSoftmax {
    var r: LaneSoftmax;
    var p: array<f32, U * HEADS_KEPT>;
    var corr: array<f32, HEADS_KEPT>;
    for (var k = 0u; k < HEADS_KEPT; k++) {
        var sc: array<f32, U>;
        var mx = NEG_BIG;
        for (var u = 0u; u < U; u++) {
            sc[u] = select(NEG_BIG, x[u * HEADS_KEPT + k], valid[u]);
            mx = max(mx, sc[u]);
        }
        let mv = softmax_move(m[k], l[k], mx);
        var lsum = mv.l;
        for (var u = 0u; u < U; u++) {
            p[u * HEADS_KEPT + k] = softmax_prob(sc[u], mv.m, valid[u]);
            lsum += p[u * HEADS_KEPT + k];
        }
        r.m[k] = mv.m;
        r.l[k] = lsum;
        corr[k] = mv.corr;
    }
    if (TRANSPOSE) {
        for (var g = 0u; g < GROUP; g++) {
            let src = group_base + lane_of_head(g);
            r.corr[g] = subgroupShuffle(corr[0], src);
            for (var u = 0u; u < U; u++) {
                r.p[u * GROUP + g] = subgroupShuffle(p[u], src);
            }
        }
    } else {
        for (var g = 0u; g < GROUP; g++) {
            r.corr[g] = corr[g];
            for (var u = 0u; u < U; u++) {
                r.p[u * GROUP + g] = p[u * GROUP + g];
            }
        }
    }
    return r;
}

// The token groups' merge and the chunk's records: each group's kept states through ml_sh, the
// workgroup's (M, L) per head, then each group's value sums `acc` scaled by exp(m - M) into
// acc_sh, one group at a time; the records of query heads kvh * GROUP .. from acc_sh and (M, L).
// The whole workgroup calls it (it has barriers).
fn merge_token_groups(
    t: u32,
    lane: u32,
    tg: u32,
    m: array<f32, HEADS_KEPT>,
    l: array<f32, HEADS_KEPT>,
    acc: array<vec4<f32>, GROUP * NV>,
    seq: u32,
    kvh: u32,
    buffer: u32,
    chunk: u32,
    d: u32,
) {
    let n_tg = WG / LANES;
    let d4 = d / 4u;
    if (writes_kept(lane)) {
        for (var k = 0u; k < HEADS_KEPT; k++) {
            ml_sh[tg * GROUP + select(k, head_of_lane(lane), TRANSPOSE)] = vec2<f32>(m[k], l[k]);
        }
    }
    workgroupBarrier();
    var big_m: array<f32, GROUP>;
    var big_l: array<f32, GROUP>;
    for (var g = 0u; g < GROUP; g++) {
        var mm = NEG_BIG;
        for (var r = 0u; r < n_tg; r++) {
            mm = max(mm, ml_sh[r * GROUP + g].x);
        }
        var ll = 0.0;
        for (var r = 0u; r < n_tg; r++) {
            let e = ml_sh[r * GROUP + g];
            ll += e.y * softmax_rescale(e.x, mm);
        }
        big_m[g] = mm;
        big_l[g] = ll;
    }
    for (var r = 0u; r < n_tg; r++) {
        if (tg == r) {
            for (var g = 0u; g < GROUP; g++) {
                let f = softmax_rescale(ml_sh[tg * GROUP + g].x, big_m[g]);
                for (var n = 0u; n < NV; n++) {
                    let a = g * d4 + dim4_of(lane, n);
                    var prev = vec4<f32>(0.0);
                    if (r > 0u) {
                        prev = acc_sh[a];
                    }
                    acc_sh[a] = prev + acc[g * NV + n] * f;
                }
            }
        }
        workgroupBarrier();
    }
    for (var e = t; e < GROUP * d4; e += WG) {
        let g = e / d4;
        write_partial_acc4(partial_at(seq, kvh * GROUP + g, buffer, chunk, d) + 4u + 4u * (e % d4), acc_sh[e]);
    }
    if (t < GROUP) {
        write_partial_stats(partial_at(seq, kvh * GROUP + t, buffer, chunk, d), big_m[t], big_l[t]);
    }
}
