//! CPU references of the eviction kernels (`shaders/wgsl/evict/*.wgsl`).

use super::pool::PoolModel;
use crate::gpu_data::{EvictParams, KEEP_ALL, ListState, NO_OWNER, PROTECTED, duo_kinds, meta, orderable, policies};

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
    /// (no utility threshold). Returns each list's victims, (page, slot) before compaction.
    pub fn evict(&mut self, keys: &[u32], lists: &mut [ListState]) -> Vec<Vec<(u32, u32)>> {
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
                    let prot = items.iter().filter(|i| i.0 == PROTECTED).count() as u32;
                    let budget = lists[li].budget;
                    let want = if budget != KEEP_ALL && n > budget { n - budget } else { 0 }.min(n - prot);
                    items.sort_by_key(|i| (i.0, i.1));
                    let chosen: Vec<(u32, u32)> = items[..want as usize].iter().map(|i| (i.2, i.3)).collect();
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
                    all.push(chosen);
                }
            }
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
