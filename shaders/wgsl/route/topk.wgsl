// route, pass 2: top-k experts of each token, one invocation per token. Score = logit + bias;
// the k best by score, ties to the lowest expert index; the hierarchical router first keeps the
// `topk_groups` groups with the best maximum score, the hash router ignores scores. Gates: the
// model's softmax over the logits, renormalised over the chosen experts.

//!import common/route.wgsl

@group(0) @binding(0) var<uniform> params: RouteParams;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> experts: array<u32>;
@group(0) @binding(4) var<storage, read_write> gates: array<f32>;

var<workgroup> bias_sh: array<f32, 256>;

const NEG_INF: f32 = -3.4e38;

fn hash_u32(x: u32) -> u32 {
    var h = x;
    h ^= h >> 16u;
    h *= 0x7feb352du;
    h ^= h >> 15u;
    h *= 0x846ca68bu;
    h ^= h >> 16u;
    return h;
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let E = params.n_experts;
    for (var e = li; e < E; e += 64u) {
        bias_sh[e] = bias[e];
    }
    workgroupBarrier();
    let t = gid.x + gid.y * 65535u * 64u;
    if (t >= params.n_tokens) {
        return;
    }
    let K = params.top_k;
    let row = (params.token_base + t) * E;
    var best_s: array<f32, 8>;
    var best_e: array<u32, 8>;
    for (var i = 0u; i < MAX_K; i++) {
        best_s[i] = NEG_INF;
        best_e[i] = 0xffffffffu;
    }

    if (params.router == ROUTER_HASH) {
        let h = hash_u32(params.token_offset + t) % E;
        for (var i = 0u; i < K; i++) {
            best_e[i] = (h + i) % E;
        }
    } else {
        // Hierarchical: mark the kept groups (as a bit set over at most 256 groups).
        var group_keep: array<u32, 8>;
        for (var i = 0u; i < 8u; i++) {
            group_keep[i] = 0xffffffffu;
        }
        if (params.router == ROUTER_HIERARCHICAL) {
            let per = E / params.n_groups;
            var gs: array<f32, 8>;
            var gi: array<u32, 8>;
            for (var i = 0u; i < MAX_K; i++) {
                gs[i] = NEG_INF;
                gi[i] = 0xffffffffu;
            }
            for (var g = 0u; g < params.n_groups; g++) {
                var m = NEG_INF;
                for (var j = 0u; j < per; j++) {
                    let e = g * per + j;
                    m = max(m, logits[row + e] + bias_sh[e]);
                }
                // Insert (m, g) into the kept groups, strictly better only (ties: lower index).
                if (m > gs[params.topk_groups - 1u] || gi[params.topk_groups - 1u] == 0xffffffffu) {
                    var pos = params.topk_groups - 1u;
                    while (pos > 0u && (m > gs[pos - 1u] || gi[pos - 1u] == 0xffffffffu)) {
                        gs[pos] = gs[pos - 1u];
                        gi[pos] = gi[pos - 1u];
                        pos -= 1u;
                    }
                    gs[pos] = m;
                    gi[pos] = g;
                }
            }
            for (var i = 0u; i < 8u; i++) {
                group_keep[i] = 0u;
            }
            for (var i = 0u; i < params.topk_groups; i++) {
                group_keep[gi[i] / 32u] |= 1u << (gi[i] % 32u);
            }
        }
        let per = select(E, E / params.n_groups, params.router == ROUTER_HIERARCHICAL);
        for (var e = 0u; e < E; e++) {
            let g = e / per;
            if ((group_keep[g / 32u] & (1u << (g % 32u))) == 0u) {
                continue;
            }
            let s = logits[row + e] + bias_sh[e];
            if (best_e[K - 1u] == 0xffffffffu || s > best_s[K - 1u]) {
                var pos = K - 1u;
                while (pos > 0u && (best_e[pos - 1u] == 0xffffffffu || s > best_s[pos - 1u])) {
                    best_s[pos] = best_s[pos - 1u];
                    best_e[pos] = best_e[pos - 1u];
                    pos -= 1u;
                }
                best_s[pos] = s;
                best_e[pos] = e;
            }
        }
    }

    // Gates: softmax of the model's logits over the chosen experts.
    var mx = NEG_INF;
    for (var i = 0u; i < K; i++) {
        mx = max(mx, logits[row + best_e[i]]);
    }
    var w: array<f32, 8>;
    var sum = 0.0;
    for (var i = 0u; i < K; i++) {
        w[i] = exp(logits[row + best_e[i]] - mx);
        sum += w[i];
    }
    let out = (params.token_base + t) * K;
    for (var i = 0u; i < K; i++) {
        experts[out + i] = best_e[i];
        gates[out + i] = w[i] / sum;
    }
}
