//! References of the recall tier (`evict/capture.wgsl`, `evict/capture_copy.wgsl`,
//! `evict/digest.wgsl`, `attend/recall.wgsl`): which victims go where in the tier, their key
//! digests, which tier pages a query recalls, and decode attention over the resident pages and
//! the recalled ones together.

use super::append::PoolModel;
use super::attend::AttentionOutput;
pub use super::tier::TierModel;
use crate::gpu_data::meta;

impl TierModel {
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
}

/// The `pages` highest of `scores` (page indices, the lowest page first among equal scores), as
/// `attend/recall.wgsl` chooses them.
pub fn choose(scores: &[f64], pages: usize) -> Vec<u32> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    order.into_iter().take(pages).map(|p| p as u32).collect()
}

/// How `attend/recall.wgsl` nominates a list's candidate pages: the `bound_candidates` best by
/// the pages' key bounds, then the `candidates - bound_candidates` best of the other pages by
/// their digests (page scores of each, f64; `bounds` may be empty when `bound_candidates` is 0).
#[derive(Clone, Copy, Debug)]
pub struct Nomination<'a> {
    /// Digest page scores ([`TierModel::digest_page_scores`]).
    pub digest: &'a [f64],
    /// Bound page scores ([`TierModel::bound_page_scores`]).
    pub bounds: &'a [f64],
    /// Pages nominated in all.
    pub candidates: usize,
    /// Of which the bounds nominate.
    pub bound_candidates: usize,
}

impl Nomination<'_> {
    /// The pages the bounds nominate, then those the digests do (each the lowest page first
    /// among equal scores).
    pub fn nominate(&self) -> (Vec<u32>, Vec<u32>) {
        let by_bounds = if self.bound_candidates > 0 { choose(self.bounds, self.bound_candidates) } else { Vec::new() };
        let mut order: Vec<usize> = (0..self.digest.len()).filter(|&p| !by_bounds.contains(&(p as u32))).collect();
        order.sort_by(|&a, &b| self.digest[b].total_cmp(&self.digest[a]).then(a.cmp(&b)));
        let by_digest = order.into_iter().take(self.candidates - self.bound_candidates).map(|p| p as u32).collect();
        (by_bounds, by_digest)
    }
}

/// `attend/recall.wgsl`'s two-stage choice: the candidates `nom` nominates, then the `pages`
/// best of those by `exact` scores (the lowest page first among equal ones).
pub fn choose_two_stage(nom: &Nomination<'_>, exact: &[f64], pages: usize) -> Vec<u32> {
    let (mut cands, by_digest) = nom.nominate();
    cands.extend(by_digest);
    cands.sort_by(|&a, &b| exact[b as usize].total_cmp(&exact[a as usize]).then(a.cmp(&b)));
    cands.truncate(pages);
    cands
}

/// Check a GPU's two-stage choice `got` (and the true scores it kept, `got_scores`) against the
/// reference's over the same list (`nom`'s nominating scores and `exact` page scores, f64): the
/// same pages in order, up to near ties the GPU's f32 sums may order differently (true scores
/// within 1e-4 of each other, or a page whose bound or digest score is that close to the last
/// page that ranking nominated, which either side may nominate), and every kept score within
/// 1e-4 of the reference's. Returns the near ties taken, or what differs.
pub fn check_choice(got: &[u32], got_scores: &[f32], nom: &Nomination<'_>, exact: &[f64], pages: usize) -> Result<u64, String> {
    let want = choose_two_stage(nom, exact, pages);
    if got.len() != want.len() {
        return Err(format!("recalled {got:?}, the reference {want:?}"));
    }
    let tie = |x: f64| 1e-4 * (1.0 + x.abs());
    let (by_bounds, by_digest) = nom.nominate();
    let edge = |v: &[u32], s: &[f64]| v.last().map_or(f64::NEG_INFINITY, |&c| s[c as usize]);
    let (bound_edge, digest_edge) = (edge(&by_bounds, nom.bounds), edge(&by_digest, nom.digest));
    let on_edge = |p: u32| {
        (nom.digest[p as usize] - digest_edge).abs() <= tie(digest_edge)
            || (nom.bound_candidates > 0 && (nom.bounds[p as usize] - bound_edge).abs() <= tie(bound_edge))
    };
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
