//! CPU dequantisation of GGUF tensor blocks to f32, block layouts exactly as ggml's.

use super::{GgmlType, model_err};
use crate::{Error, Result};

pub(super) fn unsupported(ty: GgmlType, what: &str) -> Error {
    model_err(format!(
        "{what} has type {ty}, which expertkv cannot dequantise on the CPU (it can: F32, F16, BF16, F64, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K)"
    ))
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Decodes `src`, whole blocks of `ty`, into `dst`, whose length must be the blocks' element
/// count.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let (block, size) = (ty.block_size(), ty.type_size());
    let blocks = src.len() as u64 / size;
    if !(src.len() as u64).is_multiple_of(size) || Some(dst.len() as u64) != blocks.checked_mul(block) {
        return Err(Error::Input(format!(
            "dequantize {ty}: {} bytes are not whole {size}-byte blocks of {block} elements each for {} outputs",
            src.len(),
            dst.len()
        )));
    }
    use GgmlType::*;
    match ty {
        F32 => each::<4, 1>(src, dst, |b, y| y[0] = f32::from_le_bytes(*b)),
        F16 => each::<2, 1>(src, dst, |b, y| y[0] = f16_at(b, 0)),
        Bf16 => each::<2, 1>(src, dst, |b, y| y[0] = half::bf16::from_bits(u16::from_le_bytes(*b)).to_f32()),
        F64 => each::<8, 1>(src, dst, |b, y| y[0] = f64::from_le_bytes(*b) as f32),
        Q4_0 => each::<18, 32>(src, dst, block_q4_0),
        Q4_1 => each::<20, 32>(src, dst, block_q4_1),
        Q5_0 => each::<22, 32>(src, dst, block_q5_0),
        Q5_1 => each::<24, 32>(src, dst, block_q5_1),
        Q8_0 => each::<34, 32>(src, dst, block_q8_0),
        Q2K => each::<84, 256>(src, dst, block_q2_k),
        Q3K => each::<110, 256>(src, dst, block_q3_k),
        Q4K => each::<144, 256>(src, dst, block_q4_k),
        Q5K => each::<176, 256>(src, dst, block_q5_k),
        Q6K => each::<210, 256>(src, dst, block_q6_k),
        Q8K => each::<292, 256>(src, dst, block_q8_k),
        other => return Err(unsupported(other, "the data")),
    }
    Ok(())
}

/// Applies `f` to each (block, outputs) pair; the sizes were checked by the caller.
fn each<const S: usize, const B: usize>(src: &[u8], dst: &mut [f32], f: impl Fn(&[u8; S], &mut [f32; B])) {
    let (blocks, _) = src.as_chunks::<S>();
    let (outs, _) = dst.as_chunks_mut::<B>();
    for (b, y) in blocks.iter().zip(outs.iter_mut()) {
        f(b, y);
    }
}

/// Q4_0: f16 scale d, then 16 bytes whose low nibbles are elements 0..16 and high nibbles
/// 16..32; x = (q - 8) * d.
fn block_q4_0(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        let q = b[2 + j];
        y[j] = (i32::from(q & 0xf) - 8) as f32 * d;
        y[j + 16] = (i32::from(q >> 4) - 8) as f32 * d;
    }
}

/// Q4_1: f16 d, f16 m, 16 bytes of nibbles as Q4_0; x = q * d + m.
fn block_q4_1(b: &[u8; 20], y: &mut [f32; 32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for j in 0..16 {
        let q = b[4 + j];
        y[j] = f32::from(q & 0xf) * d + m;
        y[j + 16] = f32::from(q >> 4) * d + m;
    }
}

/// Q5_0: f16 d, u32 of fifth bits (bit j for element j), 16 bytes of nibbles; x = (q - 16) * d.
fn block_q5_0(b: &[u8; 22], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for j in 0..16 {
        let q = b[6 + j];
        let lo = u32::from(q & 0xf) | (((qh >> j) & 1) << 4);
        let hi = u32::from(q >> 4) | (((qh >> (j + 16)) & 1) << 4);
        y[j] = (lo as i32 - 16) as f32 * d;
        y[j + 16] = (hi as i32 - 16) as f32 * d;
    }
}

/// Q5_1: f16 d, f16 m, u32 of fifth bits, 16 bytes of nibbles; x = q * d + m.
fn block_q5_1(b: &[u8; 24], y: &mut [f32; 32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for j in 0..16 {
        let q = b[8 + j];
        let lo = u32::from(q & 0xf) | (((qh >> j) & 1) << 4);
        let hi = u32::from(q >> 4) | (((qh >> (j + 16)) & 1) << 4);
        y[j] = lo as f32 * d + m;
        y[j + 16] = hi as f32 * d + m;
    }
}

/// Q8_0: f16 d, 32 i8; x = q * d.
fn block_q8_0(b: &[u8; 34], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = f32::from(b[2 + j] as i8) * d;
    }
}

/// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block's 12 packed bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    let (sc, m) =
        if j < 4 { (q[j] & 63, q[j + 4] & 63) } else { ((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)) };
    (f32::from(sc), f32::from(m))
}

/// Q2_K: 16 bytes of 4-bit scale/min pairs, 64 bytes of 2-bit quants, f16 d, f16 dmin.
fn block_q2_k(b: &[u8; 84], y: &mut [f32; 256]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let mut out = 0;
    let mut is = 0;
    for n in 0..2 {
        let q = &qs[32 * n..32 * n + 32];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let sc = scales[is];
                is += 1;
                let (dl, ml) = (d * f32::from(sc & 0xf), dmin * f32::from(sc >> 4));
                for l in 0..16 {
                    y[out] = dl * f32::from((q[16 * half + l] >> shift) & 3) - ml;
                    out += 1;
                }
            }
        }
    }
}

/// Q3_K: 32 bytes of high bits, 64 bytes of 2-bit quants, 12 bytes of packed 6-bit scales, f16 d.
fn block_q3_k(b: &[u8; 110], y: &mut [f32; 256]) {
    let (hmask, qs, packed) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    // Unpack the sixteen 6-bit scales as ggml does (low 4 bits from bytes 0..8, high 2 from 8..12).
    let mut scales = [0i8; 16];
    for (i, s) in scales.iter_mut().enumerate() {
        let low = if i < 8 { packed[i] & 0xf } else { packed[i - 8] >> 4 };
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        *s = (low | (high << 4)) as i8 - 32;
    }
    let mut out = 0;
    let mut is = 0;
    let mut m = 1u8;
    for n in 0..2 {
        let q = &qs[32 * n..32 * n + 32];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let dl = d * f32::from(scales[is]);
                is += 1;
                for l in 0..16 {
                    let k = 16 * half + l;
                    let v = i32::from((q[k] >> shift) & 3) - if hmask[k] & m != 0 { 0 } else { 4 };
                    y[out] = dl * v as f32;
                    out += 1;
                }
            }
            m <<= 1;
        }
    }
}

/// Q4_K: f16 d, f16 dmin, 12 bytes of packed 6-bit scales/mins, 128 bytes of nibbles (each 32
/// bytes hold two 32-element sub-blocks: low nibbles then high).
fn block_q4_k(b: &[u8; 144], y: &mut [f32; 256]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for j in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * j, scales);
        let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
        let q = &qs[32 * j..32 * j + 32];
        for l in 0..32 {
            y[64 * j + l] = d * sc1 * f32::from(q[l] & 0xf) - dmin * m1;
            y[64 * j + 32 + l] = d * sc2 * f32::from(q[l] >> 4) - dmin * m2;
        }
    }
}

/// Q5_K: Q4_K plus 32 bytes of fifth bits (bit 2j / 2j+1 of byte l for sub-blocks 2j / 2j+1).
fn block_q5_k(b: &[u8; 176], y: &mut [f32; 256]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for j in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * j, scales);
        let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
        let q = &qs[32 * j..32 * j + 32];
        for l in 0..32 {
            let h1 = if qh[l] & (1 << (2 * j)) != 0 { 16.0 } else { 0.0 };
            let h2 = if qh[l] & (2 << (2 * j)) != 0 { 16.0 } else { 0.0 };
            y[64 * j + l] = d * sc1 * (f32::from(q[l] & 0xf) + h1) - dmin * m1;
            y[64 * j + 32 + l] = d * sc2 * (f32::from(q[l] >> 4) + h2) - dmin * m2;
        }
    }
}

/// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 i8 scales, f16 d; x = d * s * (q - 32).
fn block_q6_k(b: &[u8; 210], y: &mut [f32; 256]) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for n in 0..2 {
        let (ql, qh, sc, y) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..], &mut y[128 * n..]);
        for l in 0..32 {
            let is = l / 16;
            let q1 = i32::from((ql[l] & 0xf) | ((qh[l] & 3) << 4)) - 32;
            let q2 = i32::from((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
            let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            let s = |k: usize| d * f32::from(sc[is + k] as i8);
            y[l] = s(0) * q1 as f32;
            y[l + 32] = s(2) * q2 as f32;
            y[l + 64] = s(4) * q3 as f32;
            y[l + 96] = s(6) * q4 as f32;
        }
    }
}

/// Q8_K: f32 d, 256 i8, 16 i16 block sums (unused here); x = q * d.
fn block_q8_k(b: &[u8; 292], y: &mut [f32; 256]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for j in 0..256 {
        y[j] = f32::from(b[4 + j] as i8) * d;
    }
}
