// route, pass 3: count the routing slots each expert received this step (one invocation per
// token; integer atomics, so the counts are exact and order-free).

//!import common/route.wgsl

@group(0) @binding(0) var<uniform> params: RouteParams;
@group(0) @binding(1) var<storage, read> experts: array<u32>;
@group(0) @binding(2) var<storage, read_write> counts: array<atomic<u32>>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let t = gid.x + gid.y * 65535u * 64u;
    if (t >= params.n_tokens) {
        return;
    }
    for (var i = 0u; i < params.top_k; i++) {
        let e = experts[(params.token_base + t) * params.top_k + i];
        if (e < params.n_experts) {
            atomicAdd(&counts[e], 1u);
        }
    }
}
