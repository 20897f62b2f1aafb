// evict, pass 2: each page list's token budget. One workgroup per (layer, sequence) over its KV
// heads.
//   Every layer's base budget comes from `layer_budgets` (PyramidKV shrinks it with depth; FastV
//   keeps everything before its layer): KEEP_ALL there keeps the whole layer.
//   default: every head keeps the layer's base budget
//   AdaKV:   the (layer, sequence) keeps kv_heads * base_budget tokens; every head gets
//            floor(ada_floor * base_budget), the rest is split in proportion to exp(H_h), H_h the
//            entropy of head h's attention mass over its tokens (spread-out heads get more);
//            integer shares by largest remainder, ties to the lower head
//   Duo:     a head whose attention mass lies at least duo_tau on sinks + recent window is a
//            streaming head and keeps the base budget (sinks + most recent tokens); otherwise a
//            retrieval head keeps everything

//!import common/pool.wgsl
//!import common/evict.wgsl
//!import common/reduce.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: EvictParams;
@group(0) @binding(2) var<storage, read> page_list: array<u32>;
@group(0) @binding(3) var<storage, read> page_counts: array<u32>;
@group(0) @binding(4) var<storage, read> page_meta: array<PageMeta>;
@group(0) @binding(5) var<storage, read> slot_meta: array<u32>;
@group(0) @binding(6) var<storage, read> seq_lens: array<u32>;
@group(0) @binding(7) var<storage, read_write> lists: array<ListState>;
@group(0) @binding(8) var<storage, read> layer_budgets: array<u32>;

const WG: u32 = 256u;
const MAX_HEADS: u32 = 64u;
var<workgroup> weight: array<f32, 64>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let seq = wg.x;
    let layer = params.first_layer + wg.y;
    let base_budget = layer_budgets[layer];
    if (base_budget == KEEP_ALL) {
        if (t < geo.kv_heads) {
            lists[list_index(geo, layer, seq, t)].budget = KEEP_ALL;
        }
        return;
    }
    // Only AdaKV and Duo look at the tokens; every other policy keeps the base budget (select
    // records the lists' mass).
    if (params.policy != POLICY_ADAKV && params.policy != POLICY_DUO) {
        if (t < geo.kv_heads) {
            lists[list_index(geo, layer, seq, t)].budget = base_budget;
        }
        return;
    }
    let P = geo.page_size;
    let len = seq_lens[seq];
    for (var h = 0u; h < geo.kv_heads; h++) {
        let li = list_index(geo, layer, seq, h);
        let n_slots = page_counts[li] * P;
        let base = li * geo.max_pages_per_seq;
        // Pass 1: total mass and the mass on sinks + recent window.
        var total = 0.0;
        var edge = 0.0;
        for (var j = t; j < n_slots; j += WG) {
            let page = page_list[base + j / P];
            if (j % P < page_meta[page].fill) {
                let m = (page * P + j % P) * geo.meta_words;
                let mass = bitcast<f32>(slot_meta[m + meta_attn(geo)]);
                let pos = slot_meta[m + META_POSITION];
                total += mass;
                if (pos < params.sinks || pos + params.window >= len) {
                    edge += mass;
                }
            }
        }
        let tot = workgroup_sum(t, total);
        let edg = workgroup_sum(t, edge);
        // Pass 2 (AdaKV): entropy of the normalised mass.
        var ent = 0.0;
        if (params.policy == POLICY_ADAKV && tot > 0.0) {
            for (var j = t; j < n_slots; j += WG) {
                let page = page_list[base + j / P];
                if (j % P < page_meta[page].fill) {
                    let mass = bitcast<f32>(slot_meta[(page * P + j % P) * geo.meta_words + meta_attn(geo)]);
                    let p = mass / tot;
                    if (p > 0.0) {
                        ent -= p * log(p);
                    }
                }
            }
        }
        let h_ent = workgroup_sum(t, ent);
        if (t == 0u) {
            var st = lists[li];
            st.mass = tot;
            switch params.policy {
                case 4u: {
                    weight[h] = exp(h_ent);
                }
                case 5u: {
                    if (tot > 0.0 && edg >= params.duo_tau * tot) {
                        st.kind = 2u;
                        st.budget = base_budget;
                    } else {
                        st.kind = 1u;
                        st.budget = KEEP_ALL;
                    }
                }
                default: {
                    st.budget = base_budget;
                }
            }
            lists[li] = st;
        }
        workgroupBarrier();
    }
    if (params.policy == POLICY_ADAKV && t == 0u) {
        let H = geo.kv_heads;
        let floor_b = u32(params.ada_floor * f32(base_budget));
        let pool_total = H * base_budget;
        let rest = pool_total - H * floor_b;
        var wsum = 0.0;
        for (var h = 0u; h < H; h++) {
            wsum += weight[h];
        }
        var given = 0u;
        var share: array<u32, 64>;
        var frac: array<f32, 64>;
        for (var h = 0u; h < H; h++) {
            var w = 1.0 / f32(H);
            if (wsum > 0.0) {
                w = weight[h] / wsum;
            }
            let exact = f32(rest) * w;
            share[h] = u32(floor(exact));
            frac[h] = exact - floor(exact);
            given += share[h];
        }
        // Largest remainders first, ties to the lower head.
        for (var left = rest - min(given, rest); left > 0u; left--) {
            var best = 0u;
            for (var h = 1u; h < H; h++) {
                if (frac[h] > frac[best]) {
                    best = h;
                }
            }
            share[best] += 1u;
            frac[best] = -1.0;
        }
        for (var h = 0u; h < H; h++) {
            let li = list_index(geo, layer, seq, h);
            lists[li].budget = floor_b + share[h];
        }
    }
}
