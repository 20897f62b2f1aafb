// shard_append, pass 0 (when routing ran on the GPU): copy each new token's experts and gates
// from the router's output into its token record, so the batch needs no host round trip.
// The batch is ordered [layer][token of the layer]: token i is the (i % per_layer)-th of layer
// i / per_layer and takes router row first_row + (i / per_layer) * row_stride + i % per_layer
// (first_row: the first layer's rows, when a staged batch is one layer of a forward pass).

// must match `ApplyParams` in core/src/gpu_data.rs
struct ApplyParams {
    n_tokens: u32,
    token_words: u32,
    per_layer: u32,
    row_stride: u32,
    first_row: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

//!import common/pool.wgsl
//!import common/append.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: ApplyParams;
@group(0) @binding(2) var<storage, read> experts: array<u32>;
@group(0) @binding(3) var<storage, read> gates: array<f32>;
@group(0) @binding(4) var<storage, read_write> new_tokens: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let t = gid.x;
    if (t >= params.n_tokens) {
        return;
    }
    let k = geo.top_k;
    let row = params.first_row + (t / params.per_layer) * params.row_stride + t % params.per_layer;
    let base = t * params.token_words + TOKEN_EXPERTS;
    for (var i = 0u; i < k; i++) {
        new_tokens[base + i] = experts[row * k + i];
        new_tokens[base + k + i] = bitcast<u32>(gates[row * k + i]);
    }
}
