// f32 <-> f16 conversions done with integer operations, so the GPU and the CPU (the `half`
// crate, core/src/reference) produce the same bits: WGSL leaves the rounding of f32 -> f16
// conversions to the implementation.

// f32 magnitude bits -> (f16 magnitude bits truncated toward zero, inexact flag).
fn f16_trunc_mag(a: u32) -> vec2<u32> {
    let exp = (a >> 23u) & 0xffu;
    let mant = a & 0x7fffffu;
    if (exp == 0u) {
        return vec2<u32>(0u, select(0u, 1u, mant != 0u));
    }
    let e = i32(exp) - 112;  // - 127 + 15
    if (e >= 31) {
        return vec2<u32>(0x7bffu, 1u);
    }
    if (e >= 1) {
        return vec2<u32>((u32(e) << 10u) | (mant >> 13u), select(0u, 1u, (mant & 0x1fffu) != 0u));
    }
    let shift = u32(1 - e) + 13u;
    if (shift >= 24u) {
        return vec2<u32>(0u, 1u);
    }
    let full = mant | 0x800000u;
    return vec2<u32>(full >> shift, select(0u, 1u, (full & ((1u << shift) - 1u)) != 0u));
}

// f16 bits of x rounded toward +inf (up) or -inf (down); finite x, clamped to the finite range.
fn f16_bits_dir(x: f32, up: bool) -> u32 {
    let b = bitcast<u32>(x);
    let neg = (b >> 31u) != 0u;
    let t = f16_trunc_mag(b & 0x7fffffffu);
    var h = t.x;
    if (t.y != 0u && up != neg && h < 0x7bffu) {
        h += 1u;
    }
    if (neg && h != 0u) {
        h |= 0x8000u;
    }
    return h;
}

// f16 bits of x rounded to nearest, ties to even; finite x, clamped to the finite range (f32
// subnormals round to zero).
fn f16_bits_rne(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    let sign = (b >> 16u) & 0x8000u;
    let exp = (b >> 23u) & 0xffu;
    let mant = b & 0x7fffffu;
    if (exp == 0u) {
        return sign;
    }
    let e = i32(exp) - 112;
    if (e >= 31) {
        return sign | 0x7bffu;
    }
    var shift = 13u;
    var full = mant;
    var base = 0u;
    if (e >= 1) {
        base = u32(e) << 10u;
    } else {
        shift = u32(1 - e) + 13u;
        full = mant | 0x800000u;
        if (shift >= 25u) {
            return sign;
        }
    }
    var h = base + (full >> shift);
    let rem = full & ((1u << shift) - 1u);
    let half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u) == 1u)) {
        h += 1u;
    }
    return sign | min(h, 0x7bffu);
}

fn f16_value(bits: u32) -> f32 {
    return unpack2x16float(bits & 0xffffu).x;
}
