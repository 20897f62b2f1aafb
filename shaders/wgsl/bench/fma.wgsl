// The compute roofline: eight independent chains of vec4 fused multiply-adds per invocation
// (64 flops per iteration), x <- x * m + k, so that latency hides behind the other chains. Each
// invocation writes its sum so nothing is optimised away.

// must match `FmaParams` in core/src/gpu_data.rs
struct FmaParams {
    iters: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: FmaParams;
@group(0) @binding(1) var<storage, read_write> out: array<vec4<f32>>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    let base = vec4<f32>(f32(i % 1024u) * 1e-3, 0.25, 0.5, 0.75);
    let m = vec4<f32>(0.9999);
    let k = vec4<f32>(1e-4);
    var x0 = base;
    var x1 = base + 1.0;
    var x2 = base + 2.0;
    var x3 = base + 3.0;
    var x4 = base + 4.0;
    var x5 = base + 5.0;
    var x6 = base + 6.0;
    var x7 = base + 7.0;
    for (var t = 0u; t < params.iters; t++) {
        x0 = fma(x0, m, k);
        x1 = fma(x1, m, k);
        x2 = fma(x2, m, k);
        x3 = fma(x3, m, k);
        x4 = fma(x4, m, k);
        x5 = fma(x5, m, k);
        x6 = fma(x6, m, k);
        x7 = fma(x7, m, k);
    }
    out[i] = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7;
}
