//! CPU reference of the page codecs (`shaders/wgsl/common/compress.wgsl`, `compress/*.wgsl`): the
//! same layouts and the same exact arithmetic, so encodings match the GPU bit for bit.

use super::append::PoolModel;
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

/// f16 bits of x rounded to nearest, ties to even, with integer operations (`f16_bits_rne` of
/// common/compress.wgsl); clamped to the finite range, f32 subnormals to zero.
pub fn f16_bits_rne(x: f32) -> u32 {
    let b = x.to_bits();
    let sign = (b >> 16) & 0x8000;
    let exp = (b >> 23) & 0xff;
    let mant = b & 0x7f_ffff;
    if exp == 0 {
        return sign;
    }
    let e = exp as i32 - 112;
    if e >= 31 {
        return sign | 0x7bff;
    }
    let (shift, full, base) = if e >= 1 { (13, mant, (e as u32) << 10) } else { ((1 - e) as u32 + 13, mant | 0x80_0000, 0) };
    if shift >= 25 {
        return sign;
    }
    let mut h = base + (full >> shift);
    let rem = full & ((1 << shift) - 1);
    let half = 1 << (shift - 1);
    if rem > half || (rem == half && h & 1 == 1) {
        h += 1;
    }
    sign | h.min(0x7bff)
}

/// One low-rank coefficient as `compress/encode.wgsl` computes it: f32 sum in ascending order of
/// exact products (basis and input are f16 values), rounded to nearest f16.
fn low_rank_coef(row: &[f32], x: impl Iterator<Item = f32>) -> u32 {
    let mut c = 0f32;
    for (u, v) in row.iter().zip(x) {
        c += u * v;
    }
    f16_bits_rne(c)
}

/// The f16 in the low 16 bits of `bits`, as f32.
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

/// KIVI parameters of values in [lo, hi] (`quant_params` of common/compress.wgsl): the minimum
/// rounded down to f16 in the low half, the scale (range / levels, 15 for int4 and 255 for int8)
/// rounded up to f16 in the high half.
pub fn quant_params(codec: Codec, lo: f32, hi: f32) -> u32 {
    let mn = f16_bits_dir(lo, false);
    let range = hi - f16_value(mn);
    let sc = f16_bits_dir(range * inv_levels(codec), true);
    mn | (sc << 16)
}

/// The code of `x` under `params`: the nearest level in 0..=levels (halves up), clamped; 0 when
/// the scale is 0.
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

/// The value a code stands for: min + code x scale, in f32.
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

/// Encode one raw page (K then V, f16 pairs) into the codec's words. `basis`: the page's
/// (layer, KV head) low-rank basis, K then V, `rank` rows of `head_dim` (empty otherwise).
pub fn encode_page(cfg: &PoolConfig, raw: &[u32], basis: &[f32]) -> Vec<u32> {
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
        Codec::LowRank { rank } | Codec::Lora { rank } => {
            let (r, half_r) = (rank as usize, rank as usize / 2);
            for kv in 0..2 {
                for s in 0..p {
                    for jw in 0..half_r {
                        let row = |j: usize| &basis[(kv * r + j) * d..(kv * r + j + 1) * d];
                        let c0 = low_rank_coef(row(2 * jw), (0..d).map(|i| val(kv, s, i)));
                        let c1 = low_rank_coef(row(2 * jw + 1), (0..d).map(|i| val(kv, s, i)));
                        out[(kv * p + s) * half_r + jw] = c0 | (c1 << 16);
                    }
                }
            }
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

/// Decode K (kv = 0) or V (kv = 1) of slot `s` of an encoded page, as the attention kernel does
/// (low-rank: U^T c in f64, with the page's basis as in [`encode_page`]).
pub fn decode_vector(cfg: &PoolConfig, page: &[u32], basis: &[f32], kv: usize, s: usize) -> Vec<f64> {
    let (p, d) = (cfg.page_size as usize, cfg.head_dim as usize);
    match cfg.codec {
        Codec::LowRank { rank } | Codec::Lora { rank } => {
            let (r, half_r) = (rank as usize, rank as usize / 2);
            let coef: Vec<f64> = (0..r)
                .map(|j| {
                    let w = page[(kv * p + s) * half_r + j / 2];
                    f64::from(f16_value(if j & 1 == 1 { w >> 16 } else { w & 0xffff }))
                })
                .collect();
            (0..d).map(|i| (0..r).map(|j| f64::from(basis[(kv * r + j) * d + i]) * coef[j]).sum()).collect()
        }
        Codec::None => Vec::new(),
        // The other codecs decode to f32 exactly (as attention and the thaw do).
        _ => (0..d).map(|i| f64::from(decode_value(cfg, page, basis, kv, s, i))).collect(),
    }
}

impl PoolModel {
    /// Compress every full raw page that is no longer its ring's newest (`compress/plan` +
    /// `compress/encode`): rings in key order, oldest first, while compressed pages last.
    pub fn compress(&mut self) {
        let cfg = self.cfg.clone();
        // A low-rank codec encodes nothing before its basis is fitted (as on the GPU).
        if cfg.codec == Codec::None || (cfg.codec.is_low_rank() && self.codec_basis.is_empty()) {
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
                let enc = encode_page(&cfg, &self.kv[raw as usize * pw..(raw as usize + 1) * pw], self.basis_of(key as u32));
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

/// Value `i` of K (kv = 0) or V (kv = 1) of slot `s` of an encoded page in f32, as
/// `compress/thaw.wgsl` computes it before rounding to f16 (low rank: the sum over j ascending of
/// basis row j times coefficient j, each product exact in f32).
pub fn decode_value(cfg: &PoolConfig, page: &[u32], basis: &[f32], kv: usize, s: usize, i: usize) -> f32 {
    let (p, d, vw) = (cfg.page_size as usize, cfg.head_dim as usize, cfg.vec_words() as usize);
    let half = |w: u32, i: usize| f16_value(if i & 1 == 1 { w >> 16 } else { w & 0xffff });
    match cfg.codec {
        Codec::LowRank { rank } | Codec::Lora { rank } => {
            let r = rank as usize;
            let c0 = (kv * p + s) * (r / 2);
            let mut x = 0f32;
            for j in 0..r {
                x += basis[(kv * r + j) * d + i] * half(page[c0 + j / 2], j);
            }
            x
        }
        Codec::FastvDims { keep } => {
            let kw = keep as usize / 2;
            if kv == 0 {
                if i >= keep as usize { 0.0 } else { half(page[s * kw + i / 2], i) }
            } else {
                half(page[p * kw + s * vw + i / 2], i)
            }
        }
        Codec::Int8 { group } | Codec::Int4 { group } => {
            let group = group as usize;
            let (kc, vp, vc) = offsets(cfg);
            let b = bits(cfg.codec) as usize;
            let per = 32 / b;
            let row = d * b / 32;
            let (word, prm) = if kv == 0 {
                (page[kc + s * row + i / per], page[i])
            } else {
                (page[vc + s * row + i / per], page[vp + s * (d / group) + i / group])
            };
            dequantize((word >> ((i % per) * b)) & ((1 << b) - 1), prm)
        }
        Codec::None => 0.0,
    }
}

impl PoolModel {
    /// `compress/thaw_plan` + `compress/thaw`, between victim selection and compaction: every
    /// compressed page that compaction would touch (a victim in it, or a slot at or past the
    /// ring's new length) is decoded into a raw page popped from the raw free stack, taking its
    /// slot metadata and victim marks along; its compressed id returns to the codec free stack.
    /// Rings in key order, pages oldest first. A ring whose pages do not fit in the raw pages free
    /// keeps its tokens (its victim marks are cleared) and is counted as deferred.
    pub fn thaw(&mut self, victim: &mut [bool]) {
        let cfg = self.cfg.clone();
        if cfg.codec == Codec::None {
            return;
        }
        let (ps, r) = (cfg.page_size, cfg.ring_capacity as usize);
        let avail = self.ctl.free_top;
        let codec_top = self.ctl.codec_free_top;
        let (mut first, mut taken, mut deferred) = (0u32, 0u32, 0u32);
        let mut jobs = Vec::new();
        for key in 0..cfg.n_keys() as usize {
            let ring = self.rings[key];
            if ring.count == 0 {
                continue;
            }
            let n = (ring.count - 1) * ps + ring.fill;
            let page_at = |k: u32| self.ring_pages[key * r + ((ring.head + k) as usize % r)];
            let v = (0..n).filter(|&i| victim[(page_at(i / ps) * ps + i % ps) as usize]).count() as u32;
            if v == 0 {
                continue;
            }
            let keep = n - v;
            let touched: Vec<u32> = (0..ring.count)
                .filter(|&k| {
                    let page = page_at(k);
                    page >= cfg.n_pages && ((k + 1) * ps > keep || (0..ps).any(|s| victim[(page * ps + s) as usize]))
                })
                .collect();
            let nt = touched.len() as u32;
            if nt == 0 {
                continue;
            }
            if first + nt <= avail {
                for (rank, &k) in touched.iter().enumerate() {
                    let idx = first + rank as u32;
                    let entry = key * r + ((ring.head + k) as usize % r);
                    let cid = self.ring_pages[entry];
                    let raw = self.free_stack[(avail - 1 - idx) as usize];
                    self.ring_pages[entry] = raw;
                    self.page_meta[raw as usize] = PageMeta { owner: key as u32, fill: ps };
                    self.page_meta[cid as usize] = PageMeta { owner: NO_OWNER, fill: 0 };
                    self.codec_free[(codec_top + idx) as usize] = cid;
                    jobs.push((cid, raw, key as u32));
                }
                taken = first + nt;
            } else {
                deferred += 1;
                for i in 0..n {
                    victim[(page_at(i / ps) * ps + i % ps) as usize] = false;
                }
            }
            first += nt;
        }
        self.ctl.free_top = avail - taken;
        self.ctl.codec_free_top = codec_top + taken;
        let (p, vw, pw, mw) = (ps as usize, cfg.vec_words() as usize, cfg.page_words() as usize, cfg.meta_words() as usize);
        let cw = cfg.codec.page_words(cfg.page_size, cfg.head_dim) as usize;
        for (cid, raw, key) in jobs {
            let (cid, raw) = (cid as usize, raw as usize);
            let m = self.slot_meta[cid * p * mw..(cid + 1) * p * mw].to_vec();
            self.slot_meta[raw * p * mw..(raw + 1) * p * mw].copy_from_slice(&m);
            for s in 0..p {
                victim[raw * p + s] = victim[cid * p + s];
                victim[cid * p + s] = false;
            }
            let c0 = (cid - cfg.n_pages as usize) * cw;
            let page = self.codec_kv[c0..c0 + cw].to_vec();
            let basis = self.basis_of(key).to_vec();
            for kv in 0..2 {
                for s in 0..p {
                    for j in 0..vw {
                        let x0 = decode_value(&cfg, &page, &basis, kv, s, 2 * j);
                        let x1 = decode_value(&cfg, &page, &basis, kv, s, 2 * j + 1);
                        self.kv[raw * pw + kv * p * vw + s * vw + j] = f16_bits_rne(x0) | (f16_bits_rne(x1) << 16);
                    }
                }
            }
        }
        let t = &mut self.thaw;
        *t = crate::compress::ThawCounts {
            pages: taken,
            deferred_rings: deferred,
            pages_total: t.pages_total + taken,
            deferred_rings_total: t.deferred_rings_total + deferred,
        };
    }
}

impl PoolModel {
    /// The low-rank basis of the (layer, KV head) that owns ring `key` (K then V), or an empty
    /// slice for the other codecs or before calibration.
    pub fn basis_of(&self, key: u32) -> &[f32] {
        basis_slice(&self.cfg, &self.codec_basis, key)
    }

    /// The Gram matrices `compress/gram.wgsl` builds from the raw pages cached now, in f64: per fit
    /// (layer x KV head, or layer for LoRA), K then V, d x d row-major.
    pub fn calibration_gram(&self) -> Vec<f64> {
        let cfg = &self.cfg;
        let d = cfg.head_dim as usize;
        let lora = matches!(cfg.codec, Codec::Lora { .. });
        let heads_fit = if lora { 1 } else { cfg.kv_heads };
        let mut g = vec![0f64; (cfg.layers * heads_fit) as usize * 2 * d * d];
        for layer in 0..cfg.layers {
            for seq in 0..cfg.max_seqs {
                for head in 0..cfg.kv_heads {
                    let fit = (layer * heads_fit + if lora { 0 } else { head }) as usize;
                    for (page, slot) in self.tokens(layer, seq, head) {
                        if page >= cfg.n_pages {
                            continue;
                        }
                        for kv in 0..2 {
                            let x = self.vector(page, slot, kv);
                            let o = (fit * 2 + kv) * d * d;
                            for i in 0..d {
                                for j in 0..d {
                                    g[o + i * d + j] += x[i] * x[j];
                                }
                            }
                        }
                    }
                }
            }
        }
        g
    }
}

/// The slice of a fitted basis (`KvPool::read_basis`) that belongs to ring `key`'s (layer, KV
/// head), K then V; empty when `basis` is (other codecs, or not fitted yet).
pub fn basis_slice<'a>(cfg: &PoolConfig, basis: &'a [f32], key: u32) -> &'a [f32] {
    let Some(r) = cfg.codec.rank() else { return &[] };
    if basis.is_empty() || key == NO_OWNER {
        return &[];
    }
    let list = key / cfg.n_shards;
    let (layer, head) = (list / (cfg.max_seqs * cfg.kv_heads), list % cfg.kv_heads);
    let n = 2 * (r * cfg.head_dim) as usize;
    let heads = cfg.basis_heads();
    let o = (layer * heads + head.min(heads - 1)) as usize * n;
    basis.get(o..o + n).unwrap_or(&[])
}

/// Eigenvalues (descending) and eigenvectors (as rows, same order) of a symmetric n x n matrix,
/// by cyclic Jacobi rotations in f64.
pub fn symmetric_eigen(a: &[f64], n: usize) -> (Vec<f64>, Vec<Vec<f64>>) {
    let mut m = a.to_vec();
    let mut v = vec![0f64; n * n];
    for i in 0..n {
        v[i * n + i] = 1.0;
    }
    for _sweep in 0..100 {
        let off: f64 = (0..n).flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j))).map(|(i, j)| m[i * n + j].powi(2)).sum();
        let diag: f64 = (0..n).map(|i| m[i * n + i].powi(2)).sum();
        if off <= 1e-26 * diag.max(1e-300) {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = m[p * n + q];
                if apq.abs() < 1e-300 {
                    continue;
                }
                let theta = (m[q * n + q] - m[p * n + p]) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..n {
                    let (mkp, mkq) = (m[k * n + p], m[k * n + q]);
                    m[k * n + p] = c * mkp - s * mkq;
                    m[k * n + q] = s * mkp + c * mkq;
                }
                for k in 0..n {
                    let (mpk, mqk) = (m[p * n + k], m[q * n + k]);
                    m[p * n + k] = c * mpk - s * mqk;
                    m[q * n + k] = s * mpk + c * mqk;
                }
                for k in 0..n {
                    let (vkp, vkq) = (v[k * n + p], v[k * n + q]);
                    v[k * n + p] = c * vkp - s * vkq;
                    v[k * n + q] = s * vkp + c * vkq;
                }
            }
        }
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&i, &j| m[j * n + j].total_cmp(&m[i * n + i]));
    let vals = order.iter().map(|&i| m[i * n + i]).collect();
    let vecs = order.iter().map(|&i| (0..n).map(|k| v[k * n + i]).collect()).collect();
    (vals, vecs)
}

impl PoolModel {
    /// K (kv = 0) or V (kv = 1) of one cached slot of a (head-major) page, as f64; compressed
    /// pages decode as the attention kernel decodes them.
    pub fn vector(&self, page: u32, slot: u32, kv: usize) -> Vec<f64> {
        let cfg = &self.cfg;
        if page >= cfg.n_pages {
            let cw = cfg.codec_page_bytes() as usize / 4;
            let c0 = (page - cfg.n_pages) as usize * cw;
            let basis = self.basis_of(self.page_meta[page as usize].owner);
            return decode_vector(cfg, &self.codec_kv[c0..c0 + cw], basis, kv, slot as usize);
        }
        let vw = cfg.vec_words() as usize;
        let base = page as usize * cfg.page_words() as usize + kv * cfg.page_size as usize * vw + slot as usize * vw;
        super::append::decode_words(&self.kv[base..base + vw], cfg.dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn rne_rounding_matches_half() {
        let mut rng = Rng::new(5);
        for _ in 0..50000 {
            let x = (rng.normal() * 10f64.powf(rng.range(-9.0, 4.7))).clamp(-65504.0, 65504.0) as f32;
            assert_eq!(f16_bits_rne(x), u32::from(half::f16::from_f32(x).to_bits()), "{x}");
        }
        // Ties go to even.
        for bits in [0x3c00u16, 0x3c01, 0x0001, 0x0400] {
            let a = half::f16::from_bits(bits).to_f32();
            let b = half::f16::from_bits(bits + 1).to_f32();
            let mid = (a + b) / 2.0;
            assert_eq!(f16_bits_rne(mid), u32::from(half::f16::from_f32(mid).to_bits()));
        }
    }

    #[test]
    fn jacobi_finds_the_spectrum() {
        let mut rng = Rng::new(6);
        let n = 12;
        let x: Vec<f64> = (0..n * 30).map(|_| rng.normal()).collect();
        let mut a = vec![0f64; n * n];
        for t in 0..30 {
            for i in 0..n {
                for j in 0..n {
                    a[i * n + j] += x[t * n + i] * x[t * n + j];
                }
            }
        }
        let (vals, vecs) = symmetric_eigen(&a, n);
        assert!(vals.windows(2).all(|w| w[0] >= w[1]));
        for (l, v) in vals.iter().zip(&vecs) {
            let av: Vec<f64> = (0..n).map(|i| (0..n).map(|j| a[i * n + j] * v[j]).sum()).collect();
            for i in 0..n {
                assert!((av[i] - l * v[i]).abs() < 1e-9 * vals[0], "A v = l v");
            }
        }
    }

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
