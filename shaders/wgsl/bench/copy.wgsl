// The roofline: a plain device-to-device copy in 16-byte words, grid-stride.

// must match `CopyParams` in core/src/gpu_data.rs
struct CopyParams {
    n_vec4: u32,
    stride: u32,  // invocations in the whole dispatch
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: CopyParams;
@group(0) @binding(1) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<vec4<u32>>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    for (var i = gid.x; i < params.n_vec4; i += params.stride) {
        dst[i] = src[i];
    }
}
