//! The CPU lockstep of the staged step: a [`PoolModel`] appended, evicted and compressed beside
//! the GPU pool, with attention, QUEST selection and eviction checked at every layer of every
//! step, and the whole pool compared by [`Pipeline::verify`].

use serde::Serialize;

use super::Pipeline;
use crate::append::KvPool;
use crate::error::{Error, Result};
use crate::evict::Scheduler;
use crate::evict::quest::Quest;
use crate::evict::recall::RecallTier;
use crate::gpu_data::{ListState, meta};
use crate::reference::PoolModel;
use crate::reference::recall::{Nomination, TierModel, attend_with_recall, check_choice};
use crate::runtime::Runtime;

/// What the CPU reference check found ([`Pipeline::verify`] returns an error instead where the
/// pool differs, and the lockstep where any attention, selection or eviction does).
#[derive(Clone, Debug, Serialize)]
pub struct VerifyReport {
    /// Tokens the reference pool holds at the end, summed over sequences (counted at the last
    /// layer, KV head 0).
    pub tokens_checked: u64,
    /// Attention passes (layer and batch or step) checked against the f64 reference.
    pub attention_checked: u64,
    /// Largest absolute error of an attention output element against the f64 reference, over every
    /// checked pass.
    pub attention_max_abs_err: f64,
    /// The worst error's share of its element's tolerance
    /// ([`crate::attend::Attention::output_tolerance`]); at most 1, or the check fails.
    pub attention_worst_share: f64,
}

/// What the CPU lockstep has checked so far.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Checked {
    attention: u64,
    max_abs_err: f64,
    worst_share: f64,
}

/// A read's attention mass (one slot, summed over its KV head's query heads) against the f64
/// reference's: `MASS_ATOL + MASS_RTOL x` the reference's mass of the read, plus the f32 sum's
/// rounding (see [`Pipeline::check_layer`]).
const MASS_RTOL: f64 = 1e-4;
/// See [`MASS_RTOL`]: a floor for reads of almost no mass.
const MASS_ATOL: f64 = 1e-8;

pub(super) fn verify_err(message: String) -> Error {
    Error::Gpu { during: "verification against the CPU reference".into(), message }
}

/// The lockstep's routing of one layer: the reference's bias from the statistics the step
/// started from (`route/bias.wgsl`'s, in f64) against the bias the GPU routed with (within
/// `1e-5 * (1 + |bias|)`: a few f32 operations, a logarithm at most), then the reference's top-k
/// over the layer's logits with that f32 bias (`logit + bias` is one f32 addition on both sides,
/// so the choice is exact): the GPU's experts must equal the reference's and its gates lie within
/// 1e-6 (an f32 softmax over at most `top_k` values, against f64). Returns the experts the
/// reference chose and the gates as the GPU rounded them to f32 once checked (the pool stores
/// f32 gates, which the lockstep compares bit for bit), which the lockstep's pool then appends.
pub fn check_routing(
    p: &crate::gpu_data::RouteParams,
    stats_before: &[crate::gpu_data::ExpertStats],
    logits: &[f32],
    gpu_bias: &[f32],
    gpu_experts: &[u32],
    gpu_gates: &[f32],
    step: u32,
) -> Result<(Vec<u32>, Vec<f32>)> {
    use crate::reference::route::{bias, topk};
    let (e, k) = (p.n_experts as usize, p.top_k as usize);
    let layer = p.layer as usize;
    let want_bias = bias(p, &stats_before[layer * e..(layer + 1) * e]);
    for (x, (g, w)) in gpu_bias.iter().zip(&want_bias).enumerate() {
        if (f64::from(*g) - w).abs() > 1e-5 * (1.0 + w.abs()) {
            return Err(verify_err(format!("step {step}, layer {}: expert {x}'s routing bias is {g}, the reference {w}", p.layer)));
        }
    }
    // The reference reads its layer's rows from the start of `logits`.
    let local = crate::gpu_data::RouteParams { token_base: 0, ..*p };
    let (experts, gates) = topk(&local, logits, gpu_bias);
    for t in 0..p.n_tokens as usize {
        let (got, want) = (&gpu_experts[t * k..(t + 1) * k], &experts[t * k..(t + 1) * k]);
        if got != want {
            return Err(verify_err(format!("step {step}, layer {}: token {t} routed to {got:?}, the reference {want:?}", p.layer)));
        }
        for i in 0..k {
            let (g, w) = (gpu_gates[t * k + i], gates[t * k + i]);
            if (f64::from(g) - w).abs() > 1e-6 {
                return Err(verify_err(format!(
                    "step {step}, layer {}: token {t}'s gate of expert {} is {g}, the reference {w}",
                    p.layer, want[i]
                )));
            }
        }
    }
    Ok((experts, gpu_gates[..gates.len()].to_vec()))
}

/// The model path's carried check: between the pool the eviction check left at the last step
/// (`prev`, equal to the GPU's then) and the GPU's pool before this step's eviction (`now`), only
/// this step's appends and attention may have acted. Every ring still begins with the pages it
/// had; every slot `prev` held is still in its page with the same K/V words, position, experts
/// and gates, its accesses free to grow and its attention mass not smaller. Raw pages (a page
/// codec moves a page to compressed storage as it fills; the caller checks only a pool without
/// one).
pub fn check_carried(prev: &PoolModel, now: &PoolModel, step: u32) -> Result<()> {
    use crate::gpu_data::NO_OWNER;
    let c = &prev.cfg;
    let (ps, mw, pw, vw) = (c.page_size as usize, c.meta_words() as usize, c.page_words() as usize, c.vec_words() as usize);
    let (r, attn) = (c.ring_capacity as usize, meta::attn(c.top_k as usize));
    let bad = |what: String| Err(verify_err(format!("step {step}: since the last checked eviction, {what}")));
    for (key, (a, b)) in prev.rings.iter().zip(&now.rings).enumerate() {
        if b.count < a.count {
            return bad(format!("ring {key} went from {} pages to {}", a.count, b.count));
        }
        for i in 0..a.count as usize {
            let (pa, pb) = (prev.ring_pages[key * r + (a.head as usize + i) % r], now.ring_pages[key * r + (b.head as usize + i) % r]);
            if pa != pb {
                return bad(format!("ring {key}'s page {i} is {pb}, was {pa}"));
            }
        }
    }
    for (p, (a, b)) in prev.page_meta.iter().zip(&now.page_meta).enumerate() {
        if a.owner == NO_OWNER {
            continue;
        }
        if b.owner != a.owner || b.fill < a.fill {
            return bad(format!("page {p} (owner {}, fill {}) became owner {}, fill {}", a.owner, a.fill, b.owner, b.fill));
        }
        for s in 0..a.fill as usize {
            let m = (p * ps + s) * mw;
            let changed = (0..mw)
                .filter(|&w| w != meta::LAST_ACCESS && w != meta::ACCESS_COUNT && w != attn)
                .find(|&w| prev.slot_meta[m + w] != now.slot_meta[m + w]);
            if let Some(w) = changed {
                return bad(format!(
                    "slot {s} of page {p}: metadata word {w} is {:#010x}, was {:#010x}",
                    now.slot_meta[m + w],
                    prev.slot_meta[m + w]
                ));
            }
            let (ma, mb) = (f32::from_bits(prev.slot_meta[m + attn]), f32::from_bits(now.slot_meta[m + attn]));
            if mb.is_nan() || mb < ma {
                return bad(format!("slot {s} of page {p}: attention mass {mb}, was {ma}"));
            }
            for kv in 0..2 {
                let at = p * pw + kv * ps * vw + s * vw;
                if prev.kv[at..at + vw] != now.kv[at..at + vw] {
                    return bad(format!("slot {s} of page {p}: its {} words changed", ["K", "V"][kv]));
                }
            }
        }
    }
    Ok(())
}

/// The lockstep's eviction: every slot's utility key and every list's budget against the
/// reference (exactly; LRU+'s float utility within 1e-5, AdaKV's shares within a token), then
/// the reference evicts with the GPU's keys and budgets (and EKVA groups) and the utility
/// threshold as the kernel applies it, and every list's counts must agree (tokens, victims
/// exactly; kept attention and the adaptive threshold within 1e-4). The pool it leaves is
/// compared in [`Pipeline::verify`].
pub async fn check_eviction(
    rt: &Runtime,
    s: &Scheduler,
    m: &mut PoolModel,
    step: u32,
    lens: &[u32],
    before: &[ListState],
    after: &[ListState],
) -> Result<()> {
    use crate::gpu_data::{from_orderable, policies};
    let p = s.params(step);
    let keys = s.read_utility(rt).await?;
    for (slot, want) in m.evict_scores(&p, lens).iter().enumerate() {
        let (Some(w), g) = (*want, keys[slot]) else { continue };
        let same = if p.policy == policies::LRU_PLUS && w != u32::MAX && g != u32::MAX {
            let (gf, wf) = (from_orderable(g), from_orderable(w));
            (gf - wf).abs() <= 1e-5 * (1.0 + wf.abs())
        } else {
            g == w
        };
        if !same {
            return Err(verify_err(format!("step {step}: utility key of slot {slot} is {g:#010x}, the reference {w:#010x}")));
        }
    }
    for (li, (g, w)) in after.iter().zip(m.evict_budgets(&p, lens, before, &s.layer_budgets)).enumerate() {
        let off = if p.policy == policies::ADAKV { g.budget.abs_diff(w.budget) > 1 } else { g.budget != w.budget || g.kind != w.kind };
        if off {
            return Err(verify_err(format!(
                "step {step}: list {li}'s budget is {} ({}), the reference {} ({})",
                g.budget, g.kind, w.budget, w.kind
            )));
        }
    }
    // The reference starts from the lists as they were, with the budgets the GPU set.
    let mut lists: Vec<ListState> =
        after.iter().zip(before).map(|(a, b)| ListState { tau: b.tau, evicted_total: b.evicted_total, ..*a }).collect();
    match &s.ekva {
        Some(e) => {
            let mut groups = s.read_groups(rt).await?;
            check_ekva_groups(rt, s, m, step, &p, after, &groups, e.n_experts).await?;
            m.evict_grouped(&keys, &mut lists, Some((&mut groups, e.n_experts)));
        }
        None => {
            m.evict_thresholded(&keys, &mut lists, &p, s.select_wg);
        }
    }
    if let Some(t) = s.read_thaw(rt).await?
        && (t.pages, t.deferred_rings) != (m.thaw.pages, m.thaw.deferred_rings)
    {
        return Err(verify_err(format!(
            "step {step}: the eviction thawed {} compressed pages and deferred {} rings, the reference {} and {}",
            t.pages, t.deferred_rings, m.thaw.pages, m.thaw.deferred_rings
        )));
    }
    for (li, (g, w)) in after.iter().zip(&lists).enumerate() {
        let floats = (g.hit_rate - w.hit_rate).abs() < 1e-4 && (g.tau - w.tau).abs() < 1e-4;
        if (g.tokens, g.evicted, g.evicted_total) != (w.tokens, w.evicted, w.evicted_total) || !floats {
            return Err(verify_err(format!("step {step}: list {li} after eviction is {g:?}, the reference {w:?}")));
        }
    }
    Ok(())
}

/// EKVA's groups against the reference before they decide the victims: every (list, expert
/// group)'s tokens exactly (`ekva_groups`, over the pool as it was before the eviction), and each
/// group's budget as the reference splits the list's budget from the GPU's tokens and importance
/// (`ekva_split`; within one token, the f32 divisions may round a remainder the other way on some
/// devices, with the list's budget kept exactly where its tokens exceed it).
#[allow(clippy::too_many_arguments)]
async fn check_ekva_groups(
    rt: &Runtime,
    s: &Scheduler,
    m: &PoolModel,
    step: u32,
    p: &crate::gpu_data::EvictParams,
    lists: &[ListState],
    groups: &[crate::gpu_data::GroupState],
    n_groups: u32,
) -> Result<()> {
    let importance = s.read_importance(rt).await?;
    let g = n_groups as usize;
    for (i, (got, want)) in groups.iter().zip(m.ekva_groups(n_groups, groups)).enumerate() {
        if got.tokens != want.tokens {
            return Err(verify_err(format!(
                "step {step}: list {} expert group {}: {} tokens, the reference {}",
                i / g,
                i % g,
                got.tokens,
                want.tokens
            )));
        }
    }
    let want = m.ekva_split(p, lists, groups, &importance);
    for (li, st) in lists.iter().enumerate() {
        let (got, want) = (&groups[li * g..(li + 1) * g], &want[li * g..(li + 1) * g]);
        if let Some((e, (a, b))) = got.iter().zip(want).enumerate().find(|(_, (a, b))| a.budget.abs_diff(b.budget) > 1) {
            return Err(verify_err(format!("step {step}: list {li} expert group {e}: budget {}, the reference {}", a.budget, b.budget)));
        }
        let tokens: u32 = got.iter().map(|x| x.tokens).sum();
        let sum: u32 = got.iter().map(|x| x.budget).sum();
        if st.budget != crate::gpu_data::KEEP_ALL && tokens > st.budget && sum != st.budget {
            return Err(verify_err(format!("step {step}: list {li}'s expert groups keep {sum} tokens of its budget {}", st.budget)));
        }
    }
    Ok(())
}

/// A CPU pool model holding exactly what `pool` holds on the GPU now: a lockstep that starts
/// from the GPU's state (the model's eviction check, whose K/V come from the model's own
/// forward pass, not from the host).
pub async fn pool_model_of(rt: &Runtime, pool: &KvPool) -> Result<PoolModel> {
    let snap = pool.snapshot(rt).await?;
    let mut m = PoolModel::new(&pool.cfg);
    (m.rings, m.ring_pages, m.page_meta, m.free_stack, m.ctl, m.slot_meta) =
        (snap.rings, snap.ring_pages, snap.page_meta, snap.free_stack, snap.ctl, snap.slot_meta);
    m.kv = pool.read_kv(rt).await?;
    if pool.cfg.codec != crate::config::Codec::None {
        (m.codec_free, m.codec_kv) = (snap.codec_free, pool.read_codec_kv(rt).await?);
        m.codec_basis = pool.read_basis(rt).await?;
    }
    Ok(m)
}

/// The whole GPU pool against the CPU model, part by part: rings, free lists, compressed
/// pages, page tables, page and slot metadata, control words, K/V.
pub async fn compare_pool(rt: &Runtime, pool: &KvPool, model: &PoolModel) -> Result<()> {
    let snap = pool.snapshot(rt).await?;
    let kv = pool.read_kv(rt).await?;
    let codec_kv = pool.read_codec_kv(rt).await?;
    let parts = [
        ("rings", snap.rings == model.rings),
        ("compressed free list", snap.codec_free == model.codec_free),
        ("compressed pages", codec_kv.is_empty() || codec_kv == model.codec_kv),
        ("ring pages", snap.ring_pages == model.ring_pages),
        ("page metadata", snap.page_meta == model.page_meta),
        ("slot metadata", snap.slot_meta == model.slot_meta),
        ("free list", snap.free_stack == model.free_stack),
        ("control words", snap.ctl == model.ctl),
        ("K/V", kv == model.kv),
    ];
    match parts.iter().find(|(_, same)| !same) {
        Some((name, _)) => Err(verify_err(format!("the GPU pool's {name} differ from the CPU reference's"))),
        None => Ok(()),
    }
}

impl Pipeline {
    /// QUEST's part of the lockstep: every page's key bounds exactly (at layer 0, after they are
    /// summarised), every page's upper bound on
    /// q.k within [`crate::reference::quest::QUEST_BOUND_RTOL`] of the f64 reference, and the
    /// selection exactly the reference's given the GPU's keys.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn check_quest(
        &self,
        rt: &Runtime,
        qs: &Quest,
        model: &PoolModel,
        layer: u32,
        q: &[f32],
        sel: &[u32],
        counts: &[u32],
    ) -> Result<()> {
        use crate::reference::quest::{QUEST_BOUND_RTOL, key_bound, page_bounds, select_pages, upper_bound};
        let c = &self.kv.pool.cfg;
        let (d, step) = (c.head_dim as usize, self.step);
        // The bounds are summarised before layer 0's selection: compared there, used everywhere.
        let bounds: Vec<f32> = if layer == 0 { rt.read_all(&qs.bounds).await? } else { Vec::new() };
        let keys: Vec<u32> = rt.read_all(qs.page_keys()).await?;
        let mut refs = vec![None; c.n_pages as usize];
        for (page, r) in refs.iter_mut().enumerate() {
            if model.page_meta[page].owner == u32::MAX {
                continue;
            }
            *r = page_bounds(model, page as u32);
            if let Some(want) = r
                && layer == 0
                && let Some(i) = (0..2 * d).find(|&i| f64::from(bounds[page * 2 * d + i]) != want[i])
            {
                return Err(verify_err(format!(
                    "step {step}: QUEST bound {i} of page {page} is {}, the reference {}",
                    bounds[page * 2 * d + i],
                    want[i]
                )));
            }
        }
        let (group, maxp) = (self.kv.attn.opts.group as usize, c.max_pages_per_seq() as usize);
        for seq in 0..self.kv.attn.opts.n_seqs {
            for head in 0..c.kv_heads {
                let li = model.list_index(layer, seq, head) as usize;
                let list = model.page_list(layer, seq, head);
                let heads: Vec<&[f32]> = (0..group)
                    .map(|g| &q[((seq as usize * self.kv.attn.q_heads() as usize) + head as usize * group + g) * d..][..d])
                    .collect();
                for (j, &page) in list.iter().enumerate() {
                    let Some(b) = &refs[page as usize] else { continue };
                    let (want, got) = (upper_bound(b, &heads), key_bound(keys[li * maxp + j]));
                    let d = (got - want).abs();
                    if d.is_nan() || d > QUEST_BOUND_RTOL * (1.0 + want.abs()) {
                        return Err(verify_err(format!(
                            "step {step}, layer {layer}: QUEST bound of list {li} page {page} is {got}, the reference {want}"
                        )));
                    }
                }
                let want = select_pages(&list, &keys[li * maxp..li * maxp + list.len()], qs.keep_pages as usize);
                if sel[li * maxp..li * maxp + counts[li] as usize] != want[..] {
                    return Err(verify_err(format!(
                        "step {step}, layer {layer}: QUEST selected {:?} of list {li}, the reference {want:?}",
                        &sel[li * maxp..li * maxp + counts[li] as usize]
                    )));
                }
            }
        }
        Ok(())
    }

    /// The recall tier's part of the lockstep: every list's recalled pages those the reference
    /// chooses from its own tier, digests, calibration and page bounds (the best true scores
    /// among the pages the best bound and digest scores nominate; up to near ties the GPU's f32 sums may order
    /// differently: [`check_choice`]), and the true scores the GPU kept for them. Returns each
    /// list's recalled pages (the GPU's choice).
    async fn check_recall(
        &self,
        rt: &Runtime,
        t: &RecallTier,
        model: &PoolModel,
        tier: &TierModel,
        layer: u32,
        q: &[f32],
    ) -> Result<Vec<Vec<u32>>> {
        let c = &self.kv.pool.cfg;
        let (d, group, step) = (c.head_dim as usize, self.kv.attn.opts.group, self.step);
        let scale = f64::from(self.kv.attn.scale());
        let sel = t.read_selection(rt).await?;
        let mut out = vec![Vec::new(); c.n_lists() as usize];
        for seq in 0..self.kv.attn.opts.n_seqs {
            for h in 0..c.kv_heads {
                let li = model.list_index(layer, seq, h);
                let heads: Vec<&[f32]> = (0..group).map(|g| &q[((seq * c.kv_heads + h) * group + g) as usize * d..][..d]).collect();
                let digest = tier.digest_page_scores(c, li, &heads, scale);
                // (Bound scores only where the tier's bounds nominate: `Nomination` reads none else.)
                let bounds = if t.cfg.bound_candidates > 0 { tier.bound_page_scores(c, li, &heads, scale) } else { Vec::new() };
                let exact = tier.page_scores(c, li, &heads, scale);
                let (pages, got_scores) = &sel[li as usize];
                let got: Vec<u32> = pages.iter().copied().filter(|&p| p != u32::MAX).collect();
                let nom = Nomination {
                    digest: &digest,
                    bounds: &bounds,
                    candidates: t.cfg.candidates as usize,
                    bound_candidates: t.cfg.bound_candidates as usize,
                };
                check_choice(&got, got_scores, &nom, &exact, t.cfg.pages as usize)
                    .map_err(|e| verify_err(format!("step {step}, layer {layer}: list {li}: {e}")))?;
                out[li as usize] = got;
            }
        }
        Ok(out)
    }

    /// The CPU lockstep's check of one layer's attention, right after it ran: every output
    /// within its tolerance of the f64 reference over the same pages (QUEST: the GPU's
    /// selection), and the slot metadata equal to the reference's everywhere, with the masses
    /// and accesses this attention recorded (each read's mass within [`MASS_RTOL`] of the
    /// reference's, not of the slot's total). The model
    /// then carries the GPU's masses (rounded as the GPU summed them), so that the utilities
    /// eviction derives from them can be compared exactly ([`check_eviction`]).
    pub(super) async fn check_layer(&mut self, rt: &Runtime, layer: u32, q: &[f32]) -> Result<()> {
        use crate::reference::attend::{ATTENTION_ATOL, ATTENTION_RTOL};
        let Some(model) = &self.model else { return Ok(()) };
        let out = self.kv.attn.read_output(rt).await?;
        let selection = match &self.kv.quest {
            Some(qs) => Some((rt.read_all::<u32>(&qs.sel_list).await?, rt.read_all::<u32>(&qs.sel_counts).await?)),
            None => None,
        };
        let maxp = self.kv.pool.cfg.max_pages_per_seq() as usize;
        let pick = |seq: u32, head: u32| -> Vec<u32> {
            let li = model.list_index(layer, seq, head) as usize;
            selection.as_ref().map_or_else(Vec::new, |(sel, counts)| sel[li * maxp..li * maxp + counts[li] as usize].to_vec())
        };
        let pages: Option<&dyn Fn(u32, u32) -> Vec<u32>> = if selection.is_some() { Some(&pick) } else { None };
        if let (Some(qs), Some((sel, counts))) = (&self.kv.quest, &selection) {
            self.check_quest(rt, qs, model, layer, q, sel, counts).await?;
        }
        let (reference, tol) = match (&self.kv.recall, &model.tier) {
            (Some(t), Some(tier)) => {
                let recalled = self.check_recall(rt, t, model, tier, layer, q).await?;
                let group = self.kv.attn.opts.group;
                let r =
                    attend_with_recall(model, tier, layer, self.kv.attn.opts.n_seqs, q, group, f64::from(self.kv.attn.scale()), &|li| {
                        recalled[li as usize].clone()
                    });
                let tol = r.out.iter().map(|w| ATTENTION_ATOL + ATTENTION_RTOL * w.abs()).collect();
                (r, (tol, None))
            }
            _ => {
                let r = self.kv.attn.cpu_reference(model, layer, q, pages);
                let tol = self.kv.attn.output_tolerance(model, layer, q, pages, &r.out);
                (r, tol)
            }
        };
        let (tol, held) = tol;
        let step = self.step;
        // Where the kernel sums values in f16, each output vector's error norm too: a dropped
        // or doubled token moves every element of its vectors, which the per-element bound
        // lets through where what the f16 sums hold is large.
        if let Some(held) = &held
            && let Some((v, err, bound)) =
                crate::reference::attend::f16_sums_vector_excess(&out, &reference.out, held, self.kv.pool.cfg.head_dim as usize)
        {
            return Err(verify_err(format!(
                "step {step}, layer {layer}: attention output vector {v}'s error norm is {err:.3e}, over its bound {bound:.3e} (f16 sums)"
            )));
        }
        for (i, ((g, w), t)) in out.iter().zip(&reference.out).zip(&tol).enumerate() {
            let err = (f64::from(*g) - w).abs();
            if err.is_nan() || err > *t {
                return Err(verify_err(format!(
                    "step {step}, layer {layer}: attention output {i} is {g}, the f64 reference {w} (tolerance {t:.1e})"
                )));
            }
            self.checked.max_abs_err = self.checked.max_abs_err.max(err);
            self.checked.worst_share = self.checked.worst_share.max(err / t);
        }
        self.checked.attention += 1;
        let gpu: Vec<u32> = rt.read_all(&self.kv.pool.slot_meta).await?;
        let cfg = &self.kv.pool.cfg;
        let (mw, attn_word) = (cfg.meta_words() as usize, meta::attn(cfg.top_k as usize));
        let mut want = model.slot_meta.clone();
        if want.len() != gpu.len() {
            return Err(verify_err(format!("slot metadata of {} words, the reference {}", gpu.len(), want.len())));
        }
        if self.kv.attn.opts.mass {
            for &(seq, head, page, slot, w) in &reference.mass {
                let m = (page * cfg.page_size + slot) as usize * mw;
                let (prev, got) = (f64::from(f32::from_bits(want[m + attn_word])), f64::from(f32::from_bits(gpu[m + attn_word])));
                // This step's increment against the reference's mass of this read: f32 scores,
                // exponentials and one division (3.6e-6 of the increment the most seen on the
                // pipeline tests, 2026-12-08; MASS_RTOL allows 1e-4), then the GPU's f32 sum
                // with what the slot held (half an ulp of the total). The tolerance scales with
                // the increment, not the total: a bias on every read cannot hide in a large
                // total, and what the model carries is at most (1e-4 + 2^-24) of it off.
                let d = (got - (prev + w)).abs();
                if d.is_nan() || d > MASS_ATOL + MASS_RTOL * w + (prev + w).abs() * f64::powi(2.0, -24) {
                    return Err(verify_err(format!(
                        "step {step}, layer {layer}: attention mass of sequence {seq}, head {head}, page {page}, slot {slot} is {got}, the reference {}",
                        prev + w
                    )));
                }
                want[m + attn_word] = gpu[m + attn_word];
                want[m + meta::LAST_ACCESS] = step;
                want[m + meta::ACCESS_COUNT] = want[m + meta::ACCESS_COUNT].wrapping_add(1);
            }
        }
        if let Some(i) = (0..want.len()).find(|&i| want[i] != gpu[i]) {
            return Err(verify_err(format!(
                "step {step}, layer {layer}: slot metadata word {} of slot {} is {:#010x}, the reference {:#010x}",
                i % mw,
                i / mw,
                gpu[i],
                want[i]
            )));
        }
        if let Some(m) = &mut self.model {
            m.slot_meta = gpu;
        }
        Ok(())
    }

    /// Compare the GPU pool with the CPU reference (exactly: rings, page tables, free lists,
    /// page and slot metadata, control words, K/V and compressed pages) and report the
    /// attention checks the lockstep made at every layer of every attended batch and step.
    pub async fn verify(&self, rt: &Runtime) -> Result<Option<VerifyReport>> {
        let Some(model) = &self.model else {
            return Ok(None);
        };
        compare_pool(rt, &self.kv.pool, model).await?;
        if let (Some(t), Some(tier)) = (&self.kv.recall, &model.tier) {
            let (kv, pos) = t.read_tier(rt).await?;
            let counts = t.read_counts(rt).await?;
            if counts != tier.count || pos != tier.pos || kv != tier.kv {
                return Err(verify_err("the GPU's recall tier differs from the CPU reference's".into()));
            }
            let (bits, calib, state) = t.read_digests(rt).await?;
            let want_state: Vec<u32> = tier.digested.iter().flatten().copied().collect();
            let (digests, bounds) = bits.split_at(tier.digest.len().min(bits.len()));
            if digests != tier.digest || state != want_state {
                return Err(verify_err("the GPU's key digests differ from the CPU reference's".into()));
            }
            if t.bounds_at().is_some() && bounds != tier.bounds {
                return Err(verify_err("the GPU's tier page key bounds differ from the CPU reference's".into()));
            }
            if let Some((i, (g, w))) =
                calib.iter().zip(&tier.calib).enumerate().find(|(_, (g, w))| (*g - *w).abs() > 1e-4 * (1.0 + w.abs()))
            {
                return Err(verify_err(format!("the GPU's digest calibration word {i} is {g}, the CPU reference's {w}")));
            }
        }
        let layer = self.kv.pool.cfg.layers - 1;
        let tokens_checked = (0..self.cfg.workload.n_seqs).map(|s| model.tokens(layer, s, 0).len() as u64).sum();
        let c = self.checked;
        Ok(Some(VerifyReport {
            tokens_checked,
            attention_checked: c.attention,
            attention_max_abs_err: c.max_abs_err,
            attention_worst_share: c.worst_share,
        }))
    }
}
