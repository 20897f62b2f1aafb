// evict, pass 3: the victims of each page list, exactly. One workgroup per list. With n tokens
// and budget b, the n - b lowest keys (utility key, then list order: older first) are victims,
// found by an 8-pass radix select over the 64-bit keys; a utility threshold (fixed, or adapted
// to the hit rate) may evict more among mass-scored tokens; protected slots are never victims.
// Records the list's hit rate (share of its attention mass kept) and adapts its threshold.
// Under the EKVA allocator (n_groups > 0) the same select runs per expert group, each group
// evicting down to its own budget (`evict/ekva.wgsl#split`), then the list down to its budget
// where protected tokens held a group above its share; no threshold then.

//!import common/pool.wgsl
//!import common/evict.wgsl
//!import common/reduce.wgsl
//!import common/radix.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: EvictParams;
@group(0) @binding(2) var<storage, read> page_list: array<u32>;
@group(0) @binding(3) var<storage, read> page_counts: array<u32>;
@group(0) @binding(4) var<storage, read> page_meta: array<PageMeta>;
@group(0) @binding(5) var<storage, read> slot_meta: array<u32>;
@group(0) @binding(6) var<storage, read> utility: array<u32>;
@group(0) @binding(7) var<storage, read_write> lists: array<ListState>;
@group(0) @binding(8) var<storage, read_write> victim: array<u32>;
@group(0) @binding(9) var<storage, read_write> groups: array<GroupState>;

//!define WG 256u
// WG: invocations per workgroup, a power of two of at least 256 (the histogram's bins). A
// workgroup walks one list, so on a device that allows it the host picks 1024: four times the
// loads in flight per list (on an H200 a select over 64 lists of 8K tokens is latency-bound).
var<workgroup> red_lo: array<u32, WG>;
var<workgroup> known_hi: u32;
var<workgroup> known_lo: u32;
var<workgroup> rank_sh: u32;
var<workgroup> count_sh: u32;
var<workgroup> flag_sh: u32;
var<workgroup> digits_sh: u32;

// The same value in every invocation, as the uniformity analysis can see it.
fn uniform_u32(t: u32, v: u32) -> u32 {
    if (t == 0u) {
        flag_sh = v;
    }
    return workgroupUniformLoad(&flag_sh);
}

// Does key (hi, lo) agree with the digits found before pass `p` (8 bits per pass, hi first)?
fn matches(hi: u32, lo: u32, p: u32, kh: u32, kl: u32) -> bool {
    if (p == 0u) {
        return true;
    }
    if (p < 4u) {
        return (hi >> (32u - 8u * p)) == (kh >> (32u - 8u * p));
    }
    if (hi != kh) {
        return false;
    }
    if (p == 4u) {
        return true;
    }
    return (lo >> (64u - 8u * p)) == (kl >> (64u - 8u * p));
}

fn digit(hi: u32, lo: u32, p: u32) -> u32 {
    if (p < 4u) {
        return (hi >> (24u - 8u * p)) & 255u;
    }
    return (lo >> (56u - 8u * p)) & 255u;
}

const ALL_GROUPS: u32 = 0xffffffffu;
// Every slot not yet a victim (EKVA's list-wide pass after the groups' own). `victim` is zero on
// entry (compaction clears it), and each invocation reads back only the slots it wrote itself
// (every walk gives slot j to invocation j % WG).
const NOT_VICTIMS: u32 = 0xfffffffeu;

fn in_group(slot: u32, g: u32) -> bool {
    if (g == NOT_VICTIMS) {
        return victim[slot] == 0u;
    }
    return g == ALL_GROUPS || expert_group(slot_meta[slot * geo.meta_words + META_EXPERTS], params.n_groups) == g;
}

// Mark the `want` lowest keys (utility, then list order) among the list's slots of group `g`
// (ALL_GROUPS: every slot) as victims; returns their attention mass (the same in every
// invocation). `want` must be uniform and at most the group's unprotected tokens.
fn pick(t: u32, base: u32, n_slots: u32, want: u32, g: u32) -> f32 {
    let P = geo.page_size;
    // Radix select of the want-th smallest key, a digit (8 bits) per pass from the top. It stops
    // early once the want-th key is the last of its digit bucket: then every key whose digits so
    // far are at most the bucket's is a victim, exactly `want` of them.
    if (t == 0u) {
        known_hi = 0u;
        known_lo = 0u;
        rank_sh = want;
        digits_sh = 8u;
    }
    workgroupBarrier();
    if (want == 1u) {
        // One victim (a decode step at its budget appends one token per list): the smallest
        // key, from one walk and a tree reduction instead of up to eight radix passes. Keys are
        // unique (list order in the low word), so it is the radix select's victim.
        var bh = 0xffffffffu;
        var bl = 0xffffffffu;
        for (var j = t; j < n_slots; j += WG) {
            let page = page_list[base + j / P];
            if (j % P < page_meta[page].fill && in_group(page * P + j % P, g)) {
                let hi = utility[page * P + j % P];
                if (hi < bh || (hi == bh && j < bl)) {
                    bh = hi;
                    bl = j;
                }
            }
        }
        red_u[t] = bh;
        red_lo[t] = bl;
        workgroupBarrier();
        for (var off = WG / 2u; off > 0u; off = off / 2u) {
            if (t < off) {
                let oh = red_u[t + off];
                let ol = red_lo[t + off];
                if (oh < red_u[t] || (oh == red_u[t] && ol < red_lo[t])) {
                    red_u[t] = oh;
                    red_lo[t] = ol;
                }
            }
            workgroupBarrier();
        }
        if (t == 0u) {
            known_hi = red_u[0];
            known_lo = red_lo[0];
            digits_sh = 0u;
        }
        workgroupBarrier();
    }
    for (var p = 0u; p < 8u; p++) {
        if (workgroupUniformLoad(&digits_sh) <= p) {
            break;
        }
        if (t < 256u) {
            atomicStore(&hist[t], 0u);
        }
        workgroupBarrier();
        let kh = known_hi;
        let kl = known_lo;
        for (var j = t; j < n_slots; j += WG) {
            let page = page_list[base + j / P];
            if (j % P < page_meta[page].fill && in_group(page * P + j % P, g)) {
                let hi = utility[page * P + j % P];
                if (matches(hi, j, p, kh, kl)) {
                    atomicAdd(&hist[digit(hi, j, p)], 1u);
                }
            }
        }
        workgroupBarrier();
        if (t == 0u) {
            let pick = radix_pick(rank_sh);
            let d = pick.x;
            let r = pick.y;
            rank_sh = r;
            if (p < 4u) {
                known_hi |= d << (24u - 8u * p);
            } else {
                known_lo |= d << (56u - 8u * p);
            }
            if (r == atomicLoad(&hist[d])) {
                digits_sh = p + 1u;
            }
        }
        workgroupBarrier();
    }
    let kh = known_hi;
    let kl = known_lo;
    // The one-victim path leaves digits_sh at 0 (no radix pass) and its key whole.
    let n_digits = select(workgroupUniformLoad(&digits_sh), 8u, want == 1u);
    var em = 0.0;
    for (var j = t; j < n_slots; j += WG) {
        let page = page_list[base + j / P];
        if (j % P < page_meta[page].fill) {
            let slot = page * P + j % P;
            if (prefix_le(utility[slot], j, kh, kl, n_digits) && in_group(slot, g)) {
                victim[slot] = 1u;
                em += bitcast<f32>(slot_meta[slot * geo.meta_words + meta_attn(geo)]);
            }
        }
    }
    return workgroup_sum(t, em);
}

// Are the first `n` digits (1..8) of key (hi, lo) at most those of (kh, kl) (whose later digits
// are zero)?
fn prefix_le(hi: u32, lo: u32, kh: u32, kl: u32, n: u32) -> bool {
    if (n < 4u) {
        return (hi & (0xffffffffu << (32u - 8u * n))) <= kh;
    }
    if (n == 4u) {
        return hi <= kh;
    }
    if (hi != kh) {
        return hi < kh;
    }
    if (n == 8u) {
        return lo <= kl;
    }
    return (lo & (0xffffffffu << (64u - 8u * n))) <= kl;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let li = wg.x + wg.y * 65535u;
    if (li >= params.n_lists) {
        return;
    }
    let P = geo.page_size;
    let base = li * geo.max_pages_per_seq;
    if (t == 0u) {
        count_sh = page_counts[li];
    }
    let n_slots = workgroupUniformLoad(&count_sh) * P;
    var st = lists[li];
    let mass_based = params.policy == POLICY_H2O || params.policy == POLICY_ADAKV || params.policy == POLICY_LRU_PLUS;

    // Tokens, protected tokens, mass.
    var n = 0u;
    var prot = 0u;
    var mass = 0.0;
    for (var j = t; j < n_slots; j += WG) {
        let page = page_list[base + j / P];
        if (j % P < page_meta[page].fill) {
            let slot = page * P + j % P;
            n += 1u;
            if (utility[slot] == PROTECTED) {
                prot += 1u;
            }
            mass += bitcast<f32>(slot_meta[slot * geo.meta_words + meta_attn(geo)]);
        }
    }
    let tokens = uniform_u32(t, workgroup_sum_u(t, n));
    let protected_n = workgroup_sum_u(t, prot);
    let total_mass = workgroup_sum(t, mass);

    var want = 0u;
    var evicted_mass = 0.0;
    let G = params.n_groups;
    if (G == 0u) {
        // Victims wanted: over budget, or (mass-based) under the utility threshold.
        if (st.budget != KEEP_ALL && tokens > st.budget) {
            want = tokens - st.budget;
        }
        let tau = select(params.threshold, st.tau, params.adaptive != 0u);
        if (uniform_u32(t, u32(mass_based && tau > 0.0 && tokens > 0u)) != 0u) {
            // mass < tau x mean mass, as products (correctly rounded everywhere, unlike a
            // quotient), so the CPU reference decides every token the same way.
            let limit = tau * total_mass;
            let n_f = f32(tokens);
            var below = 0u;
            for (var j = t; j < n_slots; j += WG) {
                let page = page_list[base + j / P];
                if (j % P < page_meta[page].fill) {
                    let slot = page * P + j % P;
                    if (utility[slot] != PROTECTED && bitcast<f32>(slot_meta[slot * geo.meta_words + meta_attn(geo)]) * n_f < limit) {
                        below += 1u;
                    }
                }
            }
            want = max(want, workgroup_sum_u(t, below));
        }
        want = uniform_u32(t, min(want, tokens - protected_n));
        if (want > 0u) {
            evicted_mass = pick(t, base, n_slots, want, ALL_GROUPS);
        }
    } else {
        // EKVA: every expert group down to its own budget.
        for (var g = 0u; g < G; g++) {
            let gs = groups[li * G + g];
            var over = 0u;
            if (gs.budget != KEEP_ALL && gs.tokens > gs.budget) {
                over = gs.tokens - gs.budget;
            }
            var want_g = uniform_u32(t, over);
            if (want_g > 0u) {
                var prot_g = 0u;
                for (var j = t; j < n_slots; j += WG) {
                    let page = page_list[base + j / P];
                    if (j % P < page_meta[page].fill && in_group(page * P + j % P, g) && utility[page * P + j % P] == PROTECTED) {
                        prot_g += 1u;
                    }
                }
                want_g = uniform_u32(t, min(want_g, gs.tokens - min(workgroup_sum_u(t, prot_g), gs.tokens)));
                if (want_g > 0u) {
                    evicted_mass += pick(t, base, n_slots, want_g, g);
                }
            }
            if (t == 0u) {
                groups[li * G + g].evicted = want_g;
            }
            want += want_g;
        }
        // A group whose protected tokens (sinks, recent window) exceed its share cannot evict
        // down to it: the list still keeps its own budget, the rest of its victims the lowest
        // keys among every group's tokens not yet chosen.
        // (The condition through a uniform load: `pick` holds barriers, and a browser's
        // validator counts `st`, read from storage, as non-uniform.)
        let over = st.budget != KEEP_ALL && tokens - want > st.budget;
        let rest = uniform_u32(t, select(0u, min(tokens - want - st.budget, tokens - protected_n - want), over));
        if (rest > 0u) {
            evicted_mass += pick(t, base, n_slots, rest, NOT_VICTIMS);
            want += rest;
        }
    }
    if (t == 0u) {
        st.tokens = tokens;
        st.evicted = want;
        st.evicted_total += want;
        st.mass = total_mass;
        st.hit_rate = select(1.0, 1.0 - evicted_mass / total_mass, total_mass > 0.0);
        if (params.adaptive != 0u) {
            st.tau = clamp(st.tau + params.tau_step * (st.hit_rate - params.hit_target), 0.0, 1.0);
        }
        lists[li] = st;
    }
}
