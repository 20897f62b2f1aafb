//! The recall tier's CPU model (`TierModel`): its slots, positions and key digests, laid out as
//! the GPU's, with the digests' calibration and the page scores `attend/recall.wgsl` chooses by.
//! Capture, the choice and attention with recall are in [`super::recall`].

use super::words::decode_words;
use crate::config::PoolConfig;
use crate::gpu_data::{DIGEST_CALIB_TOKENS, uncalibrated_digests};

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
