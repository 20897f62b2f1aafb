// attend_decode, recall pass: between the split and the reduce passes, each page list's evicted
// tokens in its recall tier (evict/capture.wgsl) are scored against the layer's queries in two
// stages: by their key digests (evict/digest.wgsl, in device memory), which nominate the
// CANDIDATES best pages, then by the true q.k of those pages' keys, read from the tier, which
// choose the PAGES best of them. Their attention, over their true keys and values, is written as
// one more partial record per query head (the attention's last partial buffer), so the reduce
// pass merges it with the resident pages' records: attention reads what eviction removed straight
// from the tier (host memory where the device reads it in place), only the candidates' keys and
// the chosen pages' values crossing the bus, and the mass pass normalises the resident tokens'
// attention against the whole softmax.
//
// With BOUND_CANDIDATES > 0, that many of the candidates are nominated first by the pages' key
// bounds (common/recall.wgsl: a page's bound for a query head is sum_i max(q_i lo_i, q_i hi_i),
// at least the q.k of each of its keys), and the digests nominate the rest among the other pages.
//
// A token's digest score is q.centre + sum_i q_i x spread_i x (+1 where its bit is set, else -1),
// the list's calibration standing in for the key; a page's score (digest or true) is its best
// token's over the list's query heads. Both stages take the highest scores, the lowest page first
// among equal ones; `recall_sel` keeps the chosen pages and their true scores for reports and
// tests. With `tier.audit`, the pass first finds the pages the true q.k would choose among all
// (reading every tier key) and counts in `tier_stats` how many of them it chose. One workgroup
// per (KV head, sequence).

//!import common/pool.wgsl
//!import attend/common.wgsl
//!import attend/softmax.wgsl
//!import common/recall.wgsl
//!import common/reduce.wgsl
//!import attend/merge.wgsl

// Query heads per KV head (at most 8), f16 storage, pages recalled per list (PAGES x page_size
// at most 256), pages the digests nominate (PAGES to MAX_CANDIDATES).
override GROUP: u32 = 1u;
override F16: bool = true;
override PAGES: u32 = 4u;
override CANDIDATES: u32 = 32u;
// Candidates the pages' key bounds nominate (0: the digests nominate all).
override BOUND_CANDIDATES: u32 = 0u;
// GROUP's bound (the per-head scores of a token are held in an array of this size).
const MAX_GROUP: u32 = 8u;

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: AttendParams;
@group(0) @binding(2) var<uniform> tier: TierParams;
@group(0) @binding(3) var<storage, read> tier_count: array<u32>;
@group(0) @binding(4) var<storage, read> tier_kv: array<u32>;
@group(0) @binding(5) var<storage, read> queries: array<f32>;
@group(0) @binding(6) var<storage, read> tier_digest: array<u32>;
@group(0) @binding(7) var<storage, read_write> recall_sel: array<u32>;
@group(0) @binding(8) var<storage, read_write> partials: array<f32>;
@group(0) @binding(9) var<storage, read> tier_calib: array<f32>;
@group(0) @binding(10) var<storage, read_write> tier_stats: array<atomic<u32>>;

const WG: u32 = 256u;
// Tier pages a list may hold (the host sizes `tier.cap` within it).
const MAX_TIER_PAGES: u32 = 1024u;

var<workgroup> best: array<atomic<u32>, MAX_TIER_PAGES>;
var<workgroup> pick_key: array<u32, WG>;
var<workgroup> pick_idx: array<u32, WG>;
const MAX_CANDIDATES: u32 = 64u;
var<workgroup> chosen: array<u32, MAX_CANDIDATES>;
var<workgroup> truth: array<u32, 16>;
// The pages the bounds nominated.
var<workgroup> nominated: array<u32, MAX_CANDIDATES>;
// Query heads whose attention one read of the chosen values serves.
const PG: u32 = 4u;
// Words: the attention's probabilities (f32 bits), the digest table before them (f32 bits), and
// while pages are chosen the page index beside each sorted score (PG x WG >= MAX_TIER_PAGES).
var<workgroup> probs: array<u32, PG * WG>;
// The tier slot each chosen token's value is read from.
var<workgroup> slot_of: array<u32, WG>;
var<workgroup> n_sh: u32;

// A float as a key whose unsigned order is the float order (0 for no page: every real score's
// key is above it).
fn key_of(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

fn score_of(k: u32) -> f32 {
    return bitcast<f32>(select(~k, k & 0x7fffffffu, (k & 0x80000000u) != 0u));
}

// Word of tier slot `at`'s K (kv = 0) or V (kv = 1) vector.
fn tier_word(at: u32, kv: u32, w: u32) -> u32 {
    let P = geo.page_size;
    return tier_kv[(at / P) * geo.page_words + kv * P * geo.vec_words + (at % P) * geo.vec_words + w];
}

// The digest score of tier slot `at` for the query at `queries[qo..]` (list `li`'s calibration).
fn digest_dot(at: u32, qo: u32, li: u32) -> f32 {
    let d = geo.head_dim;
    let dw = (d + 31u) / 32u;
    let cb = 3u * d * li;
    var s = 0.0;
    for (var w = 0u; w < dw; w++) {
        let bits = tier_digest[at * dw + w];
        for (var b = 0u; b < min(32u, d - w * 32u); b++) {
            let i = w * 32u + b;
            let sp = tier_calib[cb + d + i];
            s += queries[qo + i] * (tier_calib[cb + i] + select(-sp, sp, ((bits >> b) & 1u) == 1u));
        }
    }
    return s;
}

// Tier words read before any is used: a tier read crosses the bus (host memory), so an
// invocation keeps U of them in flight where reading one and using it would wait for each.
const U: u32 = 8u;

// q . k of tier slot `at` for each of the group's query heads from `qbase`, its key read from the
// tier once (host memory, where every read crosses the bus) for all of them, U words at a time.
fn key_dots(at: u32, qbase: u32) -> array<f32, MAX_GROUP> {
    var s: array<f32, MAX_GROUP>;
    let d = geo.head_dim;
    let vw = geo.vec_words;
    for (var w0 = 0u; w0 < vw; w0 += U) {
        // Every load in range (the last word again past the vector's end, never used).
        var k: array<u32, U>;
        //!unroll
        for (var i = 0u; i < U; i++) {
            k[i] = tier_word(at, 0u, min(w0 + i, vw - 1u));
        }
        //!unroll
        for (var i = 0u; i < U; i++) {
            let w = w0 + i;
            if (w < vw) {
                if (F16) {
                    let kv = unpack2x16float(k[i]);
                    for (var g = 0u; g < GROUP; g++) {
                        s[g] += queries[qbase + g * d + 2u * w] * kv.x + queries[qbase + g * d + 2u * w + 1u] * kv.y;
                    }
                } else {
                    let kv = bitcast<f32>(k[i]);
                    for (var g = 0u; g < GROUP; g++) {
                        s[g] += queries[qbase + g * d + w] * kv;
                    }
                }
            }
        }
    }
    return s;
}

// The digest score written as base_g + sum over the set bits i of 2 q_i spread_i, with
// base_g = q.(centre - spread): `dig_w` (the `probs` table, free until the attention) holds
// 2 q_i spread_i of every query head g at g x head_dim + i and `dig_base` each head's base, so
// a token's score reads its digest words and the table, not the calibration and the queries
// once a bit.
var<workgroup> dig_base: array<f32, MAX_GROUP>;

// Whether the table holds the group's weights (GROUP x head_dim at most PG x WG).
fn digest_table_fits() -> bool {
    return GROUP * geo.head_dim <= PG * WG;
}

// Fill the table and the bases for the queries from `qbase` and list `li`'s calibration.
fn digest_table(t: u32, qbase: u32, li: u32) {
    let d = geo.head_dim;
    let cb = 3u * d * li;
    for (var i = t; i < GROUP * d; i += WG) {
        probs[i] = bitcast<u32>(2.0 * queries[qbase + i] * tier_calib[cb + d + i % d]);
    }
    if (t < GROUP) {
        var b = 0.0;
        for (var i = 0u; i < d; i++) {
            b += queries[qbase + t * d + i] * (tier_calib[cb + i] - tier_calib[cb + d + i]);
        }
        dig_base[t] = b;
    }
    workgroupBarrier();
}

// Tier slot `at`'s digest score for the group's query heads, the largest scaled, from the table.
fn digest_score_table(at: u32) -> f32 {
    let d = geo.head_dim;
    let dw = (d + 31u) / 32u;
    var sg: array<f32, MAX_GROUP>;
    for (var g = 0u; g < GROUP; g++) {
        sg[g] = dig_base[g];
    }
    for (var w = 0u; w < dw; w++) {
        var bits = tier_digest[at * dw + w];
        while (bits != 0u) {
            let i = w * 32u + firstTrailingBit(bits);
            for (var g = 0u; g < GROUP; g++) {
                sg[g] += bitcast<f32>(probs[g * d + i]);
            }
            bits &= bits - 1u;
        }
    }
    var s = NEG_BIG;
    for (var g = 0u; g < GROUP; g++) {
        s = max(s, sg[g] * params.scale);
    }
    return s;
}

// Tier slot `at`'s score for the list's query heads from `qbase`: the largest scaled q.k over
// the group, from its true key (`exact`, read once) or its digest (list `li`'s calibration).
fn group_score(at: u32, qbase: u32, li: u32, exact: bool) -> f32 {
    var s = NEG_BIG;
    // (Not `select`, which would evaluate both and read the tier's key for a digest score.)
    if (exact) {
        let x = key_dots(at, qbase);
        for (var g = 0u; g < GROUP; g++) {
            s = max(s, x[g] * params.scale);
        }
    } else {
        for (var g = 0u; g < GROUP; g++) {
            s = max(s, digest_dot(at, qbase + g * geo.head_dim, li) * params.scale);
        }
    }
    return s;
}

// Tier page `pg` of list `li`'s bound score for the group's query heads from `qbase`: the largest
// scaled sum_i max(q_i lo_i, q_i hi_i).
fn bound_score(li: u32, pg: u32, qbase: u32) -> f32 {
    let d = geo.head_dim;
    let qw = (d + 3u) / 4u;
    let base = tier.bounds_at + (li * (tier.cap / geo.page_size) + pg) * bound_words(d);
    let step = pow2(bitcast<i32>(tier_digest[base]));
    var sg: array<f32, MAX_GROUP>;
    for (var w = 0u; w < qw; w++) {
        let lo_w = tier_digest[base + 1u + w];
        let hi_w = tier_digest[base + 1u + qw + w];
        for (var b = 0u; b < min(4u, d - 4u * w); b++) {
            let i = 4u * w + b;
            let lo = bound_code(lo_w, b) * step;
            let hi = bound_code(hi_w, b) * step;
            for (var g = 0u; g < GROUP; g++) {
                let q = queries[qbase + g * d + i];
                sg[g] += select(q * lo, q * hi, q >= 0.0);
            }
        }
    }
    var s = NEG_BIG;
    for (var g = 0u; g < GROUP; g++) {
        s = max(s, sg[g] * params.scale);
    }
    return s;
}

// Empty the page score table (every page's key 0, below every real score's).
fn clear_best(t: u32) {
    for (var p = t; p < MAX_TIER_PAGES; p += WG) {
        atomicStore(&best[p], 0u);
    }
    workgroupBarrier();
}

// The `count` best pages of `best` into `chosen` (`u32::MAX` past the live ones) and their keys
// into `chosen_key`: the first `pages` entries of `best` sorted with their page indices (in
// `probs`), the highest key first and the lowest page first among equal keys, by a bitonic sort
// over the next power of two (log2(N) (log2(N) + 1) / 2 barriers, where one argmax a page took
// a reduction's eight each). `best` is left permuted.
var<workgroup> chosen_key: array<u32, MAX_CANDIDATES>;

// Whether entry a (key ka, page ia) comes before entry b.
fn sorted_before(ka: u32, ia: u32, kb: u32, ib: u32) -> bool {
    return ka > kb || (ka == kb && ia < ib);
}

fn pick_pages(t: u32, pages: u32, count: u32) {
    var n = 1u;
    while (n < pages) {
        n = n << 1u;
    }
    for (var p = t; p < n; p += WG) {
        probs[p] = p;
        if (p >= pages) {
            atomicStore(&best[p], 0u);
        }
    }
    workgroupBarrier();
    for (var k = 2u; k <= n; k = k << 1u) {
        for (var j = k >> 1u; j > 0u; j = j >> 1u) {
            for (var i = t; i < n; i += WG) {
                let l = i ^ j;
                if (l > i) {
                    let ki = atomicLoad(&best[i]);
                    let kl = atomicLoad(&best[l]);
                    let ii = probs[i];
                    let il = probs[l];
                    // Ascending in the sorted order where i & k is 0, descending elsewhere.
                    let swap = select(sorted_before(ki, ii, kl, il), sorted_before(kl, il, ki, ii), (i & k) == 0u);
                    if (swap) {
                        atomicStore(&best[i], kl);
                        atomicStore(&best[l], ki);
                        probs[i] = il;
                        probs[l] = ii;
                    }
                }
            }
            workgroupBarrier();
        }
    }
    for (var r = t; r < count; r += WG) {
        let k = select(0u, atomicLoad(&best[r]), r < n);
        chosen[r] = select(TIER_NONE, probs[r], k > 0u);
        chosen_key[r] = k;
    }
    workgroupBarrier();
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let h = wg.x;
    let seq = wg.y;
    let P = geo.page_size;
    let d = geo.head_dim;
    let li = list_index(geo, params.layer, seq, h);
    if (t == 0u) {
        n_sh = min(tier_count[li], tier.cap);
    }
    let n = workgroupUniformLoad(&n_sh);
    let pages = (n + P - 1u) / P;
    let first = li * tier.cap;
    let qbase = (seq * params.q_heads + h * GROUP) * d;
    if (tier.audit != 0u) {
        // The pages the true scores choose, then how many of them the digest's choice holds.
        clear_best(t);
        for (var j = t; j < n; j += WG) {
            atomicMax(&best[j / P], key_of(group_score(first + j, qbase, li, true)));
        }
        workgroupBarrier();
        pick_pages(t, pages, PAGES);
        if (t < PAGES) {
            truth[t] = chosen[t];
        }
        workgroupBarrier();
    }
    // Stage 1: the bounds nominate BOUND_CANDIDATES pages, then the digests the rest among the
    // other pages (into `chosen` after the bounds' nominees, which follow them).
    if (BOUND_CANDIDATES > 0u) {
        clear_best(t);
        for (var p = t; p < pages; p += WG) {
            atomicStore(&best[p], key_of(bound_score(li, p, qbase)));
        }
        workgroupBarrier();
        pick_pages(t, pages, BOUND_CANDIDATES);
        for (var r = t; r < BOUND_CANDIDATES; r += WG) {
            nominated[r] = chosen[r];
        }
        workgroupBarrier();
    }
    clear_best(t);
    if (digest_table_fits()) {
        digest_table(t, qbase, li);
        for (var j = t; j < n; j += WG) {
            atomicMax(&best[j / P], key_of(digest_score_table(first + j)));
        }
    } else {
        for (var j = t; j < n; j += WG) {
            atomicMax(&best[j / P], key_of(group_score(first + j, qbase, li, false)));
        }
    }
    workgroupBarrier();
    if (BOUND_CANDIDATES > 0u) {
        for (var r = t; r < BOUND_CANDIDATES; r += WG) {
            if (nominated[r] != TIER_NONE) {
                atomicStore(&best[nominated[r]], 0u);
            }
        }
        workgroupBarrier();
    }
    pick_pages(t, pages, CANDIDATES - BOUND_CANDIDATES);
    for (var r = t; r < BOUND_CANDIDATES; r += WG) {
        chosen[CANDIDATES - BOUND_CANDIDATES + r] = nominated[r];
    }
    workgroupBarrier();
    // Stage 2: the candidates' true scores (their keys read from the tier) choose PAGES.
    clear_best(t);
    for (var c = t; c < CANDIDATES * P; c += WG) {
        let page = chosen[c / P];
        let j = page * P + c % P;
        if (page != TIER_NONE && j < n) {
            atomicMax(&best[page], key_of(group_score(first + j, qbase, li, true)));
        }
    }
    workgroupBarrier();
    pick_pages(t, pages, PAGES);
    if (t < PAGES) {
        let live = chosen_key[t] > 0u;
        recall_sel[li * 2u * PAGES + t] = chosen[t];
        recall_sel[li * 2u * PAGES + PAGES + t] = select(0u, bitcast<u32>(score_of(chosen_key[t])), live);
    }
    if (tier.audit != 0u && t == 0u && n > 0u) {
        var want = 0u;
        var hits = 0u;
        for (var a = 0u; a < PAGES; a++) {
            if (truth[a] == TIER_NONE) {
                continue;
            }
            want += 1u;
            for (var b = 0u; b < PAGES; b++) {
                hits += select(0u, 1u, chosen[b] == truth[a]);
            }
        }
        var top = 0u;
        for (var b = 0u; b < PAGES; b++) {
            top += select(0u, 1u, chosen[b] == truth[0]);
        }
        atomicAdd(&tier_stats[TIER_AUDIT_LISTS], 1u);
        atomicAdd(&tier_stats[TIER_AUDIT_TOP], top);
        atomicAdd(&tier_stats[TIER_AUDIT_WANT], want);
        atomicAdd(&tier_stats[TIER_AUDIT_HITS], hits);
    }
    // Each query head's attention over the chosen pages' tokens: one partial record. Invocation
    // t < PAGES x P scores token t for every query head, its key read once; the values are then
    // read once for up to PG query heads, word by word across the workgroup (invocation t takes
    // word t % VW of every (WG / VW)-th token, U tokens in flight), so consecutive invocations
    // read consecutive words of a vector, and a reduction over the token lanes sums each word.
    let nt = PAGES * P;
    var sg: array<f32, MAX_GROUP>;
    var live = false;
    if (t < nt) {
        let page = chosen[t / P];
        let j = page * P + t % P;
        live = page != TIER_NONE && j < n;
        // A token not attended reads the list's first slot (its probability is 0).
        slot_of[t] = select(first, first + j, live);
        if (live) {
            sg = key_dots(first + j, qbase);
        }
    }
    let vw = geo.vec_words;
    let lanes = WG / vw;
    let word = t % vw;
    let lane = t / vw;
    for (var g0 = 0u; g0 < GROUP; g0 += PG) {
        let gn = min(PG, GROUP - g0);
        var ms: array<f32, PG>;
        var ls: array<f32, PG>;
        for (var gi = 0u; gi < gn; gi++) {
            let s = select(NEG_BIG, sg[g0 + gi] * params.scale, live);
            let m = workgroup_max(t, s);
            let e = softmax_prob(s, m, live);
            probs[gi * WG + t] = bitcast<u32>(e);
            ms[gi] = m;
            // (Its barriers publish `probs`.)
            ls[gi] = workgroup_sum(t, e);
        }
        var a: array<vec2<f32>, PG>;
        if (lane < lanes) {
            for (var c0 = lane; c0 < nt; c0 += lanes * U) {
                var vv: array<u32, U>;
                //!unroll
                for (var i = 0u; i < U; i++) {
                    vv[i] = tier_word(slot_of[min(c0 + i * lanes, nt - 1u)], 1u, word);
                }
                //!unroll
                for (var i = 0u; i < U; i++) {
                    let c = c0 + i * lanes;
                    if (c < nt) {
                        var v = vec2<f32>(bitcast<f32>(vv[i]), 0.0);
                        if (F16) {
                            v = unpack2x16float(vv[i]);
                        }
                        for (var gi = 0u; gi < gn; gi++) {
                            let pr = bitcast<f32>(probs[gi * WG + c]);
                            // (`select`, not a product: a slot not attended may hold any bits.)
                            a[gi] += select(vec2<f32>(0.0), pr * v, pr > 0.0);
                        }
                    }
                }
            }
        }
        for (var gi = 0u; gi < gn; gi++) {
            let qh = h * GROUP + g0 + gi;
            let l = ls[gi];
            pick_key[t] = bitcast<u32>(a[gi].x);
            pick_idx[t] = bitcast<u32>(a[gi].y);
            workgroupBarrier();
            let o = partial_at(seq, qh, tier.slot, 0u, d);
            if (t < vw && l > 0.0) {
                var x = 0.0;
                var y = 0.0;
                for (var r = 0u; r < lanes; r++) {
                    x += bitcast<f32>(pick_key[r * vw + t]);
                    y += bitcast<f32>(pick_idx[r * vw + t]);
                }
                if (F16) {
                    if (2u * t + 1u < d) {
                        write_partial_acc2(o + 4u + 2u * t, vec2<f32>(x, y));
                    } else {
                        partials[o + 4u + 2u * t] = x;
                    }
                } else {
                    partials[o + 4u + t] = x;
                }
            }
            if (t == 0u) {
                write_partial_stats(o, select(NEG_BIG, ms[gi], l > 0.0), l);
            }
            // The slot's other chunks hold nothing.
            for (var c = 1u + t; c < params.n_chunks; c += WG) {
                write_partial_empty(partial_at(seq, qh, tier.slot, c, d));
            }
            workgroupBarrier();
        }
    }
}
