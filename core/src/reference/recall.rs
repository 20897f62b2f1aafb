//! References of the recall tier (`evict/capture.wgsl`, `evict/capture_copy.wgsl`,
//! `evict/digest.wgsl`, `attend/recall.wgsl`): which victims go where in the tier, their key
//! digests, which tier pages a query recalls, and decode attention over the resident pages and
//! the recalled ones together.

use super::append::{PoolModel, decode_words};
use super::attend::AttentionOutput;
use crate::config::PoolConfig;
use crate::evict::recall::DIGEST_CALIB_TOKENS;
use crate::gpu_data::meta;

/// A calibration for `lists` lists not yet calibrated: centre 0, spread 1, sums 0.
fn uncalibrated(lists: usize, d: usize) -> Vec<f32> {
    let one: Vec<f32> = (0..3 * d).map(|i| if (d..2 * d).contains(&i) { 1.0 } else { 0.0 }).collect();
    one.repeat(lists)
}

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
            calib: uncalibrated(lists, cfg.head_dim as usize),
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

    /// `evict/capture.wgsl` and `evict/capture_copy.wgsl`: every victim (`victim[slot]`) of every
    /// list, in list order, each list's shard rings in shard order and each ring in ring order,
    /// appended to its list's tier; past the tier's end, dropped and counted.
    pub fn capture(&mut self, model: &PoolModel, victim: &[bool]) {
        let c = &model.cfg;
        let (ps, r, vw, pw) = (c.page_size, c.ring_capacity, c.vec_words() as usize, c.page_words() as usize);
        for li in 0..c.n_lists() {
            for s in 0..c.n_shards {
                let key = li * c.n_shards + s;
                let ring = model.rings[key as usize];
                if ring.count == 0 {
                    continue;
                }
                let n = (ring.count - 1) * ps + ring.fill;
                for i in 0..n {
                    let page = model.ring_pages[(key * r + (ring.head + i / ps) % r) as usize];
                    let slot = page * ps + i % ps;
                    if !victim[slot as usize] {
                        continue;
                    }
                    let at = self.count[li as usize];
                    if at >= self.cap {
                        self.dropped += 1;
                        continue;
                    }
                    self.count[li as usize] += 1;
                    let dst = li * self.cap + at;
                    let (sp, ss) = (page as usize, (i % ps) as usize);
                    let (dp, ds) = ((dst / ps) as usize, (dst % ps) as usize);
                    for kv in 0..2 {
                        let s0 = sp * pw + kv * ps as usize * vw + ss * vw;
                        let d0 = dp * pw + kv * ps as usize * vw + ds * vw;
                        self.kv[d0..d0 + vw].copy_from_slice(&model.kv[s0..s0 + vw]);
                    }
                    self.pos[dst as usize] = model.slot_meta[slot as usize * c.meta_words() as usize + meta::POSITION];
                }
            }
        }
        self.digest(c);
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
                self.calib[3 * d * li..3 * d * (li + 1)].copy_from_slice(&uncalibrated(1, d));
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

/// The `pages` highest of `scores` (page indices, the lowest page first among equal scores), as
/// `attend/recall.wgsl` chooses them.
pub fn choose(scores: &[f64], pages: usize) -> Vec<u32> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    order.into_iter().take(pages).map(|p| p as u32).collect()
}

/// `attend/recall.wgsl`'s two-stage choice: the `candidates` best pages by `digest` scores, then
/// the `pages` best of those by `exact` scores (the lowest page first among equal ones, both
/// stages).
pub fn choose_two_stage(digest: &[f64], exact: &[f64], candidates: usize, pages: usize) -> Vec<u32> {
    let mut cands = choose(digest, candidates);
    cands.sort_by(|&a, &b| exact[b as usize].total_cmp(&exact[a as usize]).then(a.cmp(&b)));
    cands.truncate(pages);
    cands
}

/// Check a GPU's two-stage choice `got` (and the true scores it kept, `got_scores`) against the
/// reference's over the same list (`digest` and `exact` page scores, f64): the same pages in
/// order, up to near ties the GPU's f32 sums may order differently (true scores within 1e-4 of
/// each other, or a page whose digest score is that close to the last candidate's, which either
/// side may nominate), and every kept score within 1e-4 of the reference's. Returns the near
/// ties taken, or what differs.
pub fn check_choice(
    got: &[u32],
    got_scores: &[f32],
    digest: &[f64],
    exact: &[f64],
    candidates: usize,
    pages: usize,
) -> Result<u64, String> {
    let want = choose_two_stage(digest, exact, candidates, pages);
    if got.len() != want.len() {
        return Err(format!("recalled {got:?}, the reference {want:?}"));
    }
    let tie = |x: f64| 1e-4 * (1.0 + x.abs());
    let cands = choose(digest, candidates);
    let edge = cands.last().map_or(f64::NEG_INFINITY, |&c| digest[c as usize]);
    let on_edge = |p: u32| (digest[p as usize] - edge).abs() <= tie(edge);
    let mut near = 0;
    for (r, (&g, &w)) in got.iter().zip(&want).enumerate() {
        let (sg, sw) = (exact[g as usize], exact[w as usize]);
        if g != w {
            if (sg - sw).abs() > tie(sw) && !on_edge(g) && !on_edge(w) {
                return Err(format!(
                    "recalled page {g} (true score {sg}) where the reference recalls {w} ({sw}); the reference's {want:?}"
                ));
            }
            near += 1;
        }
        if (f64::from(got_scores[r]) - sg).abs() > tie(sg) {
            return Err(format!("page {g}'s kept score {} against the reference's {sg}", got_scores[r]));
        }
    }
    Ok(near)
}

/// Decode attention (as [`super::attend::attend_decode`]) over each list's resident pages and the
/// tier pages `recalled(li)` names, in f64: `[seq][q_head][head_dim]`. The recalled tokens get
/// no mass (they are not in the pool); the resident tokens' mass is normalised over both.
#[allow(clippy::too_many_arguments)]
pub fn attend_with_recall(
    model: &PoolModel,
    tier: &TierModel,
    layer: u32,
    n_seqs: u32,
    queries: &[f32],
    group: u32,
    scale: f64,
    recalled: &dyn Fn(u32) -> Vec<u32>,
) -> AttentionOutput {
    let c = &model.cfg;
    let (d, hkv, ps) = (c.head_dim as usize, c.kv_heads, c.page_size);
    let hq = (hkv * group) as usize;
    let mut out = vec![0.0; n_seqs as usize * hq * d];
    let mut mass = Vec::new();
    for seq in 0..n_seqs {
        for h in 0..hkv {
            let li = model.list_index(layer, seq, h);
            let resident = model.tokens(layer, seq, h);
            let n = tier.count[li as usize].min(tier.cap);
            let from_tier: Vec<u32> =
                recalled(li).into_iter().flat_map(|p| (p * ps..(p + 1) * ps).filter(move |&j| j < n)).map(|j| li * tier.cap + j).collect();
            let mut masses = vec![0.0; resident.len()];
            for g in 0..group {
                let qh = (h * group + g) as usize;
                let q0 = (seq as usize * hq + qh) * d;
                let q = &queries[q0..q0 + d];
                let dot = |k: Vec<f64>| k.iter().zip(q).map(|(k, q)| k * f64::from(*q)).sum::<f64>() * scale;
                let scores: Vec<f64> = resident
                    .iter()
                    .map(|&(p, s)| dot(model.vector(p, s, 0)))
                    .chain(from_tier.iter().map(|&at| dot(tier.vector(c, at, 0))))
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let l: f64 = w.iter().sum();
                let values = resident.iter().map(|&(p, s)| model.vector(p, s, 1)).chain(from_tier.iter().map(|&at| tier.vector(c, at, 1)));
                for (wt, v) in w.iter().zip(values) {
                    for (o, x) in out[q0..q0 + d].iter_mut().zip(v) {
                        *o += wt / l * x;
                    }
                }
                for (m, wt) in masses.iter_mut().zip(&w) {
                    *m += wt / l;
                }
            }
            mass.extend(resident.iter().zip(masses).map(|(&(p, s), m)| (seq, h, p, s, m)));
        }
    }
    AttentionOutput { out, mass }
}
