// Does this device's f16 arithmetic keep subnormals exactly? With `DENORM`
// (attend/split_quant_tile.wgsl) the tile kernel's value codes are the f16 code x 2^-20: a
// 4-bit code in bits 4..7 of a 16-bit half is that subnormal f16 as it lies, and one in bits
// 0..3 under the exponent bits of 2^-10 (cases[i].w) is 2^-10 + code x 2^-20, which minus 2^-10
// is that subnormal f16 too. Only a device that flushes neither subnormal inputs nor subnormal
// results computes with them. Case i: weights cases[i].x (two f16), a code word cases[i].y, an
// accumulator cases[i].z (two f16); out[i] = (fma(weights, bits 0..3 codes, acc), fma(weights,
// bits 4..7 codes, acc)), the kernel's conversions and packed multiply-add, instruction for
// instruction. CPU side: `core::probe`, run by `Runtime::f16_subnormals`.
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
    let lo = fma(w, h2((c.y & 0x000f000fu) | c.w) - vec2<f16>(0.0009765625h), a);
    let hi = fma(w, h2(c.y & 0x00f000f0u), a);
    out[i] = vec4<f32>(vec2<f32>(lo), vec2<f32>(hi));
}
