//! Capability probes that no adapter property answers: small kernels run once per device, each
//! with its CPU reference here.
//!
//! `probe/f16_subnormal.wgsl` asks whether the device's f16 arithmetic keeps subnormals exactly
//! (neither subnormal inputs nor subnormal results flushed to zero). WebGPU and Vulkan leave
//! that to the implementation unless a shader asks (SPIR-V's `DenormPreserve`, which WGSL cannot
//! express), so the tile kernel's subnormal value codes (`DENORM`: code x 2^-20, half of them
//! by a mask alone, half as a subtraction's subnormal result) run only where this probe passes
//! ([`crate::runtime::Runtime::f16_subnormals`]). The probe runs the kernel's own conversions.

use half::f16;

/// Cases of the probe: (two f16 weights, a code word, two f16 accumulators, the exponent bits
/// of 2^-10 in both halves, as the kernel's low-nibble conversion takes them). Weights
/// from 2^-4 to about 2^11 and subnormal or small accumulators, so that some products are
/// subnormal, some are normal results of subnormal inputs, and a flushed input or result moves
/// the answer by several units in the last place.
pub fn f16_subnormal_cases() -> Vec<[u32; 4]> {
    (0u32..64)
        .map(|j| {
            let w = |s: u32| f16::from_f64(2f64.powi((s % 16) as i32 - 4) * (1.0 + f64::from(s / 16 % 4) / 8.0)).to_bits();
            let pair = |a: u16, b: u16| u32::from(a) | (u32::from(b) << 16);
            let weights = pair(w(j), w(j * 7 + 3));
            // Every nibble of the word nonzero: codes 1..15.
            let x = j.wrapping_mul(0x9e37_79b9) ^ 0x5a5a_5a5a;
            let codes = (0..8).fold(0u32, |acc, n| acc | ((1 + (x >> (4 * n)) % 15) << (4 * n)));
            let acc = pair(1 + (j % 7) as u16, f16::from_f64(f64::from(j % 5 + 1) * 2f64.powi(-13)).to_bits());
            [weights, codes, acc, LOW_NIBBLE_BITS]
        })
        .collect()
}

/// The exponent bits of 2^-10 in both f16 halves: a low nibble under them is 2^-10 + code x
/// 2^-20.
const LOW_NIBBLE_BITS: u32 = 0x1400_1400;

/// The exact results of one case: (low-nibble fma of half 0, of half 1, high-nibble fma of half
/// 0, of half 1), with the kernel's conversions: (low nibbles | exponent bits) - 2^-10, and the
/// high nibbles as they lie (both code x 2^-20).
pub fn f16_subnormal_exact(c: [u32; 4]) -> [f64; 4] {
    let code = |i: usize| {
        if i < 2 { f16_half((c[1] & 0x000f_000f) | c[3], i) - 2f64.powi(-10) } else { f16_half(c[1] & 0x00f0_00f0, i % 2) }
    };
    std::array::from_fn(|i| f16_half(c[0], i % 2) * code(i) + f16_half(c[2], i % 2))
}

/// Half `half` (0: low bits) of a u32 as an f16's value.
fn f16_half(x: u32, half: usize) -> f64 {
    f64::from(f16::from_bits((x >> (16 * half)) as u16))
}

/// One unit in the last place of an f16 near `x` (2^-24 for subnormals).
fn f16_ulp(x: f64) -> f64 {
    let a = x.abs();
    if a < 2f64.powi(-14) { 2f64.powi(-24) } else { 2f64.powi(a.log2().floor() as i32 - 10) }
}

/// Whether the probe's outputs are the exact results, each within one f16 unit in the last
/// place (a device may round the product before the sum). Counts the cases that are not.
pub fn f16_subnormal_misses(cases: &[[u32; 4]], got: &[[f32; 4]]) -> usize {
    if got.len() != cases.len() {
        return cases.len().max(1);
    }
    cases
        .iter()
        .zip(got)
        .filter(|(c, g)| {
            let want = f16_subnormal_exact(**c);
            want.iter().zip(g.iter()).any(|(w, g)| {
                let err = (f64::from(*g) - w).abs();
                err.is_nan() || err > f16_ulp(*w)
            })
        })
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference accepts exact f16 results and rejects what a flushing device computes:
    /// subnormal inputs as zero (the sum is the accumulator), subnormal results as zero, or
    /// only the low-nibble subtraction's subnormal result as zero.
    #[test]
    fn subnormal_reference_tells_keeping_from_flushing() {
        let cases = f16_subnormal_cases();
        let round = |x: f64| f32::from(f16::from_f64(x));
        let exact: Vec<[f32; 4]> = cases.iter().map(|c| f16_subnormal_exact(*c).map(round)).collect();
        assert_eq!(f16_subnormal_misses(&cases, &exact), 0);
        let inputs_flushed: Vec<[f32; 4]> = cases.iter().map(|c| [0, 1, 0, 1].map(|half| round(f16_half(c[2], half)))).collect();
        assert_eq!(f16_subnormal_misses(&cases, &inputs_flushed), cases.len());
        let ftz = |x: f64| if x.abs() < 2f64.powi(-14) { 0.0 } else { x };
        let results_flushed: Vec<[f32; 4]> = cases.iter().map(|c| f16_subnormal_exact(*c).map(|x| round(ftz(x)))).collect();
        assert!(f16_subnormal_misses(&cases, &results_flushed) > cases.len() / 4);
        let difference_flushed: Vec<[f32; 4]> = cases
            .iter()
            .map(|c| {
                let e = f16_subnormal_exact(*c);
                [round(f16_half(c[2], 0)), round(f16_half(c[2], 1)), round(e[2]), round(e[3])]
            })
            .collect();
        assert_eq!(f16_subnormal_misses(&cases, &difference_flushed), cases.len());
        assert!(f16_subnormal_misses(&cases, &exact[1..]) > 0, "a short answer is a miss");
    }
}
