//! CPU reference of the paged, sharded pool: the same state as the GPU buffers and the same
//! placement rules as `append/append_*.wgsl`, `append/release.wgsl` and `append/gather_pages.wgsl`.

use crate::append::format::NewToken;
use crate::config::PoolConfig;
use crate::error::{Error, Result};
use crate::gpu_data::{NO_OWNER, PageMeta, PoolCtl, RingState, TokenPlan, meta, plan_flags, pool_errors};

/// The whole pool state, on the CPU.
#[derive(Clone, Debug)]
pub struct PoolModel {
    /// The pool's configuration.
    pub cfg: PoolConfig,
    /// One ring per shard key (layer, sequence, KV head, shard), as [`crate::KvPool::rings`].
    pub rings: Vec<RingState>,
    /// `ring_capacity` page ids per shard key, circular from each ring's head.
    pub ring_pages: Vec<u32>,
    /// Per page id (raw, then compressed): owning shard key or `NO_OWNER`, and valid slots.
    pub page_meta: Vec<PageMeta>,
    /// Free raw page ids; the first `ctl.free_top` are free, popped from the top.
    pub free_stack: Vec<u32>,
    /// Free-stack tops, error flags and counters, as the GPU's [`PoolCtl`].
    pub ctl: PoolCtl,
    /// `meta_words` u32 per slot.
    pub slot_meta: Vec<u32>,
    /// `page_words` u32 per page, pages in global order.
    pub kv: Vec<u32>,
    /// Compressed pages (ids from `n_pages` on), `codec.page_words` u32 each.
    pub codec_kv: Vec<u32>,
    /// Free stack of compressed page ids.
    pub codec_free: Vec<u32>,
    /// The low-rank codecs' basis as the GPU fitted it (`KvPool::read_basis`); empty until then.
    pub codec_basis: Vec<f32>,
    /// Compressed pages thawed under eviction (see [`PoolModel::thaw`]).
    pub thaw: crate::compress::ThawCounts,
    /// The recall tier every eviction's victims go to, when the pool has one.
    pub tier: Option<super::tier::TierModel>,
}

impl PoolModel {
    /// The state of a freshly built pool of `cfg`: every page free, every ring empty.
    pub fn new(cfg: &PoolConfig) -> Self {
        let n = cfg.n_pages as usize;
        let ids = cfg.n_ids() as usize;
        let codec_pages = (cfg.n_ids() - cfg.n_pages) as usize;
        PoolModel {
            cfg: cfg.clone(),
            rings: vec![RingState { head: 0, count: 0, fill: cfg.page_size, _pad: 0 }; cfg.n_keys() as usize],
            ring_pages: vec![NO_OWNER; (cfg.n_keys() * cfg.ring_capacity) as usize],
            page_meta: vec![PageMeta { owner: NO_OWNER, fill: 0 }; ids],
            // Popping yields pages 0, 1, 2, ...
            free_stack: (0..cfg.n_pages).rev().collect(),
            ctl: PoolCtl { free_top: cfg.n_pages, codec_free_top: codec_pages as u32, ..Default::default() },
            slot_meta: vec![0; ids * cfg.page_size as usize * cfg.meta_words() as usize],
            kv: vec![0; n * cfg.page_words() as usize],
            codec_kv: vec![0; codec_pages * cfg.codec_page_bytes() as usize / 4],
            codec_free: (cfg.n_pages..cfg.n_ids()).rev().collect(),
            codec_basis: Vec::new(),
            thaw: Default::default(),
            tier: None,
        }
    }

    /// Ring key of (layer, seq, KV head, shard).
    pub fn shard_key(&self, layer: u32, seq: u32, head: u32, shard: u32) -> u32 {
        self.list_index(layer, seq, head) * self.cfg.n_shards + shard
    }

    /// Page-list index of (layer, seq, KV head).
    pub fn list_index(&self, layer: u32, seq: u32, head: u32) -> u32 {
        (layer * self.cfg.max_seqs + seq) * self.cfg.kv_heads + head
    }

    /// (layer, seq, shard) of a token, numbered (layer * max_seqs + seq) * n_shards + shard.
    fn token_key(&self, t: &NewToken) -> Option<u32> {
        if t.layer >= self.cfg.layers || t.seq >= self.cfg.max_seqs {
            return None;
        }
        let e = t.experts.first().copied().unwrap_or(0);
        let shard = self.cfg.shard_map.shard_from_token_expert(self.cfg.n_shards, t.position, e);
        Some((t.layer * self.cfg.max_seqs + t.seq) * self.cfg.n_shards + shard)
    }

    /// Placement of a batch (pass 1): one plan per (token, KV head), token-major. Mirrors
    /// `append/plan.wgsl`.
    pub fn plan(&self, tokens: &[NewToken]) -> Vec<TokenPlan> {
        let keys: Vec<Option<u32>> = tokens.iter().map(|t| self.token_key(t)).collect();
        let (p, r, hkv, ns) = (self.cfg.page_size, self.cfg.ring_capacity, self.cfg.kv_heads, self.cfg.n_shards);
        let mut out = Vec::with_capacity(tokens.len() * hkv as usize);
        for (i, tk) in keys.iter().enumerate() {
            let Some(tk) = *tk else {
                for _ in 0..hkv {
                    out.push(TokenPlan { key: u32::MAX, flags: plan_flags::INVALID, page: NO_OWNER, ..Default::default() });
                }
                continue;
            };
            let rank = keys[..i].iter().filter(|k| **k == Some(tk)).count() as u32;
            let total = keys.iter().filter(|k| **k == Some(tk)).count() as u32;
            let (ls, shard) = (tk / ns, tk % ns);
            for h in 0..hkv {
                let key = (ls * hkv + h) * ns + shard;
                let ring = self.rings[key as usize];
                let u = ring.fill + rank;
                let mut plan = TokenPlan { key, rank, u, page: NO_OWNER, ..Default::default() };
                let mut flags = 0;
                if u < p {
                    plan.ring_index = (ring.head + ring.count + r - 1) % r;
                    plan.slot = u;
                } else {
                    let q = (u - p) / p;
                    plan.slot = (u - p) % p;
                    plan.ring_index = (ring.head + ring.count + q) % r;
                    if plan.slot == 0 {
                        flags |= plan_flags::OPENS;
                        flags |= if ring.count + q < r { plan_flags::NEEDS_FREE } else { plan_flags::RECYCLES };
                    }
                }
                if rank + 1 == total {
                    flags |= plan_flags::LAST_IN_KEY;
                }
                if rank + 1 == total || plan.slot + 1 == p {
                    flags |= plan_flags::LAST_IN_PAGE;
                }
                plan.flags = flags;
                out.push(plan);
            }
        }
        out
    }

    /// Append a batch: `kv` holds, per token, K then V for every KV head, as storage words
    /// (`2 * kv_heads * vec_words` per token). Mirrors the append passes. On refusal (bad token
    /// or exhausted pool) nothing changes but the error flags, as on the GPU.
    pub fn append(&mut self, tokens: &[NewToken], kv: &[u32], step: u32) -> Result<Vec<TokenPlan>> {
        let cfg = self.cfg.clone();
        let tw = (2 * cfg.kv_heads * cfg.vec_words()) as usize;
        if kv.len() != tokens.len() * tw {
            return Err(Error::Input(format!("K/V data holds {} words, {} tokens need {}", kv.len(), tokens.len(), tokens.len() * tw)));
        }
        let mut plan = self.plan(tokens);
        if plan.iter().any(|p| p.flags & plan_flags::INVALID != 0) {
            self.ctl.error_flags |= pool_errors::BAD_TOKEN;
            self.ctl.abort = 1;
            return Ok(plan);
        }
        let wanted = plan.iter().filter(|p| p.flags & plan_flags::NEEDS_FREE != 0).count() as u32;
        if wanted > self.ctl.free_top {
            self.ctl.error_flags |= pool_errors::POOL_EXHAUSTED;
            self.ctl.abort = 1;
            return Ok(plan);
        }
        // A full ring would recycle its oldest page; a compressed one (an id past the raw
        // pages) cannot take raw tokens.
        let recycles_compressed = |p: &crate::gpu_data::TokenPlan| {
            p.flags & plan_flags::RECYCLES != 0 && self.ring_pages[(p.key * cfg.ring_capacity + p.ring_index) as usize] >= cfg.n_pages
        };
        if plan.iter().any(recycles_compressed) {
            self.ctl.error_flags |= pool_errors::RING_FULL;
            self.ctl.abort = 1;
            return Ok(plan);
        }
        self.ctl.abort = 0;

        // Pass 2: pages and rings, items in batch order.
        let (p, r) = (cfg.page_size, cfg.ring_capacity);
        let mut taken = 0u32;
        for pl in &plan {
            let entry = (pl.key * r + pl.ring_index) as usize;
            if pl.flags & plan_flags::NEEDS_FREE != 0 {
                let page = self.free_stack[(self.ctl.free_top - 1 - taken) as usize];
                taken += 1;
                self.ring_pages[entry] = page;
                self.page_meta[page as usize] = PageMeta { owner: pl.key, fill: 0 };
            } else if pl.flags & plan_flags::RECYCLES != 0 {
                let page = self.ring_pages[entry];
                self.page_meta[page as usize].fill = 0;
                self.ctl.ring_overflows += 1;
            }
            if pl.flags & plan_flags::LAST_IN_KEY != 0 {
                let ring = &mut self.rings[pl.key as usize];
                if pl.u < p {
                    ring.fill = pl.u + 1;
                } else {
                    let new_pages = (pl.u - p) / p + 1;
                    let grown = ring.count + new_pages;
                    if grown > r {
                        ring.head = (ring.head + grown - r) % r;
                        ring.count = r;
                    } else {
                        ring.count = grown;
                    }
                    ring.fill = (pl.u - p) % p + 1;
                }
            }
        }
        self.ctl.free_top -= taken;
        self.ctl.tokens_appended += tokens.len() as u32;

        // Pass 3: data and metadata, per (token, head).
        let vw = cfg.vec_words() as usize;
        let hkv = cfg.kv_heads as usize;
        let pw = cfg.page_words() as usize;
        let block = p as usize * vw;
        let mw = cfg.meta_words() as usize;
        let k = cfg.top_k as usize;
        for (i, tok) in tokens.iter().enumerate() {
            let mut rec = Vec::with_capacity(3 + 2 * k);
            tok.encode_into(k, &mut rec);
            for h in 0..hkv {
                let pl = &mut plan[i * hkv + h];
                let page = self.ring_pages[(pl.key * r + pl.ring_index) as usize];
                pl.page = page;
                for kvi in 0..2 {
                    let src = i * tw + (kvi * hkv + h) * vw;
                    let dst = page as usize * pw + kvi * block + pl.slot as usize * vw;
                    self.kv[dst..dst + vw].copy_from_slice(&kv[src..src + vw]);
                }
                let m = (page as usize * p as usize + pl.slot as usize) * mw;
                self.slot_meta[m + meta::POSITION] = tok.position;
                self.slot_meta[m + meta::LAST_ACCESS] = step;
                self.slot_meta[m + meta::ACCESS_COUNT] = 0;
                self.slot_meta[m + meta::EXPERTS..m + meta::EXPERTS + 2 * k].copy_from_slice(&rec[3..]);
                self.slot_meta[m + meta::attn(k)] = 0f32.to_bits();
                if pl.flags & plan_flags::LAST_IN_PAGE != 0 {
                    self.page_meta[page as usize].fill = pl.slot + 1;
                }
            }
        }
        Ok(plan)
    }

    /// Release the `counts[key]` oldest pages of each ring (at most what it holds): raw pages to
    /// the raw free stack, compressed ones to theirs. Mirrors `append/release.wgsl`.
    pub fn release(&mut self, counts: &[u32]) {
        let r = self.cfg.ring_capacity;
        let (mut top, mut codec_top) = (self.ctl.free_top, self.ctl.codec_free_top);
        let mut released = 0;
        for (key, &want) in counts.iter().enumerate().take(self.rings.len()) {
            let ring = &mut self.rings[key];
            let n = want.min(ring.count);
            for k in 0..n {
                let page = self.ring_pages[key * r as usize + ((ring.head + k) % r) as usize];
                if page >= self.cfg.n_pages {
                    self.codec_free[codec_top as usize] = page;
                    codec_top += 1;
                } else {
                    self.free_stack[top as usize] = page;
                    top += 1;
                }
                self.page_meta[page as usize] = PageMeta { owner: NO_OWNER, fill: 0 };
            }
            released += n;
            if n > 0 {
                ring.head = (ring.head + n) % r;
                ring.count -= n;
                if ring.count == 0 {
                    ring.fill = self.cfg.page_size;
                }
            }
        }
        (self.ctl.free_top, self.ctl.codec_free_top) = (top, codec_top);
        self.ctl.pages_released += released;
    }

    /// Page list of one (layer, sequence, KV head): shards in order, each ring oldest first.
    pub fn page_list(&self, layer: u32, seq: u32, head: u32) -> Vec<u32> {
        let r = self.cfg.ring_capacity;
        let mut out = Vec::new();
        for s in 0..self.cfg.n_shards {
            let key = self.shard_key(layer, seq, head, s);
            let ring = self.rings[key as usize];
            for k in 0..ring.count {
                out.push(self.ring_pages[(key * r + (ring.head + k) % r) as usize]);
            }
        }
        out
    }

    /// Pages in use (allocated to some ring).
    pub fn pages_in_use(&self) -> u32 {
        self.cfg.n_pages - self.ctl.free_top
    }

    /// Tokens cached for one (layer, sequence, KV head), in page-list order: (page, slot).
    pub fn tokens(&self, layer: u32, seq: u32, head: u32) -> Vec<(u32, u32)> {
        self.page_list(layer, seq, head)
            .into_iter()
            .flat_map(|page| (0..self.page_meta[page as usize].fill).map(move |s| (page, s)))
            .collect()
    }
}

pub use super::words::decode_words;
