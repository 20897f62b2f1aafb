//! The pool's structural invariants, checked on a snapshot read back from the GPU (the churn
//! test after every operation, `expertkv soak` every few hundred steps): every page, raw or
//! compressed, is on its free stack or in exactly one ring; free plus used is the whole pool;
//! no cached token is duplicated and each was appended; the slots in use equal the pages'
//! fills; a ring keeps its append order until an eviction compacts it.

use std::collections::HashSet;

use super::PoolSnapshot;
use crate::config::PoolConfig;
use crate::gpu_data::{NO_OWNER, meta};

/// A cached token's identity: (layer, sequence, KV head, position).
pub type TokenId = (u32, u32, u32, u32);

impl PoolSnapshot {
    /// Check the invariants; `appended(id)` says whether a token was appended (and not released
    /// since), `compacted` holds the rings an eviction moved slots in since they were last empty
    /// (their order is not checked). Returns the tokens cached, or what broke.
    pub fn check_invariants(
        &self,
        cfg: &PoolConfig,
        appended: &dyn Fn(TokenId) -> bool,
        compacted: &HashSet<usize>,
    ) -> Result<usize, String> {
        let (n_raw, n_ids) = (cfg.n_pages as usize, cfg.n_ids() as usize);
        let free_top = self.ctl.free_top as usize;
        let codec_top = self.ctl.codec_free_top as usize;
        if free_top > n_raw || codec_top > n_ids - n_raw {
            return Err(format!("free tops {free_top} (raw, of {n_raw}) and {codec_top} (compressed, of {})", n_ids - n_raw));
        }
        // Where each page is: a free stack or one ring.
        let mut seen = vec![false; n_ids];
        let free = self.free_stack[..free_top].iter().map(|&p| (p, 0..n_raw));
        let codec_free = self.codec_free[..codec_top].iter().map(|&p| (p, n_raw..n_ids));
        for (p, range) in free.chain(codec_free) {
            if !range.contains(&(p as usize)) {
                return Err(format!("a free stack holds page {p}, outside {range:?}"));
            }
            if std::mem::replace(&mut seen[p as usize], true) {
                return Err(format!("page {p} is on a free stack twice"));
            }
            if self.page_meta[p as usize].owner != NO_OWNER {
                return Err(format!("free page {p} has an owner"));
            }
        }
        let cap = cfg.ring_capacity as usize;
        let mut live = HashSet::new();
        let (mut slots_in_use, mut used) = (0usize, 0usize);
        for (key, ring) in self.rings.iter().enumerate() {
            if ring.count as usize > cap {
                return Err(format!("ring {key} holds {} pages, capacity {cap}", ring.count));
            }
            let list = key as u32 / cfg.n_shards;
            let (head, seq, layer) = (list % cfg.kv_heads, (list / cfg.kv_heads) % cfg.max_seqs, list / (cfg.kv_heads * cfg.max_seqs));
            let mut last_position = None;
            for i in 0..ring.count as usize {
                let p = self.ring_pages[key * cap + (ring.head as usize + i) % cap];
                if p as usize >= n_ids {
                    return Err(format!("ring {key} holds page {p}"));
                }
                if std::mem::replace(&mut seen[p as usize], true) {
                    return Err(format!("page {p} is in two places (ring {key})"));
                }
                used += 1;
                let pm = self.page_meta[p as usize];
                if pm.owner != key as u32 || pm.fill > cfg.page_size {
                    return Err(format!("page {p} of ring {key} names owner {} and fill {} of {}", pm.owner, pm.fill, cfg.page_size));
                }
                slots_in_use += pm.fill as usize;
                for s in 0..pm.fill {
                    let m = ((p * cfg.page_size + s) * cfg.meta_words()) as usize;
                    let position = self.slot_meta[m + meta::POSITION];
                    let id = (layer, seq, head, position);
                    if !appended(id) {
                        return Err(format!("page {p} slot {s} holds {id:?}, never appended"));
                    }
                    if !live.insert(id) {
                        return Err(format!("{id:?} is cached twice"));
                    }
                    if let Some(prev) = last_position.filter(|_| !compacted.contains(&key))
                        && position <= prev
                    {
                        return Err(format!("ring {key} holds position {position} after {prev}"));
                    }
                    last_position = Some(position);
                }
            }
        }
        if free_top + codec_top + used != n_ids || !seen.iter().all(|&s| s) {
            return Err(format!("{free_top} + {codec_top} free and {used} in rings are not the {n_ids} pages, or a page is nowhere"));
        }
        if live.len() != slots_in_use {
            return Err(format!("{} cached tokens against {slots_in_use} slots the pages' fills count", live.len()));
        }
        Ok(live.len())
    }
}
