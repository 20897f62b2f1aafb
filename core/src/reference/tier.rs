//! The recall tier's CPU model (`TierModel`): its slots, positions and key digests, laid out as
//! the GPU's, with the digests' calibration and the page scores `attend/recall.wgsl` chooses by.
//! Capture, the choice and attention with recall are in [`super::recall`].

use super::words::decode_words;
use crate::config::PoolConfig;
use crate::gpu_data::{DIGEST_CALIB_TOKENS, bound_words, uncalibrated_digests};

/// A pool's recall tier on the CPU, laid out as the GPU's: `cap` slots a list, list after list,
/// in pages of the pool's raw layout (K block then V block).
#[derive(Clone, Debug, PartialEq)]
pub struct TierModel {
    /// Slots per list.
    pub cap: u32,
    /// Tokens each list holds.
    pub count: Vec<u32>,
    /// K/V words of every slot, `page_words` a page of `page_size` slots.
    pub kv: Vec<u32>,
    /// Each slot's position.
    pub pos: Vec<u32>,
    /// Victims dropped past a full tier.
    pub dropped: u64,
    /// Each slot's key digest, `head_dim.div_ceil(32)` words (`evict/digest.wgsl`).
    pub digest: Vec<u32>,
    /// Per list: centre, spread and key sums, `head_dim` each (0, 1, 0 until calibrated).
    pub calib: Vec<f32>,
    /// Per list: slots digested, tokens calibrated on (0: not yet).
    pub digested: Vec<[u32; 2]>,
    /// Each tier page's key bounds, [`bound_words`] words a page (`common/recall.wgsl`): the
    /// GPU keeps them only when they nominate candidates; the reference always does.
    pub bounds: Vec<u32>,
}

impl TierModel {
    /// An empty tier of `cap` slots a list (a multiple of the page size) for `cfg`'s lists.
    pub fn new(cfg: &PoolConfig, cap: u32) -> Self {
        let lists = cfg.n_lists() as usize;
        TierModel {
            cap,
            count: vec![0; lists],
            kv: vec![0; lists * (cap / cfg.page_size) as usize * cfg.page_words() as usize],
            pos: vec![0; lists * cap as usize],
            dropped: 0,
            digest: vec![0; lists * cap as usize * cfg.head_dim.div_ceil(32) as usize],
            calib: uncalibrated_digests(lists as u32, cfg.head_dim),
            digested: vec![[0; 2]; lists],
            bounds: vec![0; lists * (cap / cfg.page_size) as usize * bound_words(cfg.head_dim) as usize],
        }
    }

    /// `evict/digest.wgsl`: every list's slots not yet digested get their key digest; a list
    /// holding [`DIGEST_CALIB_TOKENS`] tokens or more for the first time calibrates on all of them
    /// (sums in f32 in slot order, as the GPU's) and digests them all again.
    pub fn digest(&mut self, cfg: &PoolConfig) {
        let (d, dw) = (cfg.head_dim as usize, cfg.head_dim.div_ceil(32) as usize);
        for li in 0..cfg.n_lists() as usize {
            let n = self.count[li].min(self.cap);
            let [mut from, mut cal] = self.digested[li];
            let first = li as u32 * self.cap;
            if from >= n && !(cal == 0 && n >= DIGEST_CALIB_TOKENS) {
                continue;
            }
            let keys: Vec<Vec<f32>> = (0..n).map(|j| self.vector(cfg, first + j, 0).iter().map(|&x| x as f32).collect()).collect();
            let ps = cfg.page_size;
            for pg in from / ps..n.div_ceil(ps) {
                self.page_bounds(cfg, li as u32, pg, &keys[(pg * ps) as usize..n.min((pg + 1) * ps) as usize]);
            }
            let cb = 3 * d * li;
            if cal == 0 && n >= DIGEST_CALIB_TOKENS {
                (cal, from) = (n, 0);
                for i in 0..d {
                    let s = keys.iter().fold(0f32, |s, k| s + k[i]);
                    let c = s / n as f32;
                    let a = keys.iter().fold(0f32, |a, k| a + (k[i] - c).abs());
                    self.calib[cb + i] = c;
                    self.calib[cb + d + i] = a / n as f32;
                    self.calib[cb + 2 * d + i] = s;
                }
            }
            for j in from..n {
                let k = &keys[j as usize];
                for w in 0..dw {
                    let mut bits = 0u32;
                    for b in 0..32.min(d - w * 32) {
                        let i = w * 32 + b;
                        let x = if cal > 0 { k[i] * cal as f32 } else { k[i] };
                        if x >= self.calib[cb + 2 * d + i] {
                            bits |= 1 << b;
                        }
                    }
                    self.digest[(first + j) as usize * dw + w] = bits;
                }
            }
            self.digested[li] = [n, cal];
        }
    }

    /// `evict/digest.wgsl`'s key bounds of tier page `pg` of list `li`, whose live slots hold
    /// `keys`: the exponent e of the page's largest |key| m (the smallest with m <= 127 x 2^e, at
    /// least -126), then each dimension's minimum rounded down and maximum rounded up to a multiple
    /// of 2^e, as i8 codes, four a word (every scaling exact, so the words equal the GPU's).
    fn page_bounds(&mut self, cfg: &PoolConfig, li: u32, pg: u32, keys: &[Vec<f32>]) {
        let (ps, d) = (cfg.page_size, cfg.head_dim as usize);
        let m = keys.iter().flatten().fold(0f32, |m, &x| m.max(x.abs()));
        let e = bound_exponent(m);
        let inv = pow2(-e);
        let qw = d.div_ceil(4);
        let base = ((li * (self.cap / ps) + pg) as u64 * bound_words(cfg.head_dim)) as usize;
        self.bounds[base] = e as u32;
        for w in 0..qw {
            let (mut lo_w, mut hi_w) = (0u32, 0u32);
            for b in 0..4.min(d - 4 * w) {
                let i = 4 * w + b;
                let lo = keys.iter().fold(3.4e38f32, |a, k| a.min(k[i]));
                let hi = keys.iter().fold(-3.4e38f32, |a, k| a.max(k[i]));
                lo_w |= ((lo * inv).floor() as i32 as u32 & 0xff) << (8 * b);
                hi_w |= ((hi * inv).ceil() as i32 as u32 & 0xff) << (8 * b);
            }
            self.bounds[base + 1 + w] = lo_w;
            self.bounds[base + 1 + qw + w] = hi_w;
        }
    }

    /// `attend/recall.wgsl`'s bound scores of list `li`'s tier pages for its query heads
    /// `heads`: per page, the largest scaled sum_i max(q_i lo_i, q_i hi_i) over the heads, in f64.
    pub fn bound_page_scores(&self, cfg: &PoolConfig, li: u32, heads: &[&[f32]], scale: f64) -> Vec<f64> {
        let (ps, d) = (cfg.page_size, cfg.head_dim as usize);
        let n = self.count[li as usize].min(self.cap);
        let qw = d.div_ceil(4);
        (0..n.div_ceil(ps))
            .map(|pg| {
                let base = ((li * (self.cap / ps) + pg) as u64 * bound_words(cfg.head_dim)) as usize;
                let step = f64::from(pow2(self.bounds[base] as i32));
                let code = |word: u32, b: usize| f64::from((word >> (8 * b)) as u8 as i8);
                heads
                    .iter()
                    .map(|q| {
                        (0..d)
                            .map(|i| {
                                let lo = code(self.bounds[base + 1 + i / 4], i % 4) * step;
                                let hi = code(self.bounds[base + 1 + qw + i / 4], i % 4) * step;
                                let q = f64::from(q[i]);
                                if q >= 0.0 { q * hi } else { q * lo }
                            })
                            .sum::<f64>()
                            * scale
                    })
                    .fold(f64::NEG_INFINITY, f64::max)
            })
            .collect()
    }

    /// `attend/recall.wgsl`'s digest page scores of list `li` for its query heads `heads`: per
    /// tier page, the largest scaled digest score over its tokens and the heads (q.centre plus
    /// q_i x spread_i signed by each bit), in f64.
    pub fn digest_page_scores(&self, cfg: &PoolConfig, li: u32, heads: &[&[f32]], scale: f64) -> Vec<f64> {
        let (d, dw) = (cfg.head_dim as usize, cfg.head_dim.div_ceil(32) as usize);
        let n = self.count[li as usize].min(self.cap);
        let cb = 3 * d * li as usize;
        let (centre, spread) = (&self.calib[cb..cb + d], &self.calib[cb + d..cb + 2 * d]);
        let mut best = vec![f64::NEG_INFINITY; n.div_ceil(cfg.page_size) as usize];
        for j in 0..n {
            let bits = &self.digest[(li * self.cap + j) as usize * dw..][..dw];
            for q in heads {
                let s: f64 = (0..d)
                    .map(|i| {
                        let sp = f64::from(spread[i]);
                        let sign = if (bits[i / 32] >> (i % 32)) & 1 == 1 { sp } else { -sp };
                        f64::from(q[i]) * (f64::from(centre[i]) + sign)
                    })
                    .sum::<f64>()
                    * scale;
                let b = &mut best[(j / cfg.page_size) as usize];
                *b = b.max(s);
            }
        }
        best
    }

    /// Tier slot `at`'s K (`kv` 0) or V (1) vector, decoded.
    pub fn vector(&self, cfg: &PoolConfig, at: u32, kv: usize) -> Vec<f64> {
        let (ps, vw, pw) = (cfg.page_size, cfg.vec_words() as usize, cfg.page_words() as usize);
        let o = (at / ps) as usize * pw + kv * ps as usize * vw + (at % ps) as usize * vw;
        decode_words(&self.kv[o..o + vw], cfg.dtype)
    }

    /// Empty sequence `seq`'s lists of every layer (their digests uncalibrated again).
    pub fn release_sequence(&mut self, cfg: &PoolConfig, seq: u32) {
        let d = cfg.head_dim as usize;
        for layer in 0..cfg.layers {
            for h in 0..cfg.kv_heads {
                let li = ((layer * cfg.max_seqs + seq) * cfg.kv_heads + h) as usize;
                self.count[li] = 0;
                self.digested[li] = [0; 2];
                self.calib[3 * d * li..3 * d * (li + 1)].copy_from_slice(&uncalibrated_digests(1, cfg.head_dim));
            }
        }
    }

    /// `attend/recall.wgsl`'s page scores of list `li` for its query heads `heads` (each
    /// `[head_dim]`): per tier page, the largest scaled q.k over its tokens and the heads.
    pub fn page_scores(&self, cfg: &PoolConfig, li: u32, heads: &[&[f32]], scale: f64) -> Vec<f64> {
        let n = self.count[li as usize].min(self.cap);
        let mut best = vec![f64::NEG_INFINITY; n.div_ceil(cfg.page_size) as usize];
        for j in 0..n {
            let k = self.vector(cfg, li * self.cap + j, 0);
            for q in heads {
                let s = k.iter().zip(q.iter()).map(|(k, q)| k * f64::from(*q)).sum::<f64>() * scale;
                let b = &mut best[(j / cfg.page_size) as usize];
                *b = b.max(s);
            }
        }
        best
    }
}

/// 2^e for e in -126..=127 (`common/compress.wgsl`'s `pow2`).
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// `common/recall.wgsl`'s `bound_exponent`: the smallest e (at least -126) with m <= 127 x 2^e.
fn bound_exponent(m: f32) -> i32 {
    if m == 0.0 {
        return 0;
    }
    let mut e = (((m.to_bits() >> 23) & 0xff) as i32 - 127 - 6).max(-126);
    if m > 127.0 * pow2(e) {
        e += 1;
    }
    e
}
