// shard_append, pass 1 of 3: where does each new token go?
// One invocation per token, one plan per (token, KV head). A token's shard comes from the
// configured shard map; its rank among the batch's tokens bound for the same ring decides its
// slot, so placement is deterministic and equal to the CPU reference
// (`core::reference::PoolModel::append`) whatever order the GPU runs in.

//!import common/pool.wgsl
//!import common/append.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: AppendParams;
@group(0) @binding(2) var<storage, read> new_tokens: array<u32>;
@group(0) @binding(3) var<storage, read> rings: array<RingState>;
@group(0) @binding(4) var<storage, read_write> plan: array<TokenPlan>;

const INVALID_KEY: u32 = 0xffffffffu;

// (layer, seq, shard) of a token: every KV head of the token goes to that shard of its own ring.
fn token_key(i: u32) -> u32 {
    let base = i * params.token_words;
    let layer = new_tokens[base + TOKEN_LAYER];
    let seq = new_tokens[base + TOKEN_SEQ];
    if (layer >= geo.layers || seq >= geo.max_seqs) {
        return INVALID_KEY;
    }
    let position = new_tokens[base + TOKEN_POSITION];
    let expert = new_tokens[base + TOKEN_EXPERTS];
    return (layer * geo.max_seqs + seq) * geo.n_shards + shard_from_token_expert(geo, position, expert);
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= params.n_tokens) {
        return;
    }
    let H = geo.kv_heads;
    let tk = token_key(i);
    if (tk == INVALID_KEY) {
        for (var h = 0u; h < H; h++) {
            var out: TokenPlan;
            out.key = INVALID_KEY;
            out.page = NO_OWNER;
            out.flags = PLAN_INVALID;
            plan[i * H + h] = out;
        }
        return;
    }
    // The rank among the batch's tokens bound for the same (layer, seq, shard) is the same for
    // every head; each head's ring then places it from its own state.
    var rank = 0u;
    var total = 0u;
    for (var j = 0u; j < params.n_tokens; j++) {
        if (token_key(j) == tk) {
            total += 1u;
            if (j < i) {
                rank += 1u;
            }
        }
    }
    let ls = tk / geo.n_shards;  // layer * max_seqs + seq
    let shard = tk % geo.n_shards;
    let P = geo.page_size;
    let R = geo.ring_capacity;
    for (var h = 0u; h < H; h++) {
        var out: TokenPlan;
        let key = (ls * H + h) * geo.n_shards + shard;
        out.key = key;
        out.page = NO_OWNER;
        let ring = rings[key];
        let u = ring.fill + rank;
        var flags = 0u;
        if (u < P) {
            // Into the ring's newest page (exists because fill < P).
            out.ring_index = (ring.head + ring.count + R - 1u) % R;
            out.slot = u;
        } else {
            let q = (u - P) / P;  // which new page of this ring, counted in this batch
            out.slot = (u - P) % P;
            out.ring_index = (ring.head + ring.count + q) % R;
            if (out.slot == 0u) {
                flags |= PLAN_OPENS;
                if (ring.count + q < R) {
                    flags |= PLAN_NEEDS_FREE;
                } else {
                    flags |= PLAN_RECYCLES;
                }
            }
        }
        if (rank + 1u == total) {
            flags |= PLAN_LAST_IN_KEY;
        }
        if (rank + 1u == total || out.slot + 1u == P) {
            flags |= PLAN_LAST_IN_PAGE;
        }
        out.rank = rank;
        out.u = u;
        out.flags = flags;
        plan[i * H + h] = out;
    }
}
