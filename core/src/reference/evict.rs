//! CPU references of the eviction kernels (`shaders/wgsl/evict/*.wgsl`).

use super::append::PoolModel;
use crate::gpu_data::{
    EvictParams, GROUP_MASS_ONE, GroupState, KEEP_ALL, ListState, NO_OWNER, PROTECTED, duo_kinds, meta, orderable, policies,
};

impl PoolModel {
    fn slot_fields(&self, slot: usize) -> (u32, u32, u32, f32) {
        let m = slot * self.cfg.meta_words() as usize;
        let k = self.cfg.top_k as usize;
        (
            self.slot_meta[m + meta::POSITION],
            self.slot_meta[m + meta::LAST_ACCESS],
            self.slot_meta[m + meta::ACCESS_COUNT],
            f32::from_bits(self.slot_meta[m + meta::attn(k)]),
        )
    }

    fn seq_of_owner(&self, owner: u32) -> u32 {
        (owner / (self.cfg.kv_heads * self.cfg.n_shards)) % self.cfg.max_seqs
    }

    /// Utility key of every cached slot (`evict/score.wgsl`); `None` where no token is cached.
    pub fn evict_scores(&self, p: &EvictParams, seq_lens: &[u32]) -> Vec<Option<u32>> {
        let ps = self.cfg.page_size as usize;
        (0..self.page_meta.len() * ps)
            .map(|slot| {
                let pm = self.page_meta[slot / ps];
                if pm.owner == NO_OWNER || (slot % ps) as u32 >= pm.fill {
                    return None;
                }
                let (pos, last, count, mass) = self.slot_fields(slot);
                let len = seq_lens[self.seq_of_owner(pm.owner) as usize];
                let sink = pos < p.sinks;
                let recent = pos + p.window >= len;
                Some(match p.policy {
                    policies::STREAMING | policies::DUO => {
                        if sink {
                            PROTECTED
                        } else {
                            orderable(pos as f32)
                        }
                    }
                    policies::LRU => orderable(last as f32),
                    policies::LRU_PLUS => {
                        let u = p.w_recency * last as f32 / p.step.max(1) as f32 + p.w_freq * (1.0 + count as f32).ln() + p.w_attn * mass;
                        if sink || recent { PROTECTED } else { orderable(u) }
                    }
                    _ => {
                        if sink || recent {
                            PROTECTED
                        } else {
                            orderable(mass)
                        }
                    }
                })
            })
            .collect()
    }

    /// Budgets of every list (`evict/budget.wgsl`), in f64. AdaKV's integer shares may differ
    /// from the GPU's by one token per head where float rounding straddles a boundary.
    pub fn evict_budgets(&self, p: &EvictParams, seq_lens: &[u32], lists: &[ListState], layer_budgets: &[u32]) -> Vec<ListState> {
        let mut out = lists.to_vec();
        let hkv = self.cfg.kv_heads;
        for layer in p.first_layer..self.cfg.layers {
            let base_budget = layer_budgets[layer as usize];
            for seq in 0..self.cfg.max_seqs {
                if base_budget == KEEP_ALL {
                    for h in 0..hkv {
                        out[self.list_index(layer, seq, h) as usize].budget = KEEP_ALL;
                    }
                    continue;
                }
                let len = seq_lens[seq as usize];
                let mut weights = Vec::new();
                for h in 0..hkv {
                    let li = self.list_index(layer, seq, h) as usize;
                    let toks = self.tokens(layer, seq, h);
                    let masses: Vec<(u32, f64)> = toks
                        .iter()
                        .map(|&(pg, s)| {
                            let (pos, _, _, mass) = self.slot_fields((pg * self.cfg.page_size + s) as usize);
                            (pos, f64::from(mass))
                        })
                        .collect();
                    let total: f64 = masses.iter().map(|m| m.1).sum();
                    let edge: f64 = masses.iter().filter(|(pos, _)| *pos < p.sinks || pos + p.window >= len).map(|m| m.1).sum();
                    out[li].mass = total as f32;
                    match p.policy {
                        policies::ADAKV => {
                            let ent: f64 = if total > 0.0 {
                                masses.iter().map(|m| m.1 / total).filter(|q| *q > 0.0).map(|q| -q * q.ln()).sum()
                            } else {
                                0.0
                            };
                            weights.push(ent.exp());
                        }
                        policies::DUO => {
                            if total > 0.0 && edge >= f64::from(p.duo_tau) * total {
                                out[li].kind = duo_kinds::STREAMING;
                                out[li].budget = base_budget;
                            } else {
                                out[li].kind = duo_kinds::RETRIEVAL;
                                out[li].budget = KEEP_ALL;
                            }
                        }
                        _ => out[li].budget = base_budget,
                    }
                }
                if p.policy == policies::ADAKV {
                    let floor_b = (f64::from(p.ada_floor) * f64::from(base_budget)) as u32;
                    let rest = hkv * base_budget - hkv * floor_b;
                    let wsum: f64 = weights.iter().sum();
                    let mut share = Vec::new();
                    let mut frac = Vec::new();
                    for w in &weights {
                        let w = if wsum > 0.0 { w / wsum } else { 1.0 / f64::from(hkv) };
                        let exact = f64::from(rest) * w;
                        share.push(exact.floor() as u32);
                        frac.push(exact - exact.floor());
                    }
                    let given: u32 = share.iter().sum();
                    for _ in 0..rest.saturating_sub(given) {
                        let mut best = 0;
                        for h in 1..hkv as usize {
                            if frac[h] > frac[best] {
                                best = h;
                            }
                        }
                        share[best] += 1;
                        frac[best] = -1.0;
                    }
                    for h in 0..hkv {
                        out[self.list_index(layer, seq, h) as usize].budget = floor_b + share[h as usize];
                    }
                }
            }
        }
        out
    }

    /// Select victims, compact rings and free pages (`evict/select`, `compact`, `move`, `free`)
    /// given every slot's utility key and every list's budget. Only the budget decides here
    /// (no utility threshold: [`PoolModel::evict_thresholded`]). Returns each list's victims,
    /// (page, slot) before compaction.
    pub fn evict(&mut self, keys: &[u32], lists: &mut [ListState]) -> Vec<Vec<(u32, u32)>> {
        self.evict_grouped(keys, lists, None)
    }

    /// The expert group of a cached slot under EKVA (`expert_group` in `common/evict.wgsl`).
    fn expert_group(&self, slot: usize, n_groups: u32) -> u32 {
        self.slot_meta[slot * self.cfg.meta_words() as usize + meta::EXPERTS].min(n_groups - 1)
    }

    /// EKVA `experts` pass (`evict/ekva.wgsl`): every (list, group)'s tokens and mass share
    /// (in f64 then rounded, so within a unit or so of the GPU's f32 shares); budgets and
    /// evictions are copied from `prev`.
    pub fn ekva_groups(&self, n_groups: u32, prev: &[GroupState]) -> Vec<GroupState> {
        let ps = self.cfg.page_size;
        let g = n_groups as usize;
        let mut out = prev.to_vec();
        for layer in 0..self.cfg.layers {
            for seq in 0..self.cfg.max_seqs {
                for h in 0..self.cfg.kv_heads {
                    let li = self.list_index(layer, seq, h) as usize;
                    let toks = self.tokens(layer, seq, h);
                    let slots: Vec<usize> = toks.iter().map(|&(pg, s)| (pg * ps + s) as usize).collect();
                    let total: f64 = slots.iter().map(|&sl| f64::from(self.slot_fields(sl).3)).sum();
                    for e in 0..g {
                        out[li * g + e].tokens = 0;
                        out[li * g + e].mass = 0;
                    }
                    for &sl in &slots {
                        let e = self.expert_group(sl, n_groups) as usize;
                        out[li * g + e].tokens += 1;
                        if total > 0.0 {
                            let share = (f64::from(self.slot_fields(sl).3) / total) as f32;
                            out[li * g + e].mass += (share * GROUP_MASS_ONE).round_ties_even() as u32;
                        }
                    }
                }
            }
        }
        out
    }

    /// EKVA `update_importance` pass: the next importance of every (layer, expert) from the
    /// groups' mass shares (each list holding mass counts once), the router's moving-average
    /// loads (per (layer, expert)) and the previous importance, in the GPU's f32 order (the
    /// layer's total by the same 256-wide tree).
    pub fn ekva_importance(&self, p: &EvictParams, groups: &[GroupState], loads: &[f32], prev: &[f32]) -> Vec<f32> {
        let g = p.n_groups as usize;
        let per_layer = (self.cfg.max_seqs * self.cfg.kv_heads) as usize;
        let mut out = prev.to_vec();
        for layer in 0..self.cfg.layers as usize {
            let mut mass = [0f32; 256];
            for (e, m) in mass.iter_mut().enumerate().take(g) {
                for i in 0..per_layer {
                    *m += groups[(layer * per_layer + i) * g + e].mass as f32 / GROUP_MASS_ONE;
                }
            }
            let mut red = mass;
            let mut off = 128;
            while off > 0 {
                for t in 0..off {
                    red[t] += red[t + off];
                }
                off /= 2;
            }
            let total = red[0];
            for e in 0..g {
                let share = if total > 0.0 { mass[e] / total } else { 0.0 };
                let x = p.ekva_alpha * loads[layer * g + e] + (1.0 - p.ekva_alpha) * share;
                let i = layer * g + e;
                out[i] = p.ekva_decay * prev[i] + (1.0 - p.ekva_decay) * x;
            }
        }
        out
    }

    /// EKVA `split` pass: every group's budget from its list's budget, its tokens and the
    /// importance (floor, then water filling by importance, largest remainder), in the GPU's
    /// f32 order. Division rounding may move a token between groups on some devices.
    pub fn ekva_split(&self, p: &EvictParams, lists: &[ListState], groups: &[GroupState], importance: &[f32]) -> Vec<GroupState> {
        let g = p.n_groups as usize;
        let per_layer = (self.cfg.max_seqs * self.cfg.kv_heads) as usize;
        let mut out = groups.to_vec();
        for (li, st) in lists.iter().enumerate() {
            let layer = li / per_layer;
            let gs = &mut out[li * g..(li + 1) * g];
            let imp = &importance[layer * g..(layer + 1) * g];
            let b = st.budget;
            let n: u32 = gs.iter().map(|x| x.tokens).sum();
            if b == KEEP_ALL || n <= b {
                for x in gs.iter_mut() {
                    x.budget = if b == KEEP_ALL { KEEP_ALL } else { x.tokens };
                }
                continue;
            }
            let active = gs.iter().filter(|x| x.tokens > 0).count() as u32;
            let f = (p.ekva_floor * b as f32) as u32 / active.max(1);
            let mut left = b;
            for x in gs.iter_mut() {
                x.budget = x.tokens.min(f);
                left -= x.budget;
            }
            let mut frac = vec![0f32; g];
            let mut pass = 0;
            while pass <= g && left > 0 {
                pass += 1;
                let open: Vec<usize> = (0..g).filter(|&e| gs[e].budget < gs[e].tokens).collect();
                if open.is_empty() {
                    break;
                }
                let mut w_sum = 0f32;
                for &e in &open {
                    w_sum += imp[e].max(0.0);
                }
                let mut filled = false;
                for e in 0..g {
                    frac[e] = if gs[e].budget < gs[e].tokens {
                        let w = if w_sum > 0.0 { imp[e].max(0.0) / w_sum } else { 1.0 / open.len() as f32 };
                        let exact = left as f32 * w;
                        if exact >= (gs[e].tokens - gs[e].budget) as f32 {
                            filled = true;
                            -2.0
                        } else {
                            exact
                        }
                    } else {
                        -1.0
                    };
                }
                if filled {
                    for e in 0..g {
                        if frac[e] == -2.0 {
                            left -= gs[e].tokens - gs[e].budget;
                            gs[e].budget = gs[e].tokens;
                        }
                    }
                    continue;
                }
                let mut given = 0;
                for e in 0..g {
                    if frac[e] >= 0.0 {
                        let s = (frac[e].floor() as u32).min(left - given);
                        gs[e].budget += s;
                        given += s;
                        frac[e] -= frac[e].floor();
                    }
                }
                left -= given;
                while left > 0 {
                    let mut best = None;
                    for e in 0..g {
                        if frac[e] >= 0.0 && gs[e].budget < gs[e].tokens && best.is_none_or(|b: usize| frac[e] > frac[b]) {
                            best = Some(e);
                        }
                    }
                    let Some(b) = best else { break };
                    gs[b].budget += 1;
                    frac[b] = -1.0;
                    left -= 1;
                }
            }
        }
        out
    }

    /// [`PoolModel::evict`], and under EKVA (`groups`: every (list, group)'s budget, `n_groups`
    /// per list) each expert group evicts down to its own budget; the groups' `evicted` are set.
    pub fn evict_grouped(
        &mut self,
        keys: &[u32],
        lists: &mut [ListState],
        groups: Option<(&mut [GroupState], u32)>,
    ) -> Vec<Vec<(u32, u32)>> {
        self.evict_with(keys, lists, groups, None)
    }

    /// [`PoolModel::evict`] with `p`'s utility threshold (fixed, or each list's adaptive `tau`)
    /// as `evict/select` applies it: a mass-based policy also evicts every unprotected token
    /// whose mass x tokens < tau x the list's mass, the list's mass summed in the kernel's order
    /// (`select_wg` invocations, each over every `select_wg`-th slot of the list, then a tree);
    /// the adaptive `tau` then moves by `tau_step` x (hit rate - target), within [0, 1].
    pub fn evict_thresholded(&mut self, keys: &[u32], lists: &mut [ListState], p: &EvictParams, select_wg: u32) -> Vec<Vec<(u32, u32)>> {
        self.evict_with(keys, lists, None, Some((p, select_wg)))
    }

    fn evict_with(
        &mut self,
        keys: &[u32],
        lists: &mut [ListState],
        mut groups: Option<(&mut [GroupState], u32)>,
        threshold: Option<(&EvictParams, u32)>,
    ) -> Vec<Vec<(u32, u32)>> {
        let cfg = self.cfg.clone();
        let ps = cfg.page_size;
        let mut victim = vec![false; keys.len()];
        let mut all = Vec::new();
        for layer in 0..cfg.layers {
            for seq in 0..cfg.max_seqs {
                for h in 0..cfg.kv_heads {
                    let li = self.list_index(layer, seq, h) as usize;
                    // List order index j = page index in the list x P + slot.
                    let mut items: Vec<(u32, u32, u32, u32)> = Vec::new();
                    for (pi, page) in self.page_list(layer, seq, h).into_iter().enumerate() {
                        for s in 0..self.page_meta[page as usize].fill {
                            items.push((keys[(page * ps + s) as usize], pi as u32 * ps + s, page, s));
                        }
                    }
                    let n = items.len() as u32;
                    // The threshold's mean mass, summed as the kernel sums it (items are in list
                    // order here).
                    let tau = threshold.map_or(0.0, |(p, _)| if p.adaptive != 0 { lists[li].tau } else { p.threshold });
                    let mass_based =
                        threshold.is_some_and(|(p, _)| matches!(p.policy, policies::H2O | policies::ADAKV | policies::LRU_PLUS));
                    let limit = match threshold {
                        Some((_, wg)) if mass_based && tau > 0.0 && n > 0 => {
                            let mut lane = vec![0f32; wg as usize];
                            for it in &items {
                                lane[(it.1 % wg) as usize] += self.slot_fields((it.2 * ps + it.3) as usize).3;
                            }
                            let mut off = wg as usize / 2;
                            while off > 0 {
                                for t in 0..off {
                                    lane[t] += lane[t + off];
                                }
                                off /= 2;
                            }
                            Some(tau * lane[0])
                        }
                        _ => None,
                    };
                    items.sort_by_key(|i| (i.0, i.1));
                    let chosen: Vec<(u32, u32)> = match groups.as_mut() {
                        None => {
                            let prot = items.iter().filter(|i| i.0 == PROTECTED).count() as u32;
                            let budget = lists[li].budget;
                            let mut want = if budget != KEEP_ALL && n > budget { n - budget } else { 0 };
                            if let Some(limit) = limit {
                                let below = items
                                    .iter()
                                    .filter(|i| i.0 != PROTECTED && self.slot_fields((i.2 * ps + i.3) as usize).3 * (n as f32) < limit)
                                    .count() as u32;
                                want = want.max(below);
                            }
                            let want = want.min(n - prot);
                            items[..want as usize].iter().map(|i| (i.2, i.3)).collect()
                        }
                        Some((gs, ng)) => {
                            let ng = *ng;
                            let mut chosen = Vec::new();
                            for e in 0..ng {
                                let mine: Vec<&(u32, u32, u32, u32)> =
                                    items.iter().filter(|i| self.expert_group((i.2 * ps + i.3) as usize, ng) == e).collect();
                                let gst = &mut gs[li * ng as usize + e as usize];
                                let tokens = mine.len() as u32;
                                let prot = mine.iter().filter(|i| i.0 == PROTECTED).count() as u32;
                                let want =
                                    if gst.budget != KEEP_ALL && tokens > gst.budget { tokens - gst.budget } else { 0 }.min(tokens - prot);
                                gst.evicted = want;
                                chosen.extend(mine[..want as usize].iter().map(|i| (i.2, i.3)));
                            }
                            // Protected tokens held a group above its share: the list still
                            // keeps its budget, the rest the lowest keys not yet chosen (not
                            // counted in any group's `evicted`).
                            let budget = lists[li].budget;
                            let kept = n - chosen.len() as u32;
                            if budget != KEEP_ALL && kept > budget {
                                let prot = items.iter().filter(|i| i.0 == PROTECTED).count() as u32;
                                let rest = (kept - budget).min(kept - prot);
                                let taken: std::collections::HashSet<(u32, u32)> = chosen.iter().copied().collect();
                                let more: Vec<(u32, u32)> =
                                    items.iter().map(|i| (i.2, i.3)).filter(|x| !taken.contains(x)).take(rest as usize).collect();
                                chosen.extend(more);
                            }
                            chosen
                        }
                    };
                    let want = chosen.len() as u32;
                    let mut mass_total = 0f64;
                    let mut mass_evicted = 0f64;
                    for it in &items {
                        let m = f64::from(self.slot_fields((it.2 * ps + it.3) as usize).3);
                        mass_total += m;
                    }
                    for &(pg, s) in &chosen {
                        victim[(pg * ps + s) as usize] = true;
                        mass_evicted += f64::from(self.slot_fields((pg * ps + s) as usize).3);
                    }
                    let st = &mut lists[li];
                    st.tokens = n;
                    st.evicted = want;
                    st.evicted_total += want;
                    st.mass = mass_total as f32;
                    st.hit_rate = if mass_total > 0.0 { (1.0 - mass_evicted / mass_total) as f32 } else { 1.0 };
                    if let Some((p, _)) = threshold
                        && p.adaptive != 0
                    {
                        st.tau = (st.tau + p.tau_step * (st.hit_rate - p.hit_target)).clamp(0.0, 1.0);
                    }
                    all.push(chosen);
                }
            }
        }
        // Compressed pages compaction touches are decoded into raw pages first.
        self.thaw(&mut victim);
        // Every victim goes to the recall tier before compaction moves the survivors.
        if let Some(mut tier) = self.tier.take() {
            tier.capture(self, &victim);
            self.tier = Some(tier);
        }
        // Compaction per ring, then free in key order.
        let r = cfg.ring_capacity;
        let vw = cfg.vec_words() as usize;
        let pw = cfg.page_words() as usize;
        let mw = cfg.meta_words() as usize;
        let mut freed_all = Vec::new();
        for key in 0..cfg.n_keys() as usize {
            let ring = self.rings[key];
            if ring.count == 0 {
                continue;
            }
            let n = (ring.count - 1) * ps + ring.fill;
            let slot_at = |i: u32| -> usize {
                let page = self.ring_pages[key * r as usize + ((ring.head + i / ps) % r) as usize];
                (page * ps + i % ps) as usize
            };
            let v = (0..n).filter(|i| victim[slot_at(*i)]).count() as u32;
            if v == 0 {
                continue;
            }
            let keep = n - v;
            let holes: Vec<usize> = (0..keep).map(slot_at).filter(|s| victim[*s]).collect();
            let movers: Vec<usize> = (keep..n).map(slot_at).filter(|s| !victim[*s]).collect();
            for (&dst, &src) in holes.iter().zip(&movers) {
                let (sp, ss) = (src / ps as usize, src % ps as usize);
                let (dp, ds) = (dst / ps as usize, dst % ps as usize);
                for kv in 0..2 {
                    let s0 = sp * pw + kv * ps as usize * vw + ss * vw;
                    let d0 = dp * pw + kv * ps as usize * vw + ds * vw;
                    let tmp = self.kv[s0..s0 + vw].to_vec();
                    self.kv[d0..d0 + vw].copy_from_slice(&tmp);
                }
                let tmp = self.slot_meta[src * mw..(src + 1) * mw].to_vec();
                self.slot_meta[dst * mw..(dst + 1) * mw].copy_from_slice(&tmp);
            }
            let kept_pages = keep.div_ceil(ps);
            for k in 0..ring.count {
                let page = self.ring_pages[key * r as usize + ((ring.head + k) % r) as usize];
                if k < kept_pages {
                    self.page_meta[page as usize].fill = if k + 1 == kept_pages { keep - (kept_pages - 1) * ps } else { ps };
                } else {
                    freed_all.push(page);
                }
            }
            let ring = &mut self.rings[key];
            ring.count = kept_pages;
            ring.fill = if kept_pages > 0 { keep - (kept_pages - 1) * ps } else { ps };
        }
        for page in &freed_all {
            self.free_stack[self.ctl.free_top as usize] = *page;
            self.ctl.free_top += 1;
            self.page_meta[*page as usize] = crate::gpu_data::PageMeta { owner: NO_OWNER, fill: 0 };
        }
        self.ctl.pages_evicted += freed_all.len() as u32;
        all
    }
}
