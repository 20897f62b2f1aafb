// Does this device's f16 arithmetic keep subnormals exactly? The tile kernel's value codes can
// become f16 by a mask alone (`DENORM` in attend/split_quant_tile.wgsl): a 4-bit code in bits
// 0..3 (or 4..7) of a 16-bit half is the subnormal f16 code x 2^-24 (or 2^-20), which only a
// device that neither flushes subnormal inputs nor subnormal results computes with. Case i:
// weights cases[i].x (two f16), a code word cases[i].y, an accumulator cases[i].z (two f16);
// out[i] = (fma(weights, low-nibble codes, acc), fma(weights, high-nibble codes, acc)), the
// same reinterpretation and packed multiply-add the kernel does. CPU side: `Runtime::f16_subnormals`.
enable f16;

@group(0) @binding(0) var<storage, read> cases: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> out: array<vec4<f32>>;

fn h2(x: u32) -> vec2<f16> {
    return vec2<f16>(unpack2x16float(x));
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.x;
    if (i >= arrayLength(&cases)) {
        return;
    }
    let c = cases[i];
    let w = h2(c.x);
    let a = h2(c.z);
    let lo = fma(w, h2(c.y & 0x000f000fu), a);
    let hi = fma(w, h2(c.y & 0x00f000f0u), a);
    out[i] = vec4<f32>(vec2<f32>(lo), vec2<f32>(hi));
}
