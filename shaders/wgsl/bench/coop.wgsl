// Tensor-core probe (wgpu's experimental cooperative matrices, native only; run by
// native/examples/coop_probe.rs): each subgroup-sized workgroup keeps four independent 16 x 16
// f32 accumulators and adds the same 16 x 16 x 16 f16 product to each ITERS times. A and B hold
// small integers, so every sum is exact in f32 and the host checks each accumulator against
// B A * ITERS (naga's coopLoad and coopStore are column-major: the matrices are the
// transposes of the row-major buffers).
enable f16;
enable wgpu_cooperative_matrix;

@group(0) @binding(0) var<storage, read> ab: array<f16>;        // A then B, 16 x 16 row-major each
@group(0) @binding(1) var<storage, read_write> out: array<f32>;  // four 16 x 16 matrices per workgroup (zeros in)

//!define ITERS 1024u

@compute @workgroup_size(32)
fn main(@builtin(workgroup_id) wg: vec3<u32>) {
    let a = coopLoad<coop_mat16x16<f16, A>>(&ab[0], 16u);
    let b = coopLoad<coop_mat16x16<f16, B>>(&ab[256], 16u);
    let o = wg.x * 1024u;
    var c0 = coopLoad<coop_mat16x16<f32, C>>(&out[o], 16u);
    var c1 = coopLoad<coop_mat16x16<f32, C>>(&out[o + 256u], 16u);
    var c2 = coopLoad<coop_mat16x16<f32, C>>(&out[o + 512u], 16u);
    var c3 = coopLoad<coop_mat16x16<f32, C>>(&out[o + 768u], 16u);
    for (var i = 0u; i < ITERS; i++) {
        c0 = coopMultiplyAdd(a, b, c0);
        c1 = coopMultiplyAdd(a, b, c1);
        c2 = coopMultiplyAdd(a, b, c2);
        c3 = coopMultiplyAdd(a, b, c3);
    }
    coopStore(c0, &out[o], 16u);
    coopStore(c1, &out[o + 256u], 16u);
    coopStore(c2, &out[o + 512u], 16u);
    coopStore(c3, &out[o + 768u], 16u);
}
