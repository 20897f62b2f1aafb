// evict, EKVA allocator (between the budget and select passes when it is on): every page list's
// budget is split over expert groups, a cached token belonging to the group of its top-1 expert
// at that layer; select then evicts within each group down to the group's budget.
//   experts:    one workgroup per page list: tokens and share of the list's attention mass per
//               group (the share in units of 2^-24, rounded, so integer atomics sum it exactly
//               in any order)
//   importance: one workgroup per layer, one invocation per expert: importance <- decay x
//               importance + (1 - decay) x (alpha x routing share + (1 - alpha) x mass share),
//               the routing share being the router's moving-average load and the mass share the
//               expert's part of the layer's mass (every list holding mass counts once)
//   split:      one invocation per page list, sequential over the groups (so the float sums
//               have one order, the CPU reference's): a list over budget gives every group
//               holding tokens min(tokens, floor x budget / groups), then water-fills the rest in
//               proportion to importance, no group above its tokens, integer shares by largest
//               remainder with ties to the lower expert. A list within budget keeps everything.

//!import common/pool.wgsl
//!import common/evict.wgsl
//!import common/reduce.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: EvictParams;
@group(0) @binding(2) var<storage, read> page_list: array<u32>;
@group(0) @binding(3) var<storage, read> page_counts: array<u32>;
@group(0) @binding(4) var<storage, read> page_meta: array<PageMeta>;
@group(0) @binding(5) var<storage, read> slot_meta: array<u32>;
@group(0) @binding(6) var<storage, read> lists: array<ListState>;
@group(0) @binding(7) var<storage, read_write> groups: array<GroupState>;
@group(0) @binding(8) var<storage, read_write> importance: array<f32>;
// The router's per-(layer, expert) statistics: `ExpertStats` of common/route.wgsl, 8 words each,
// the moving-average load first.
@group(0) @binding(9) var<storage, read> route_stats: array<u32>;

const WG: u32 = 256u;
const MAX_GROUPS: u32 = 256u;
var<workgroup> tokens_wg: array<atomic<u32>, 256>;
var<workgroup> mass_wg: array<atomic<u32>, 256>;
var<workgroup> count_sh: u32;

@compute @workgroup_size(256)
fn experts(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let li = wg.x + wg.y * 65535u;
    if (li >= params.n_lists) {
        return;
    }
    let G = params.n_groups;
    let P = geo.page_size;
    let base = li * geo.max_pages_per_seq;
    atomicStore(&tokens_wg[t], 0u);
    atomicStore(&mass_wg[t], 0u);
    if (t == 0u) {
        count_sh = page_counts[li];
    }
    let n_slots = workgroupUniformLoad(&count_sh) * P;
    var mass = 0.0;
    for (var j = t; j < n_slots; j += WG) {
        let page = page_list[base + j / P];
        if (j % P < page_meta[page].fill) {
            mass += bitcast<f32>(slot_meta[(page * P + j % P) * geo.meta_words + meta_attn(geo)]);
        }
    }
    let total = workgroup_sum(t, mass);
    for (var j = t; j < n_slots; j += WG) {
        let page = page_list[base + j / P];
        if (j % P < page_meta[page].fill) {
            let m = (page * P + j % P) * geo.meta_words;
            let g = expert_group(slot_meta[m + META_EXPERTS], G);
            atomicAdd(&tokens_wg[g], 1u);
            if (total > 0.0) {
                let share = bitcast<f32>(slot_meta[m + meta_attn(geo)]) / total;
                atomicAdd(&mass_wg[g], u32(round(share * GROUP_MASS_ONE)));
            }
        }
    }
    workgroupBarrier();
    if (t < G) {
        var gs = groups[li * G + t];
        gs.tokens = atomicLoad(&tokens_wg[t]);
        gs.mass = atomicLoad(&mass_wg[t]);
        groups[li * G + t] = gs;
    }
}

@compute @workgroup_size(256)
fn update_importance(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let layer = wg.x;
    let G = params.n_groups;
    let per_layer = geo.max_seqs * geo.kv_heads;
    // The expert's mass over the layer's lists (each list with any mass sums to one), in list
    // order; the layer's total by the workgroup's tree.
    var mass = 0.0;
    if (t < G) {
        for (var i = 0u; i < per_layer; i++) {
            mass += f32(groups[(layer * per_layer + i) * G + t].mass) / GROUP_MASS_ONE;
        }
    }
    let total = workgroup_sum(t, mass);
    if (t >= G) {
        return;
    }
    var share = 0.0;
    if (total > 0.0) {
        share = mass / total;
    }
    let load = bitcast<f32>(route_stats[(layer * G + t) * 8u]);
    let x = params.ekva_alpha * load + (1.0 - params.ekva_alpha) * share;
    let i = layer * G + t;
    importance[i] = params.ekva_decay * importance[i] + (1.0 - params.ekva_decay) * x;
}

@compute @workgroup_size(64)
fn split(@builtin(global_invocation_id) gid: vec3<u32>) {
    let li = gid.x + gid.y * 65535u * 64u;
    if (li >= params.n_lists) {
        return;
    }
    let G = params.n_groups;
    let layer = li / (geo.max_seqs * geo.kv_heads);
    let b = lists[li].budget;
    var n = 0u;
    var n_active = 0u;
    for (var g = 0u; g < G; g++) {
        let c = groups[li * G + g].tokens;
        n += c;
        n_active += u32(c > 0u);
    }
    if (b == KEEP_ALL || n <= b) {
        for (var g = 0u; g < G; g++) {
            groups[li * G + g].budget = select(groups[li * G + g].tokens, KEEP_ALL, b == KEEP_ALL);
        }
        return;
    }
    // Floor: an even share of floor x budget for every group holding tokens.
    let f = u32(params.ekva_floor * f32(b)) / max(n_active, 1u);
    var left = b;
    for (var g = 0u; g < G; g++) {
        let give = min(groups[li * G + g].tokens, f);
        groups[li * G + g].budget = give;
        left -= give;
    }
    // Water filling in proportion to importance (evenly where no group has any).
    var frac: array<f32, MAX_GROUPS>;
    for (var pass_i = 0u; pass_i <= G && left > 0u; pass_i++) {
        var w_sum = 0.0;
        var n_open = 0u;
        for (var g = 0u; g < G; g++) {
            let gs = groups[li * G + g];
            if (gs.budget < gs.tokens) {
                w_sum += max(importance[layer * G + g], 0.0);
                n_open += 1u;
            }
        }
        if (n_open == 0u) {
            break;
        }
        // Groups this round's shares would fill take what they hold; the rest waits for the
        // next round (at most one round per group).
        var filled = false;
        for (var g = 0u; g < G; g++) {
            let gs = groups[li * G + g];
            if (gs.budget < gs.tokens) {
                var w = 1.0 / f32(n_open);
                if (w_sum > 0.0) {
                    w = max(importance[layer * G + g], 0.0) / w_sum;
                }
                let exact = f32(left) * w;
                if (exact >= f32(gs.tokens - gs.budget)) {
                    filled = true;
                    frac[g] = -2.0;
                } else {
                    frac[g] = exact;
                }
            } else {
                frac[g] = -1.0;
            }
        }
        if (filled) {
            for (var g = 0u; g < G; g++) {
                if (frac[g] == -2.0) {
                    let gs = groups[li * G + g];
                    left -= gs.tokens - gs.budget;
                    groups[li * G + g].budget = gs.tokens;
                }
            }
            continue;
        }
        // No group fills: integer parts, then the remainder by largest fraction.
        var given = 0u;
        for (var g = 0u; g < G; g++) {
            if (frac[g] >= 0.0) {
                let s = min(u32(floor(frac[g])), left - given);
                groups[li * G + g].budget += s;
                given += s;
                frac[g] = frac[g] - floor(frac[g]);
            }
        }
        left -= given;
        for (; left > 0u; left--) {
            var best = G;
            for (var g = 0u; g < G; g++) {
                let gs = groups[li * G + g];
                if (frac[g] >= 0.0 && gs.budget < gs.tokens && (best == G || frac[g] > frac[best])) {
                    best = g;
                }
            }
            if (best == G) {
                break;
            }
            groups[li * G + best].budget += 1u;
            frac[best] = -1.0;
        }
        // `left` is 0 unless float rounding left more units than groups: another round.
    }
}
