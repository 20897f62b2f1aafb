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

// Layout check (coop_probe, before the timing): the attention kernel's way of addressing
// matrices, workgroup arrays of vec4<f16> with the stride counted in vec4: A read row-major
// (coopLoadT) from vec4 1 on, B column-major from vec4 2 on, stride 6 vec4 (24 f16); the
// 16 x 16 product stored column-major into out[0..256]. The host compares it with both readings
// of the stride (vec4 or f16 units). The same product again from a zero-constructed
// accumulator into out[256..512] (the first starts from out's zeros). Then the same numbers
// through a workgroup array of vec4<u32> (each u32 two f16), offsets and stride counted in
// vec4<u32> (8 f16): A from vec4 1, B from vec4 2, stride 3, into out[512..768].
var<workgroup> lay_sh: array<vec4<f16>, 104>;
var<workgroup> lay32_sh: array<vec4<u32>, 52>;

@compute @workgroup_size(32)
fn layout_check(@builtin(local_invocation_index) t: u32) {
    for (var e = t; e < 104u; e += 32u) {
        lay_sh[e] = vec4<f16>(ab[4u * e], ab[4u * e + 1u], ab[4u * e + 2u], ab[4u * e + 3u]);
    }
    for (var e = t; e < 52u; e += 32u) {
        var v: vec4<u32>;
        for (var i = 0u; i < 4u; i++) {
            v[i] = pack2x16float(vec2<f32>(f32(ab[8u * e + 2u * i]), f32(ab[8u * e + 2u * i + 1u])));
        }
        lay32_sh[e] = v;
    }
    workgroupBarrier();
    let a = coopLoadT<coop_mat16x16<f16, A>>(&lay_sh[1], 6u);
    let b = coopLoad<coop_mat16x16<f16, B>>(&lay_sh[2], 6u);
    var c = coopLoad<coop_mat16x16<f32, C>>(&out[0], 16u);
    c = coopMultiplyAdd(a, b, c);
    var z = coop_mat16x16<f32, C>();
    z = coopMultiplyAdd(a, b, z);
    workgroupBarrier();
    let a32 = coopLoadT<coop_mat16x16<f16, A>>(&lay32_sh[1], 3u);
    let b32 = coopLoad<coop_mat16x16<f16, B>>(&lay32_sh[2], 3u);
    var c32 = coopLoad<coop_mat16x16<f32, C>>(&out[0], 16u);
    c32 = coopMultiplyAdd(a32, b32, c32);
    workgroupBarrier();
    coopStore(c, &out[0], 16u);
    coopStore(z, &out[256], 16u);
    coopStore(c32, &out[512], 16u);
}
