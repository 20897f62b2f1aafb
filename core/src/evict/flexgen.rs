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
//!
//! Below the host tier a [`SpillTier`] (a remote page store: `expertkv-store`'s Redis tier) may
//! take the K/V words of the host pages past a limit, the least attended first; their metadata
//! and key bounds stay on the host, so QUEST still scores them, and a selected page comes back
//! from the store before it goes to the GPU. A store that fails is switched off and reported;
//! a page it cannot return is counted lost (its tokens leave the context, as an eviction would).

use std::collections::HashMap;

use crate::append::{KvPool, PoolSnapshot, RingTables};
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
    /// The page's id in the spill tier while its K/V words are there (`data` is then empty).
    pub spilled: Option<u64>,
}

/// A tier below host memory that keeps pages' K/V words by id (a remote page store). Errors
/// are the store's words; the host tier then stops spilling and reports them.
pub trait SpillTier: Send {
    /// Where the tier is (for messages).
    fn name(&self) -> String;
    /// Keep each (id, K/V words).
    fn put_many(&mut self, pages: &[(u64, &[u32])]) -> std::result::Result<(), String>;
    /// The K/V words kept under `id`, removed from the tier; `None` if the tier lost them.
    fn take(&mut self, id: u64) -> std::result::Result<Option<Vec<u32>>, String>;
    /// Forget `ids` (their sequence ended), as far as the tier still answers.
    fn discard(&mut self, ids: &[u64]);
}

/// The spill tier and the host tier's limit above it.
struct Spill {
    tier: Box<dyn SpillTier>,
    host_limit_pages: u32,
    next_id: u64,
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
    /// Host pages whose K/V words are in the spill tier now.
    pub spilled_pages: u64,
    /// Pages sent to the spill tier so far.
    pub pages_to_spill: u64,
    /// Pages brought back from the spill tier so far.
    pub pages_from_spill: u64,
    /// Pages the spill tier could not return (their tokens left the context).
    pub lost_pages: u64,
    /// Why the spill tier was switched off, if it was.
    pub spill_failed: Option<String>,
    /// Seconds spent in fetches and offloads (the decisions, the pages' readbacks, the writes
    /// staged), the reads of their queries, bounds and tables aside.
    pub host_s: f64,
    /// Of those, seconds waiting for the pages' readbacks.
    pub page_read_s: f64,
}

/// A host page brought back to the GPU by [`FlexGen::fetch`], in place of the weakest resident
/// page of its list, which went to host memory.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct PageFetch {
    /// The list (layer, sequence, KV head) both pages belong to.
    pub list: u32,
    /// The GPU page: the weak page's before the swap, the fetched page's after.
    pub gpu_page: u32,
    /// The fetched page's bound on q.k for the layer's queries (max over the list's query heads).
    pub bound: f64,
    /// The bound of the resident page it replaced (always below `bound`).
    pub evicted_bound: f64,
    /// K/V bytes copied to the GPU (one page).
    pub bytes: u64,
}

/// FlexGen placement over one pool: the pages held in host memory, per page list, and the tier's
/// statistics.
pub struct FlexGen {
    /// GPU pages kept per list besides the newest page of each ring.
    pub budget_pages: u32,
    host: HashMap<u32, Vec<HostPage>>,
    /// Host-tier size and traffic.
    pub stats: TierStats,
    /// The pages [`FlexGen::fetch`] brought back since [`FlexGen::begin_step`], in order.
    pub last_fetches: Vec<PageFetch>,
    spill: Option<Spill>,
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
        Ok(FlexGen {
            budget_pages: budget.div_ceil(pool.cfg.page_size),
            host: HashMap::new(),
            stats: TierStats::default(),
            last_fetches: Vec::new(),
            spill: None,
        })
    }

    /// Start a step: forget the last step's fetches ([`FlexGen::last_fetches`]).
    pub fn begin_step(&mut self) {
        self.last_fetches.clear();
    }

    /// Keep at most `host_limit_pages` pages' K/V words in host memory; the rest go to `tier`,
    /// the least attended first (after every offload and fetch). Refused while pages are in
    /// another spill tier.
    pub fn set_spill(&mut self, tier: Box<dyn SpillTier>, host_limit_pages: u32) -> Result<()> {
        if self.host.values().flatten().any(|p| p.spilled.is_some()) {
            return Err(Error::Input("FlexGen: pages are in a spill tier already; release them first".into()));
        }
        self.spill = Some(Spill { tier, host_limit_pages, next_id: 0 });
        Ok(())
    }

    /// Forget every page in the spill tier (the run is over): their keys are removed from it.
    pub fn release_spilled(&mut self) {
        let ids: Vec<u64> = self.host.values().flatten().filter_map(|p| p.spilled).collect();
        if let (Some(sp), false) = (&mut self.spill, ids.is_empty()) {
            sp.tier.discard(&ids);
        }
        for pages in self.host.values_mut() {
            pages.retain(|p| p.spilled.is_none());
        }
    }

    /// The spill tier's name, while one is on.
    pub fn spill_name(&self) -> Option<String> {
        self.spill.as_ref().map(|s| s.tier.name())
    }

    /// Send the least attended host pages past the limit to the spill tier.
    fn spill_past_limit(&mut self, c: &crate::config::PoolConfig) {
        let Some(sp) = &mut self.spill else { return };
        let resident: Vec<(f64, u32, usize)> = {
            let mw = c.meta_words() as usize;
            let mut v: Vec<(f64, u32, usize)> = self
                .host
                .iter()
                .flat_map(|(&li, pages)| pages.iter().enumerate().filter(|(_, p)| p.spilled.is_none()).map(move |(i, p)| (li, i, p)))
                .map(|(li, i, p)| {
                    let mass: f64 =
                        (0..p.fill as usize).map(|s| f64::from(f32::from_bits(p.meta[s * mw + meta::attn(c.top_k as usize)]))).sum();
                    (mass, li, i)
                })
                .collect();
            // Least attended first; ties by list, then place in it.
            v.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
            v
        };
        let over = resident.len().saturating_sub(sp.host_limit_pages as usize);
        if over == 0 {
            return;
        }
        let chosen = &resident[..over];
        let ids: Vec<u64> = (0..over as u64).map(|k| sp.next_id + k).collect();
        let pages: Vec<(u64, &[u32])> = chosen.iter().zip(&ids).map(|(&(_, li, i), &id)| (id, self.host[&li][i].data.as_slice())).collect();
        match sp.tier.put_many(&pages) {
            Ok(()) => {
                sp.next_id += over as u64;
                for (&(_, li, i), &id) in chosen.iter().zip(&ids) {
                    if let Some(p) = self.host.get_mut(&li).and_then(|v| v.get_mut(i)) {
                        p.spilled = Some(id);
                        p.data = Vec::new();
                    }
                }
                self.stats.pages_to_spill += over as u64;
            }
            Err(e) => {
                // The pages stay in host memory; the tier is not asked again.
                self.stats.spill_failed = Some(format!("{}: {e}", sp.tier.name()));
                self.spill = None;
            }
        }
    }

    fn tables(s: PoolSnapshot) -> Tables {
        Tables {
            rings: s.rings,
            ring_pages: s.ring_pages,
            page_meta: s.page_meta,
            free_stack: s.free_stack,
            ctl: s.ctl,
            slot_meta: s.slot_meta,
        }
    }

    /// Write back the tables a move changes: the rings and page owners, and with `free` the
    /// free stack and its top (an offload frees pages; a fetch's swap keeps the count). The
    /// slots' metadata is written page by page where it changes.
    fn write_tables(rt: &Runtime, pool: &KvPool, t: &Tables, free: bool) {
        rt.queue.write_buffer(&pool.rings, 0, bytemuck::cast_slice(&t.rings));
        rt.queue.write_buffer(&pool.ring_pages, 0, bytemuck::cast_slice(&t.ring_pages));
        rt.queue.write_buffer(&pool.page_meta, 0, bytemuck::cast_slice(&t.page_meta));
        if free {
            rt.queue.write_buffer(&pool.free_stack, 0, bytemuck::cast_slice(&t.free_stack));
            rt.queue.write_buffer(&pool.ctl, 0, bytemuck::bytes_of(&t.ctl));
        }
    }

    /// Where a page's slot metadata is: (buffer, first word, words).
    fn meta_range(pool: &KvPool, page: u32) -> (&wgpu::Buffer, u64, u64) {
        let words = u64::from(pool.cfg.page_size * pool.cfg.meta_words());
        (&pool.slot_meta, u64::from(page) * words, words)
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

    /// Where a page's K/V words are: (buffer, first word, words).
    fn page_range(pool: &KvPool, page: u32) -> (&wgpu::Buffer, u64, u64) {
        let ppb = pool.geo.pages_per_buffer;
        let pw = u64::from(pool.cfg.page_words());
        (&pool.kv_buffers[(page / ppb) as usize], u64::from(page % ppb) * pw, pw)
    }

    fn write_page(rt: &Runtime, pool: &KvPool, page: u32, data: &[u32]) {
        let (buffer, first, _) = Self::page_range(pool, page);
        rt.queue.write_buffer(buffer, first * 4, bytemuck::cast_slice(data));
    }

    /// Move the coldest pages past the budget of every list to the host (after attention, so
    /// this step's attention mass counts). `bounds` are the QUEST page bounds (`[page][min|max]`).
    pub async fn offload(&mut self, rt: &Runtime, pool: &KvPool, bounds: &[f32]) -> Result<()> {
        let snapshot = pool.snapshot(rt).await?;
        self.offload_with(rt, pool, bounds, snapshot).await
    }

    /// [`FlexGen::offload`] with the pool's tables already read ([`KvPool::snapshot`], after
    /// the step's attention and nothing since), as a caller reading them with the bounds does.
    pub async fn offload_with(&mut self, rt: &Runtime, pool: &KvPool, bounds: &[f32], snapshot: PoolSnapshot) -> Result<()> {
        let t0 = std::time::Instant::now();
        let c = pool.cfg.clone();
        let (r, ns, d) = (c.ring_capacity as usize, c.n_shards as usize, c.head_dim as usize);
        let mut t = Self::tables(snapshot);
        let mut changed = false;
        let mut outgoing: Vec<(u32, u32, HostPage)> = Vec::new();
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
                let fill = t.page_meta[page as usize].fill;
                let mw = c.meta_words() as usize;
                let m0 = (page * c.page_size) as usize * mw;
                let meta_words = t.slot_meta[m0..m0 + c.page_size as usize * mw].to_vec();
                let lo = bounds[page as usize * 2 * d..page as usize * 2 * d + d].to_vec();
                let hi = bounds[page as usize * 2 * d + d..page as usize * 2 * d + 2 * d].to_vec();
                self.stats.bytes_to_host += c.page_bytes();
                self.stats.offloaded_pages += 1;
                // Its words are read with every other page's once the lists are done.
                outgoing.push((
                    li as u32,
                    page,
                    HostPage { key: key as u32, fill, data: Vec::new(), meta: meta_words, lo, hi, spilled: None },
                ));
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
        // One readback for every page that leaves, in the order they left.
        let ranges: Vec<_> = outgoing.iter().map(|(_, page, _)| Self::page_range(pool, *page)).collect();
        let t1 = std::time::Instant::now();
        let words = rt.read_many::<u32>(&ranges).await?;
        self.stats.page_read_s += t1.elapsed().as_secs_f64();
        for ((li, _, mut page), data) in outgoing.into_iter().zip(words) {
            page.data = data;
            self.host.entry(li).or_default().push(page);
        }
        if changed {
            Self::write_tables(rt, pool, &t, true);
        }
        self.spill_past_limit(&c);
        self.update_host_stats(&c);
        self.stats.host_s += t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// Before attention: bring back host pages whose bound on q.k (max over the list's query
    /// heads) beats the weakest resident page's, swapping that one out. `queries` are the
    /// layer's `[seq][q_head][d]`; `bounds` the QUEST bounds of resident pages.
    pub async fn fetch(&mut self, rt: &Runtime, pool: &KvPool, layer: u32, queries: &[f32], group: u32, bounds: &[f32]) -> Result<()> {
        // Nothing of the layer in host memory: nothing to read.
        if !self.has_host_pages(&pool.cfg, layer) {
            return Ok(());
        }
        let words = rt.read_many::<u32>(&pool.ring_tables_ranges()).await?;
        self.fetch_with(rt, pool, layer, (queries, group), bounds, pool.ring_tables_from(words)).await
    }

    /// Whether any list of layer `layer` has pages in host memory (a fetch has nothing to bring
    /// back otherwise).
    pub fn has_host_pages(&self, c: &crate::config::PoolConfig, layer: u32) -> bool {
        let lists = layer * c.max_seqs * c.kv_heads..(layer + 1) * c.max_seqs * c.kv_heads;
        self.host.iter().any(|(li, pages)| lists.contains(li) && !pages.is_empty())
    }

    /// [`FlexGen::fetch`] with the pool's ring tables already read
    /// ([`KvPool::ring_tables_ranges`], after the layer's append and nothing since), as a
    /// caller reading them with the queries and bounds does. `queries` are the layer's queries
    /// and the query heads per KV head.
    pub async fn fetch_with(
        &mut self,
        rt: &Runtime,
        pool: &KvPool,
        layer: u32,
        (queries, group): (&[f32], u32),
        bounds: &[f32],
        rings: RingTables,
    ) -> Result<()> {
        let t0 = std::time::Instant::now();
        let c = pool.cfg.clone();
        let (r, ns, d) = (c.ring_capacity as usize, c.n_shards as usize, c.head_dim as usize);
        let hq = (c.kv_heads * group) as usize;
        // A fetch's swap moves pages between rings only: the free stack and the slots' metadata
        // (read and written page by page) are not in its tables.
        let RingTables { rings, ring_pages, page_meta } = rings;
        let mut t = Tables { rings, ring_pages, page_meta, free_stack: Vec::new(), ctl: PoolCtl::default(), slot_meta: Vec::new() };
        // A GPU page a fetch filled this call holds the fetched page's bounds, not the ones
        // `bounds` was read with.
        let mut swapped: HashMap<u32, (Vec<f32>, Vec<f32>)> = HashMap::new();
        // The pages swapped out (list, GPU page, the host page but its words) and the fetched
        // pages' words with their GPU page.
        let mut outgoing: Vec<(u32, u32, HostPage)> = Vec::new();
        let mut incoming_words: Vec<(u32, Vec<u32>, Vec<u32>)> = Vec::new();
        fn page_bounds<'a>(swapped: &'a HashMap<u32, (Vec<f32>, Vec<f32>)>, bounds: &'a [f32], d: usize, p: u32) -> (&'a [f32], &'a [f32]) {
            match swapped.get(&p) {
                Some((lo, hi)) => (lo, hi),
                None => {
                    let pi = p as usize;
                    (&bounds[pi * 2 * d..pi * 2 * d + d], &bounds[pi * 2 * d + d..pi * 2 * d + 2 * d])
                }
            }
        }
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
                let tables = &mut t;
                // Best host page against the weakest resident non-tail page, until none beats it.
                while let Some((hi_i, best_ub)) =
                    host.iter().enumerate().map(|(i, p)| (i, ub(&p.lo, &p.hi))).max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)))
                {
                    let mut weakest: Option<(f64, u32, usize)> = None;
                    for s in 0..ns {
                        let key = li * ns + s;
                        let order = Self::ring_order(tables, key, r);
                        for p in order.iter().take(order.len().saturating_sub(1)) {
                            let (lo, hi) = page_bounds(&swapped, bounds, d, *p);
                            let u = ub(lo, hi);
                            if weakest.is_none_or(|w| u < w.0) {
                                weakest = Some((u, *p, key));
                            }
                        }
                    }
                    let Some((weak_ub, weak_page, weak_key)) = weakest else { break };
                    // Only a strictly better bound swaps (a NaN bound, from NaN queries or keys,
                    // never does: a page filled by this call must not be swapped out again).
                    if best_ub.partial_cmp(&weak_ub) != Some(std::cmp::Ordering::Greater) {
                        break;
                    }
                    // The fetched page joins its own ring: refused before anything moves if that
                    // ring is full (the weak page leaving it makes room when it is the same).
                    let into = host[hi_i].key as usize;
                    if into != weak_key && tables.rings[into].count as usize >= r {
                        return Err(Error::Input(format!("FlexGen: ring {into} is full; cannot fetch a page back")));
                    }
                    // Swap: the weak page goes to the host, the selected page takes its GPU page.
                    let mut incoming = host.swap_remove(hi_i);
                    if let Some(id) = incoming.spilled {
                        // Back from the spill tier first; a page it lost leaves the context.
                        let back = match &mut self.spill {
                            Some(sp) => sp.tier.take(id).map_err(|e| format!("{}: {e}", sp.tier.name())),
                            None => Err("the spill tier was switched off".to_string()),
                        };
                        match back {
                            Ok(Some(data)) if data.len() == c.page_words() as usize => {
                                incoming.data = data;
                                incoming.spilled = None;
                                self.stats.pages_from_spill += 1;
                            }
                            other => {
                                if let Err(e) = other {
                                    self.stats.spill_failed.get_or_insert(e);
                                    self.spill = None;
                                }
                                self.stats.lost_pages += 1;
                                continue;
                            }
                        }
                    }
                    let wp = weak_page as usize;
                    let (out_lo, out_hi) = page_bounds(&swapped, bounds, d, weak_page);
                    let (out_lo, out_hi) = (out_lo.to_vec(), out_hi.to_vec());
                    swapped.insert(weak_page, (incoming.lo.clone(), incoming.hi.clone()));
                    // Its words are read after the decisions, with every other page's. It joins
                    // the host pages then: its bound is below every resident page's, so it would
                    // not be fetched back in this call anyway.
                    outgoing.push((
                        li as u32,
                        weak_page,
                        HostPage {
                            key: weak_key as u32,
                            fill: tables.page_meta[wp].fill,
                            data: Vec::new(),
                            meta: Vec::new(),
                            lo: out_lo,
                            hi: out_hi,
                            spilled: None,
                        },
                    ));
                    // Out of the weak page's ring; the fetched page enters its own ring as the
                    // oldest page (the newest stays the one being filled).
                    let order: Vec<u32> = Self::ring_order(tables, weak_key, r).into_iter().filter(|p| *p != weak_page).collect();
                    let tail_fill = tables.rings[weak_key].fill;
                    Self::set_ring(tables, weak_key, r, &order, tail_fill, c.page_size);
                    let key = incoming.key as usize;
                    let ring = &mut tables.rings[key];
                    ring.head = (ring.head + r as u32 - 1) % r as u32;
                    ring.count += 1;
                    if ring.count == 1 {
                        ring.fill = incoming.fill;
                    }
                    tables.ring_pages[key * r + ring.head as usize] = weak_page;
                    tables.page_meta[wp] = PageMeta { owner: incoming.key, fill: incoming.fill };
                    incoming_words.push((weak_page, incoming.data, incoming.meta));
                    self.last_fetches.push(PageFetch {
                        list: li as u32,
                        gpu_page: weak_page,
                        bound: best_ub,
                        evicted_bound: weak_ub,
                        bytes: c.page_bytes(),
                    });
                    self.stats.fetched_pages += 1;
                    self.stats.offloaded_pages += 1;
                    self.stats.bytes_to_gpu += c.page_bytes();
                    self.stats.bytes_to_host += c.page_bytes();
                }
            }
        }
        // One readback for every page swapped out, its words and its slots' metadata (before
        // any fetched page is written over it), then the fetched pages' words and metadata.
        let ranges: Vec<_> =
            outgoing.iter().flat_map(|(_, page, _)| [Self::page_range(pool, *page), Self::meta_range(pool, *page)]).collect();
        let t1 = std::time::Instant::now();
        let mut words = rt.read_many::<u32>(&ranges).await?.into_iter();
        self.stats.page_read_s += t1.elapsed().as_secs_f64();
        for (li, _, mut page) in outgoing {
            page.data = words.next().unwrap_or_default();
            page.meta = words.next().unwrap_or_default();
            self.host.entry(li).or_default().push(page);
        }
        for (page, data, meta_words) in &incoming_words {
            Self::write_page(rt, pool, *page, data);
            let (buf, first, _) = Self::meta_range(pool, *page);
            rt.queue.write_buffer(buf, first * 4, bytemuck::cast_slice(meta_words));
        }
        if !incoming_words.is_empty() {
            Self::write_tables(rt, pool, &t, false);
        }
        self.spill_past_limit(&c);
        self.update_host_stats(&c);
        self.stats.host_s += t0.elapsed().as_secs_f64();
        Ok(())
    }

    fn update_host_stats(&mut self, c: &crate::config::PoolConfig) {
        let spilled: u64 = self.host.values().flatten().filter(|p| p.spilled.is_some()).count() as u64;
        let pages: u64 = self.host.values().map(|v| v.len() as u64).sum::<u64>() - spilled;
        self.stats.host_pages = pages;
        self.stats.host_bytes = pages * c.page_bytes();
        self.stats.spilled_pages = spilled;
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
        let of_seq = |li: u32| (li / c.kv_heads) % c.max_seqs == seq;
        let ids: Vec<u64> = self.host.iter().filter(|(li, _)| of_seq(**li)).flat_map(|(_, v)| v.iter().filter_map(|p| p.spilled)).collect();
        if let (Some(sp), false) = (&mut self.spill, ids.is_empty()) {
            sp.tier.discard(&ids);
        }
        self.host.retain(|&li, _| !of_seq(li));
        self.update_host_stats(c);
    }
}
