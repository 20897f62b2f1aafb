// route, pass 2: top-k experts of each token, one invocation per token. Score = logit + bias;
// the k best by score, ties to the lowest expert index; the hierarchical router first keeps the
// `topk_groups` groups with the best maximum score, the hash router ignores scores. Gates: the
// model's softmax over the logits, renormalised over the chosen experts.

//!import common/route.wgsl

// K (experts per token), TOPK_GROUPS (hierarchical) and E_VEC4 (n_experts % 4 == 0: 16-byte
// loads) are true constants so the running top-k lives in registers (indexed only by constants).
//!define K 8u
//!define TOPK_GROUPS 1u
//!define E_VEC4 true

@group(0) @binding(0) var<uniform> params: RouteParams;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> experts: array<u32>;
@group(0) @binding(4) var<storage, read_write> gates: array<f32>;
@group(0) @binding(5) var<storage, read> logits4: array<vec4<f32>>;  // the same buffer, 16 bytes at a time

var<workgroup> bias_sh: array<f32, 256>;

const NEG_INF: f32 = -3.4e38;
const NONE: u32 = 0xffffffffu;

fn hash_u32(x: u32) -> u32 {
    var h = x;
    h ^= h >> 16u;
    h *= 0x7feb352du;
    h ^= h >> 15u;
    h *= 0x846ca68bu;
    h ^= h >> 16u;
    return h;
}

// The running best K (score descending, ties to the lower expert index).
struct Best {
    s: array<f32, K>,
    e: array<u32, K>,
}

fn best_new() -> Best {
    var b: Best;
    for (var i = 0u; i < K; i++) {
        b.s[i] = NEG_INF;
        b.e[i] = NONE;
    }
    return b;
}

// Experts arrive in increasing index, so a score equal to the K-th best never enters; inside,
// the displaced entry keeps moving down while it beats (or ties with a higher index) the next.
fn best_insert(b: ptr<function, Best>, s: f32, e: u32) {
    if (s > (*b).s[K - 1u]) {
        var cs = s;
        var ce = e;
        for (var i = 0u; i < K; i++) {
            let bs = (*b).s[i];
            let be = (*b).e[i];
            if (cs > bs || (cs == bs && ce < be)) {
                (*b).s[i] = cs;
                (*b).e[i] = ce;
                cs = bs;
                ce = be;
            }
        }
    }
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
    let row = (params.token_base + t) * E;
    var best = best_new();

    if (params.router == ROUTER_HASH) {
        let h = hash_u32(params.token_offset + t) % E;
        for (var i = 0u; i < K; i++) {
            best.e[i] = (h + i) % E;
        }
    } else {
        // Hierarchical: keep the TOPK_GROUPS groups with the best maximum score.
        if (params.router == ROUTER_HIERARCHICAL) {
            let per = E / params.n_groups;
            var gs: array<f32, TOPK_GROUPS>;
            var gi: array<u32, TOPK_GROUPS>;
            for (var i = 0u; i < TOPK_GROUPS; i++) {
                gs[i] = NEG_INF;
                gi[i] = NONE;
            }
            let vec_groups = E_VEC4 && (per % 4u) == 0u;
            for (var g = 0u; g < params.n_groups; g++) {
                var m = NEG_INF;
                if (vec_groups) {
                    for (var j = 0u; j < per; j += 4u) {
                        let e = g * per + j;
                        let v = logits4[(row + e) / 4u];
                        m = max(m, max(max(v.x + bias_sh[e], v.y + bias_sh[e + 1u]), max(v.z + bias_sh[e + 2u], v.w + bias_sh[e + 3u])));
                    }
                } else {
                    for (var j = 0u; j < per; j++) {
                        let e = g * per + j;
                        m = max(m, logits[row + e] + bias_sh[e]);
                    }
                }
                if (m > gs[TOPK_GROUPS - 1u] || gi[TOPK_GROUPS - 1u] == NONE) {
                    var cs = m;
                    var cg = g;
                    for (var i = 0u; i < TOPK_GROUPS; i++) {
                        let bs = gs[i];
                        let bg = gi[i];
                        if (bg == NONE || cs > bs || (cs == bs && cg < bg)) {
                            gs[i] = cs;
                            gi[i] = cg;
                            cs = bs;
                            cg = bg;
                        }
                    }
                }
            }
            // Only the kept groups' experts, groups in increasing index (ties stay with the
            // lower expert).
            var last = 0xffffffffu;
            for (var i = 0u; i < TOPK_GROUPS; i++) {
                // The next kept group in increasing index.
                var g = 0xffffffffu;
                for (var k = 0u; k < TOPK_GROUPS; k++) {
                    let cand = gi[k];
                    if ((last == 0xffffffffu || cand > last) && (g == 0xffffffffu || cand < g)) {
                        g = cand;
                    }
                }
                last = g;
                if (vec_groups) {
                    for (var j = 0u; j < per; j += 4u) {
                        let e = g * per + j;
                        let v = logits4[(row + e) / 4u];
                        best_insert(&best, v.x + bias_sh[e], e);
                        best_insert(&best, v.y + bias_sh[e + 1u], e + 1u);
                        best_insert(&best, v.z + bias_sh[e + 2u], e + 2u);
                        best_insert(&best, v.w + bias_sh[e + 3u], e + 3u);
                    }
                } else {
                    for (var j = 0u; j < per; j++) {
                        let e = g * per + j;
                        best_insert(&best, logits[row + e] + bias_sh[e], e);
                    }
                }
            }
        } else if (E_VEC4) {
            let row4 = row / 4u;
            for (var q = 0u; q < E / 4u; q++) {
                let v = logits4[row4 + q];
                let e = 4u * q;
                best_insert(&best, v.x + bias_sh[e], e);
                best_insert(&best, v.y + bias_sh[e + 1u], e + 1u);
                best_insert(&best, v.z + bias_sh[e + 2u], e + 2u);
                best_insert(&best, v.w + bias_sh[e + 3u], e + 3u);
            }
        } else {
            for (var e = 0u; e < E; e++) {
                best_insert(&best, logits[row + e] + bias_sh[e], e);
            }
        }
    }

    // Gates: softmax of the model's logits over the chosen experts.
    var mx = NEG_INF;
    var w: array<f32, K>;
    for (var i = 0u; i < K; i++) {
        w[i] = logits[row + best.e[i]];
        mx = max(mx, w[i]);
    }
    var sum = 0.0;
    for (var i = 0u; i < K; i++) {
        w[i] = exp(w[i] - mx);
        sum += w[i];
    }
    let out = (params.token_base + t) * K;
    for (var i = 0u; i < K; i++) {
        experts[out + i] = best.e[i];
        gates[out + i] = w[i] / sum;
    }
}
