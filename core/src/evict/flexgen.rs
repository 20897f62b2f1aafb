//! FlexGen-style placement: a GPU tier holding at most `budget` tokens' worth of pages per
//! (layer, sequence, KV head) list, and a host tier for the rest. Pages move at page
//! granularity. After each step's attention, the coldest pages (least attention mass,
//! accumulated) beyond the budget move to host memory and their GPU pages return to the free
//! stack; before attention, a host page whose QUEST bound on q.k beats the weakest resident
//! page's is "selected" and fetched back in its place. The newest page of every shard ring
//! (the one being filled) always stays on the GPU. Attention reads only GPU pages.
//!
//! Unlike the other schedulers this one is host-driven by design (a host tier needs the host):
//! the moves are decided on the CPU from small reads of the pool's tables and copied with
//! queue writes and buffer reads. Bytes moved each way are counted.

use std::collections::HashMap;

use crate::append::KvPool;
use crate::error::{Error, Result};
use crate::gpu_data::{NO_OWNER, PageMeta, PoolCtl, RingState, meta};
use crate::runtime::Runtime;

/// A page kept in host memory.
#[derive(Clone, Debug)]
pub struct HostPage {
    /// Ring it belongs to (layer, sequence, KV head, shard).
    pub key: u32,
    /// Slots of the page that hold tokens.
    pub fill: u32,
    /// K/V words of the page.
    pub data: Vec<u32>,
    /// Slot metadata words of the page.
    pub meta: Vec<u32>,
    /// Key bounds per dimension (QUEST summary), to score it against queries while away.
    pub lo: Vec<f32>,
    /// Per dimension, the largest key value over the page's slots (`lo` holds the smallest).
    pub hi: Vec<f32>,
}

/// The host tier's size now and its traffic so far.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct TierStats {
    /// Pages in host memory now.
    pub host_pages: u64,
    /// K/V bytes of those pages (one raw page's bytes each; metadata and bounds not counted).
    pub host_bytes: u64,
    /// Pages moved from the GPU to the host so far (a fetch's swap counts one).
    pub offloaded_pages: u64,
    /// Pages moved back from the host to the GPU so far.
    pub fetched_pages: u64,
    /// K/V bytes copied to the host so far.
    pub bytes_to_host: u64,
    /// K/V bytes copied back to the GPU so far.
    pub bytes_to_gpu: u64,
}

/// FlexGen placement over one pool: the pages held in host memory, per page list, and the tier's
/// statistics.
pub struct FlexGen {
    /// GPU pages kept per list besides the newest page of each ring.
    pub budget_pages: u32,
    host: HashMap<u32, Vec<HostPage>>,
    /// Host-tier size and traffic.
    pub stats: TierStats,
}

struct Tables {
    rings: Vec<RingState>,
    ring_pages: Vec<u32>,
    page_meta: Vec<PageMeta>,
    free_stack: Vec<u32>,
    ctl: PoolCtl,
    slot_meta: Vec<u32>,
}

impl FlexGen {
    /// A host tier that keeps `budget` tokens per list on the GPU (rounded up to whole pages, at
    /// least one page) besides each ring's newest page; nothing is offloaded yet.
    pub fn new(pool: &KvPool, budget: u32) -> Result<FlexGen> {
        if budget < pool.cfg.page_size {
            return Err(Error::config(
                "budget",
                budget,
                format!("FlexGen needs at least one page ({} tokens) on the GPU", pool.cfg.page_size),
            ));
        }
        Ok(FlexGen { budget_pages: budget.div_ceil(pool.cfg.page_size), host: HashMap::new(), stats: TierStats::default() })
    }

    async fn tables(rt: &Runtime, pool: &KvPool) -> Result<Tables> {
        let s = pool.snapshot(rt).await?;
        Ok(Tables {
            rings: s.rings,
            ring_pages: s.ring_pages,
            page_meta: s.page_meta,
            free_stack: s.free_stack,
            ctl: s.ctl,
            slot_meta: s.slot_meta,
        })
    }

    fn write_tables(rt: &Runtime, pool: &KvPool, t: &Tables) {
        rt.queue.write_buffer(&pool.rings, 0, bytemuck::cast_slice(&t.rings));
        rt.queue.write_buffer(&pool.ring_pages, 0, bytemuck::cast_slice(&t.ring_pages));
        rt.queue.write_buffer(&pool.page_meta, 0, bytemuck::cast_slice(&t.page_meta));
        rt.queue.write_buffer(&pool.free_stack, 0, bytemuck::cast_slice(&t.free_stack));
        rt.queue.write_buffer(&pool.ctl, 0, bytemuck::bytes_of(&t.ctl));
        rt.queue.write_buffer(&pool.slot_meta, 0, bytemuck::cast_slice(&t.slot_meta));
    }

    /// Ring order of one ring's pages, oldest first.
    fn ring_order(t: &Tables, key: usize, r: usize) -> Vec<u32> {
        let ring = t.rings[key];
        (0..ring.count).map(|k| t.ring_pages[key * r + ((ring.head + k) as usize % r)]).collect()
    }

    fn set_ring(t: &mut Tables, key: usize, r: usize, pages: &[u32], tail_fill: u32, page_size: u32) {
        let ring = &mut t.rings[key];
        ring.count = pages.len() as u32;
        if pages.is_empty() {
            ring.fill = page_size;
        } else {
            ring.fill = tail_fill;
        }
        for (k, p) in pages.iter().enumerate() {
            t.ring_pages[key * r + ((ring.head as usize + k) % r)] = *p;
        }
    }

    fn page_mass(t: &Tables, pool: &KvPool, page: u32) -> f64 {
        let c = &pool.cfg;
        let mw = c.meta_words() as usize;
        let fill = t.page_meta[page as usize].fill;
        (0..fill)
            .map(|s| f64::from(f32::from_bits(t.slot_meta[(page * c.page_size + s) as usize * mw + meta::attn(c.top_k as usize)])))
            .sum()
    }

    async fn read_page(rt: &Runtime, pool: &KvPool, page: u32) -> Result<Vec<u32>> {
        let ppb = pool.geo.pages_per_buffer;
        let b = (page / ppb) as usize;
        let pw = u64::from(pool.cfg.page_words());
        rt.read(&pool.kv_buffers[b], u64::from(page % ppb) * pw, pw).await
    }

    fn write_page(rt: &Runtime, pool: &KvPool, page: u32, data: &[u32]) {
        let ppb = pool.geo.pages_per_buffer;
        let b = (page / ppb) as usize;
        rt.queue.write_buffer(
            &pool.kv_buffers[b],
            u64::from(page % ppb) * u64::from(pool.cfg.page_words()) * 4,
            bytemuck::cast_slice(data),
        );
    }

    /// Move the coldest pages past the budget of every list to the host (after attention, so
    /// this step's attention mass counts). `bounds` are the QUEST page bounds (`[page][min|max]`).
    pub async fn offload(&mut self, rt: &Runtime, pool: &KvPool, bounds: &[f32]) -> Result<()> {
        let c = pool.cfg.clone();
        let (r, ns, d) = (c.ring_capacity as usize, c.n_shards as usize, c.head_dim as usize);
        let mut t = Self::tables(rt, pool).await?;
        let mut changed = false;
        for li in 0..c.n_lists() as usize {
            // Candidates: every ring's pages but its newest.
            let mut cand: Vec<(f64, u32, usize)> = Vec::new();
            let mut resident = 0u32;
            for s in 0..ns {
                let key = li * ns + s;
                let order = Self::ring_order(&t, key, r);
                resident += order.len() as u32;
                for p in order.iter().take(order.len().saturating_sub(1)) {
                    cand.push((Self::page_mass(&t, pool, *p), *p, key));
                }
            }
            // The budget's pages, besides the ring tails (which always stay).
            let tails = resident - cand.len() as u32;
            let keep = self.budget_pages + tails;
            if resident <= keep {
                continue;
            }
            // Coldest first; ties to the lower page id.
            cand.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            for &(_, page, key) in cand.iter().take((resident - keep) as usize) {
                let data = Self::read_page(rt, pool, page).await?;
                let fill = t.page_meta[page as usize].fill;
                let mw = c.meta_words() as usize;
                let m0 = (page * c.page_size) as usize * mw;
                let meta_words = t.slot_meta[m0..m0 + c.page_size as usize * mw].to_vec();
                let lo = bounds[page as usize * 2 * d..page as usize * 2 * d + d].to_vec();
                let hi = bounds[page as usize * 2 * d + d..page as usize * 2 * d + 2 * d].to_vec();
                self.stats.bytes_to_host += c.page_bytes();
                self.stats.offloaded_pages += 1;
                self.host.entry(li as u32).or_default().push(HostPage { key: key as u32, fill, data, meta: meta_words, lo, hi });
                // Out of its ring (order kept), back on the free stack.
                let order: Vec<u32> = Self::ring_order(&t, key, r).into_iter().filter(|p| *p != page).collect();
                let tail_fill = t.rings[key].fill;
                Self::set_ring(&mut t, key, r, &order, tail_fill, c.page_size);
                t.free_stack[t.ctl.free_top as usize] = page;
                t.ctl.free_top += 1;
                t.page_meta[page as usize] = PageMeta { owner: NO_OWNER, fill: 0 };
                changed = true;
            }
        }
        if changed {
            Self::write_tables(rt, pool, &t);
        }
        self.update_host_stats(&c);
        Ok(())
    }

    /// Before attention: bring back host pages whose bound on q.k (max over the list's query
    /// heads) beats the weakest resident page's, swapping that one out. `queries` are the
    /// layer's `[seq][q_head][d]`; `bounds` the QUEST bounds of resident pages.
    pub async fn fetch(&mut self, rt: &Runtime, pool: &KvPool, layer: u32, queries: &[f32], group: u32, bounds: &[f32]) -> Result<()> {
        let c = pool.cfg.clone();
        let (r, ns, d) = (c.ring_capacity as usize, c.n_shards as usize, c.head_dim as usize);
        let hq = (c.kv_heads * group) as usize;
        let mut t: Option<Tables> = None;
        for seq in 0..c.max_seqs {
            for h in 0..c.kv_heads {
                let li = ((layer * c.max_seqs + seq) * c.kv_heads + h) as usize;
                let Some(host) = self.host.get_mut(&(li as u32)) else { continue };
                if host.is_empty() {
                    continue;
                }
                let ub = |lo: &[f32], hi: &[f32]| -> f64 {
                    (0..group as usize)
                        .map(|g| {
                            let q0 = (seq as usize * hq + h as usize * group as usize + g) * d;
                            (0..d).map(|i| f64::from((queries[q0 + i] * lo[i]).max(queries[q0 + i] * hi[i]))).sum::<f64>()
                        })
                        .fold(f64::NEG_INFINITY, f64::max)
                };
                let tables = match &mut t {
                    Some(x) => x,
                    None => t.insert(Self::tables(rt, pool).await?),
                };
                // Best host page against the weakest resident non-tail page, until none beats it.
                while let Some((hi_i, best_ub)) =
                    host.iter().enumerate().map(|(i, p)| (i, ub(&p.lo, &p.hi))).max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)))
                {
                    let mut weakest: Option<(f64, u32, usize)> = None;
                    for s in 0..ns {
                        let key = li * ns + s;
                        let order = Self::ring_order(tables, key, r);
                        for p in order.iter().take(order.len().saturating_sub(1)) {
                            let pi = *p as usize;
                            let u = ub(&bounds[pi * 2 * d..pi * 2 * d + d], &bounds[pi * 2 * d + d..pi * 2 * d + 2 * d]);
                            if weakest.is_none_or(|w| u < w.0) {
                                weakest = Some((u, *p, key));
                            }
                        }
                    }
                    let Some((weak_ub, weak_page, weak_key)) = weakest else { break };
                    if best_ub <= weak_ub {
                        break;
                    }
                    // Swap: the weak page goes to the host, the selected page takes its GPU page.
                    let incoming = host.swap_remove(hi_i);
                    let out_data = Self::read_page(rt, pool, weak_page).await?;
                    let mw = c.meta_words() as usize;
                    let m0 = (weak_page * c.page_size) as usize * mw;
                    let out_meta = tables.slot_meta[m0..m0 + c.page_size as usize * mw].to_vec();
                    let wp = weak_page as usize;
                    host.push(HostPage {
                        key: weak_key as u32,
                        fill: tables.page_meta[wp].fill,
                        data: out_data,
                        meta: out_meta,
                        lo: bounds[wp * 2 * d..wp * 2 * d + d].to_vec(),
                        hi: bounds[wp * 2 * d + d..wp * 2 * d + 2 * d].to_vec(),
                    });
                    // Out of the weak page's ring; the fetched page enters its own ring as the
                    // oldest page (the newest stays the one being filled).
                    let order: Vec<u32> = Self::ring_order(tables, weak_key, r).into_iter().filter(|p| *p != weak_page).collect();
                    let tail_fill = tables.rings[weak_key].fill;
                    Self::set_ring(tables, weak_key, r, &order, tail_fill, c.page_size);
                    let key = incoming.key as usize;
                    let ring = &mut tables.rings[key];
                    if ring.count as usize >= r {
                        return Err(Error::Input(format!("FlexGen: ring {key} is full; cannot fetch a page back")));
                    }
                    ring.head = (ring.head + r as u32 - 1) % r as u32;
                    ring.count += 1;
                    if ring.count == 1 {
                        ring.fill = incoming.fill;
                    }
                    tables.ring_pages[key * r + ring.head as usize] = weak_page;
                    tables.page_meta[wp] = PageMeta { owner: incoming.key, fill: incoming.fill };
                    tables.slot_meta[m0..m0 + c.page_size as usize * mw].copy_from_slice(&incoming.meta);
                    Self::write_page(rt, pool, weak_page, &incoming.data);
                    self.stats.fetched_pages += 1;
                    self.stats.offloaded_pages += 1;
                    self.stats.bytes_to_gpu += c.page_bytes();
                    self.stats.bytes_to_host += c.page_bytes();
                }
            }
        }
        if let Some(t) = &t {
            Self::write_tables(rt, pool, t);
        }
        self.update_host_stats(&c);
        Ok(())
    }

    fn update_host_stats(&mut self, c: &crate::config::PoolConfig) {
        let pages: u64 = self.host.values().map(|v| v.len() as u64).sum();
        self.stats.host_pages = pages;
        self.stats.host_bytes = pages * c.page_bytes();
    }

    /// Tokens held in host memory per list.
    pub fn host_tokens(&self, list: u32) -> u32 {
        self.host.get(&list).map_or(0, |v| v.iter().map(|p| p.fill).sum())
    }

    /// Every token held in host memory as (layer, sequence, KV head, position).
    pub fn host_token_ids(&self, c: &crate::config::PoolConfig) -> Vec<(u32, u32, u32, u32)> {
        let mw = c.meta_words() as usize;
        let mut out = Vec::new();
        for (&li, pages) in &self.host {
            let (layer, seq, head) = (li / (c.max_seqs * c.kv_heads), (li / c.kv_heads) % c.max_seqs, li % c.kv_heads);
            for p in pages {
                out.extend((0..p.fill as usize).map(|s| (layer, seq, head, p.meta[s * mw + meta::POSITION])));
            }
        }
        out
    }

    /// Drop a finished sequence's host pages (call with [`KvPool::release_sequence`], which
    /// frees its GPU pages).
    pub fn release_sequence(&mut self, c: &crate::config::PoolConfig, seq: u32) {
        self.host.retain(|&li, _| (li / c.kv_heads) % c.max_seqs != seq);
        self.update_host_stats(c);
    }
}
