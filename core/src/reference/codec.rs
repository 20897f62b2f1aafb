//! CPU reference of the page codecs (`shaders/wgsl/common/codec.wgsl`, `codec/*.wgsl`): the
//! same layouts and the same exact arithmetic, so encodings match the GPU bit for bit.

use super::pool::PoolModel;
use crate::config::{Codec, PoolConfig};
use crate::gpu_data::{NO_OWNER, PageMeta};

/// f32 magnitude bits -> (f16 magnitude truncated toward zero, inexact).
fn f16_trunc_mag(a: u32) -> (u32, bool) {
    let exp = (a >> 23) & 0xff;
    let mant = a & 0x7f_ffff;
    if exp == 0 {
        return (0, mant != 0);
    }
    let e = exp as i32 - 112;
    if e >= 31 {
        return (0x7bff, true);
    }
    if e >= 1 {
        return (((e as u32) << 10) | (mant >> 13), mant & 0x1fff != 0);
    }
    let shift = (1 - e) as u32 + 13;
    if shift >= 24 {
        return (0, true);
    }
    let full = mant | 0x80_0000;
    (full >> shift, full & ((1 << shift) - 1) != 0)
}

/// f16 bits of x rounded toward +inf (`up`) or -inf, clamped to the finite range.
pub fn f16_bits_dir(x: f32, up: bool) -> u32 {
    let b = x.to_bits();
    let neg = b >> 31 != 0;
    let (mut h, inexact) = f16_trunc_mag(b & 0x7fff_ffff);
    if inexact && up != neg && h < 0x7bff {
        h += 1;
    }
    if neg && h != 0 {
        h |= 0x8000;
    }
    h
}

pub fn f16_value(bits: u32) -> f32 {
    half::f16::from_bits((bits & 0xffff) as u16).to_f32()
}

fn levels(codec: Codec) -> u32 {
    if matches!(codec, Codec::Int4 { .. }) { 15 } else { 255 }
}

fn bits(codec: Codec) -> u32 {
    if matches!(codec, Codec::Int4 { .. }) { 4 } else { 8 }
}

fn inv_levels(codec: Codec) -> f32 {
    f32::from_bits(if matches!(codec, Codec::Int4 { .. }) { 0x3d88_8889 } else { 0x3b80_8081 })
}

pub fn quant_params(codec: Codec, lo: f32, hi: f32) -> u32 {
    let mn = f16_bits_dir(lo, false);
    let range = hi - f16_value(mn);
    let sc = f16_bits_dir(range * inv_levels(codec), true);
    mn | (sc << 16)
}

pub fn quantize(codec: Codec, x: f32, params: u32) -> u32 {
    let mn = f16_value(params);
    let sc = f16_value(params >> 16);
    if sc == 0.0 {
        return 0;
    }
    let (mut lo, mut hi) = (0u32, levels(codec));
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if x >= mn + (mid as f32 - 0.5) * sc {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

pub fn dequantize(code: u32, params: u32) -> f32 {
    f16_value(params) + code as f32 * f16_value(params >> 16)
}

/// Word offsets of a KIVI page: (K codes, V params, V codes).
fn offsets(cfg: &PoolConfig) -> (usize, usize, usize) {
    let (p, d) = (cfg.page_size as usize, cfg.head_dim as usize);
    let row = d * bits(cfg.codec) as usize / 32;
    let group = match cfg.codec {
        Codec::Int8 { group } | Codec::Int4 { group } => group as usize,
        _ => 1,
    };
    (d, d + p * row, d + p * row + p * (d / group))
}

/// Encode one raw page (K then V, f16 pairs) into the codec's words.
pub fn encode_page(cfg: &PoolConfig, raw: &[u32]) -> Vec<u32> {
    let (p, d, vw) = (cfg.page_size as usize, cfg.head_dim as usize, cfg.vec_words() as usize);
    let val = |kv: usize, s: usize, i: usize| -> f32 {
        let w = raw[kv * p * vw + s * vw + i / 2];
        let h = if i & 1 == 1 { w >> 16 } else { w & 0xffff };
        f16_value(h)
    };
    let mut out = vec![0u32; cfg.codec.page_words(cfg.page_size, cfg.head_dim) as usize];
    match cfg.codec {
        Codec::FastvDims { keep } => {
            let kw = keep as usize / 2;
            for s in 0..p {
                for w in 0..kw {
                    out[s * kw + w] = raw[s * vw + w];
                }
            }
            out[p * kw..p * kw + p * vw].copy_from_slice(&raw[p * vw..2 * p * vw]);
        }
        Codec::Int8 { group } | Codec::Int4 { group } => {
            let group = group as usize;
            let (kc, vp, vc) = offsets(cfg);
            let b = bits(cfg.codec) as usize;
            let per = 32 / b;
            let row = d * b / 32;
            let mut kparams = vec![0u32; d];
            for (i, kp) in kparams.iter_mut().enumerate() {
                let (mut lo, mut hi) = (3.4e38f32, -3.4e38f32);
                for s in 0..p {
                    lo = lo.min(val(0, s, i));
                    hi = hi.max(val(0, s, i));
                }
                *kp = quant_params(cfg.codec, lo, hi);
                out[i] = *kp;
            }
            let groups = d / group;
            let mut vparams = vec![0u32; p * groups];
            for s in 0..p {
                for g in 0..groups {
                    let (mut lo, mut hi) = (3.4e38f32, -3.4e38f32);
                    for i in g * group..(g + 1) * group {
                        lo = lo.min(val(1, s, i));
                        hi = hi.max(val(1, s, i));
                    }
                    vparams[s * groups + g] = quant_params(cfg.codec, lo, hi);
                    out[vp + s * groups + g] = vparams[s * groups + g];
                }
            }
            for s in 0..p {
                for w in 0..row {
                    let (mut kword, mut vword) = (0u32, 0u32);
                    for c in 0..per {
                        let i = w * per + c;
                        kword |= quantize(cfg.codec, val(0, s, i), kparams[i]) << (c * b);
                        vword |= quantize(cfg.codec, val(1, s, i), vparams[s * groups + i / group]) << (c * b);
                    }
                    out[kc + s * row + w] = kword;
                    out[vc + s * row + w] = vword;
                }
            }
        }
        Codec::None => {}
    }
    out
}

/// Decode K (kv = 0) or V (kv = 1) of slot `s` of an encoded page, as the attention kernel does.
pub fn decode_vector(cfg: &PoolConfig, page: &[u32], kv: usize, s: usize) -> Vec<f64> {
    let (p, d, vw) = (cfg.page_size as usize, cfg.head_dim as usize, cfg.vec_words() as usize);
    match cfg.codec {
        Codec::FastvDims { keep } => {
            let kw = keep as usize / 2;
            (0..d)
                .map(|i| {
                    let w = if kv == 0 {
                        if i >= keep as usize {
                            return 0.0;
                        }
                        page[s * kw + i / 2]
                    } else {
                        page[p * kw + s * vw + i / 2]
                    };
                    f64::from(f16_value(if i & 1 == 1 { w >> 16 } else { w & 0xffff }))
                })
                .collect()
        }
        Codec::Int8 { group } | Codec::Int4 { group } => {
            let group = group as usize;
            let (kc, vp, vc) = offsets(cfg);
            let b = bits(cfg.codec) as usize;
            let per = 32 / b;
            let row = d * b / 32;
            (0..d)
                .map(|i| {
                    let (word, prm) = if kv == 0 {
                        (page[kc + s * row + i / per], page[i])
                    } else {
                        (page[vc + s * row + i / per], page[vp + s * (d / group) + i / group])
                    };
                    let code = (word >> ((i % per) * b)) & ((1 << b) - 1);
                    f64::from(dequantize(code, prm))
                })
                .collect()
        }
        Codec::None => Vec::new(),
    }
}

impl PoolModel {
    /// Compress every full raw page that is no longer its ring's newest (`codec/plan` +
    /// `codec/encode`): rings in key order, oldest first, while compressed pages last.
    pub fn compress(&mut self) {
        let cfg = self.cfg.clone();
        if cfg.codec == Codec::None {
            return;
        }
        let r = cfg.ring_capacity as usize;
        let pw = cfg.page_words() as usize;
        let cw = cfg.codec.page_words(cfg.page_size, cfg.head_dim) as usize;
        let mw = cfg.meta_words() as usize;
        let ps = cfg.page_size as usize;
        let avail = self.ctl.codec_free_top;
        let mut taken = 0u32;
        for key in 0..cfg.n_keys() as usize {
            let ring = self.rings[key];
            for k in 0..ring.count {
                let entry = key * r + ((ring.head + k) as usize % r);
                let raw = self.ring_pages[entry];
                if k + 1 >= ring.count || raw >= cfg.n_pages || self.page_meta[raw as usize].fill != cfg.page_size || taken >= avail {
                    continue;
                }
                let cid = self.codec_free[(avail - 1 - taken) as usize];
                self.ring_pages[entry] = cid;
                self.page_meta[cid as usize] = PageMeta { owner: key as u32, fill: cfg.page_size };
                self.page_meta[raw as usize] = PageMeta { owner: NO_OWNER, fill: 0 };
                self.free_stack[(self.ctl.free_top + taken) as usize] = raw;
                let enc = encode_page(&cfg, &self.kv[raw as usize * pw..(raw as usize + 1) * pw]);
                let c0 = (cid - cfg.n_pages) as usize * cw;
                self.codec_kv[c0..c0 + cw].copy_from_slice(&enc);
                let (src, dst) = (raw as usize * ps * mw, cid as usize * ps * mw);
                let m = self.slot_meta[src..src + ps * mw].to_vec();
                self.slot_meta[dst..dst + ps * mw].copy_from_slice(&m);
                taken += 1;
            }
        }
        self.ctl.codec_free_top = avail - taken;
        self.ctl.free_top += taken;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn directed_f16_rounding_brackets_the_value() {
        let mut rng = Rng::new(3);
        for _ in 0..20000 {
            let x = (rng.normal() * 10f64.powf(rng.range(-8.0, 4.5))).clamp(-65504.0, 65504.0) as f32;
            let down = f16_value(f16_bits_dir(x, false));
            let up = f16_value(f16_bits_dir(x, true));
            assert!(down <= x && x <= up, "{x}: [{down}, {up}]");
            // Adjacent halves (or equal when x is one).
            let near = half::f16::from_f32(x).to_f32();
            assert!(down == near || up == near, "{x}: {down} {up} {near}");
        }
    }

    #[test]
    fn quantisers_reconstruct_within_half_a_step() {
        let mut rng = Rng::new(4);
        for codec in [Codec::Int8 { group: 32 }, Codec::Int4 { group: 32 }] {
            for _ in 0..200 {
                let vals: Vec<f32> = (0..16).map(|_| half::f16::from_f64(rng.normal() * 3.0).to_f32()).collect();
                let lo = vals.iter().cloned().fold(f32::INFINITY, f32::min);
                let hi = vals.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let p = quant_params(codec, lo, hi);
                let step = f16_value(p >> 16);
                for x in &vals {
                    let c = quantize(codec, *x, p);
                    assert!(c <= levels(codec));
                    let back = dequantize(c, p);
                    assert!((back - x).abs() <= 0.5 * step * 1.0001 + 1e-7, "{codec:?}: {x} -> {c} -> {back} (step {step})");
                }
            }
        }
    }
}
