//! What a step reports: per-stage GPU times, the step's counters, and the per-layer records a
//! trace keeps.

use serde::{Deserialize, Serialize};

use super::Pipeline;
use crate::error::Result;
use crate::runtime::Runtime;

/// GPU time of each stage of one step (milliseconds).
#[derive(Clone, Debug, Default, Serialize)]
pub struct StageTimes {
    /// Routing every layer's new tokens.
    pub route_ms: f64,
    /// Appending the step's tokens: routed experts copied in, placement planned, pages taken, K/V
    /// written.
    pub append_ms: f64,
    /// Compressing the pages that filled (a codec's plan and encode passes; empty without one).
    pub compress_ms: f64,
    /// Rebuilding every layer's page lists from the shard rings.
    pub gather_ms: f64,
    /// Decode attention, summed over layers (with QUEST's page selection where it runs).
    pub attend_ms: f64,
    /// Scheduling: utilities, budgets, victims, compaction, freeing.
    pub evict_ms: f64,
    /// Recounting each expert's tokens in the pool (miss rates for the next step's routing).
    pub miss_ms: f64,
}

impl StageTimes {
    /// From a step's milliseconds per stage ([`crate::step::StepTimer::read`]), each summed
    /// over the layers; a stage that did not run took 0.
    pub(super) fn from_stage_ms(ms: &std::collections::BTreeMap<&'static str, f64>) -> StageTimes {
        let get = |stage: &str| ms.get(stage).copied().unwrap_or(0.0);
        StageTimes {
            route_ms: get("route"),
            append_ms: get("append"),
            compress_ms: get("compress"),
            gather_ms: get("gather"),
            attend_ms: get("attention"),
            evict_ms: get("evict"),
            miss_ms: get("miss"),
        }
    }

    /// The step's GPU time: every stage.
    pub fn total_ms(&self) -> f64 {
        self.route_ms + self.append_ms + self.compress_ms + self.gather_ms + self.attend_ms + self.evict_ms + self.miss_ms
    }
}

/// What one decode step did: stage times, pool occupancy, and the routing and eviction counters
/// ([`StepReport::collect`]); one CSV line per step with [`StepReport::csv_row`].
#[derive(Clone, Debug, Serialize)]
pub struct StepReport {
    /// The decode step, counted from 0.
    pub step: u32,
    /// Tokens cached per sequence and layer after the step.
    pub context: u32,
    /// GPU time of each stage; `None` where the device has no timestamp queries.
    pub gpu: Option<StageTimes>,
    /// Host wall-clock time of the step until the GPU finished it and its timestamps were read, in
    /// milliseconds; NaN in the browser.
    pub host_ms: f64,
    /// Bytes of the pages in use (what the cache occupies).
    pub kv_bytes_resident: u64,
    /// Bytes of K/V actually stored in them (tokens x bytes per token).
    pub kv_bytes_tokens: u64,
    /// Pages in use, raw and compressed.
    pub pages_in_use: u32,
    /// Pages in the pool, raw and compressed.
    pub pages_total: u32,
    /// Pages held by each shard index, summed over layers and sequences.
    pub shard_pages: Vec<u32>,
    /// Pages recycled because their ring was full, their tokens dropped; cumulative.
    pub ring_overflows: u32,
    /// Routing entropy (nats) of the step, averaged over layers.
    pub routing_entropy: f32,
    /// Miss rate averaged over (layer, expert), weighted by tokens appended.
    pub miss_rate: f32,
    /// Moving-average load of each expert, averaged over layers.
    pub expert_load: Vec<f32>,
    /// Per expert, summed over layers: routed (token, expert) pairs whose K/V is still cached
    /// (hits for the next access): the route stage's resident K/V vectors over the KV heads
    /// ([`ExpertStats`](crate::gpu_data::ExpertStats) counts one per token and head).
    pub expert_hits: Vec<u64>,
    /// Per expert, summed over layers: routed pairs no longer cached, `appended - hits`.
    pub expert_misses: Vec<u64>,
    /// Tokens evicted this step (all lists).
    pub evicted: u64,
    /// Pages returned to the free stack by eviction so far.
    pub pages_evicted: u32,
    /// Share of the attention mass the kept tokens held at this step's eviction (mean over lists).
    pub kept_attention: f32,
    /// Relative L2 error of the attention output against the full cache (mean over layers).
    pub attention_error: Option<f64>,
    /// Bytes the full cache would occupy now (pages of the reference pool).
    pub full_kv_bytes: Option<u64>,
    /// K/V bytes the step's attention read (QUEST reads only its selected pages).
    pub kv_bytes_attended: u64,
    /// FlexGen: K/V bytes held in host memory, and moved between the tiers so far.
    pub host_kv_bytes: u64,
    /// FlexGen: K/V bytes moved between GPU and host memory so far, both ways; 0 without it.
    pub tier_bytes_moved: u64,
    /// EKVA: per expert, the tokens its groups may keep at this step's eviction (summed over
    /// lists; empty without the allocator or where lists keep everything).
    pub expert_budget: Vec<u64>,
    /// EKVA: per expert, the allocator's importance (mean over layers; empty without it).
    pub expert_importance: Vec<f32>,
}

/// The parts of an engine a step report reads: its pool, and the route stage, scheduler and
/// QUEST selection where it has them (the synthetic pipeline and the model both report
/// through [`StepReport::collect`]).
#[derive(Clone, Copy)]
pub struct ReportParts<'a> {
    /// The pool whose occupancy and counters the report gives.
    pub pool: &'a crate::append::KvPool,
    /// The route stage, for routing entropy, miss rate and per-expert statistics (left empty
    /// without it).
    pub router: Option<&'a crate::route::Router>,
    /// The evicting scheduler, for evictions, kept attention and EKVA's budgets and importance.
    pub scheduler: Option<&'a crate::evict::Scheduler>,
    /// QUEST's selection, for the K/V bytes attention read.
    pub quest: Option<&'a crate::evict::quest::Quest>,
}

impl StepReport {
    /// The counters of the step just run: pool occupancy by tier and shard, the route stage's
    /// statistics per expert, the scheduler's evictions and kept attention, EKVA's budgets and
    /// importance, QUEST's bytes read. `ctl` is the pool's control block after the step;
    /// `context` the tokens cached per sequence and layer.
    pub async fn collect(
        rt: &Runtime,
        parts: ReportParts<'_>,
        ctl: crate::gpu_data::PoolCtl,
        (step, context): (u32, u32),
        gpu: Option<StageTimes>,
        host_ms: f64,
    ) -> Result<StepReport> {
        let cfg = &parts.pool.cfg;
        let rings: Vec<crate::gpu_data::RingState> = rt.read_all(&parts.pool.rings).await?;
        let mut shard_pages = vec![0u32; cfg.n_shards as usize];
        for (key, r) in rings.iter().enumerate() {
            shard_pages[key % cfg.n_shards as usize] += r.count;
        }
        let raw_pages = cfg.n_pages - ctl.free_top;
        let codec_pages = (cfg.n_ids() - cfg.n_pages) - ctl.codec_free_top;
        let pages_in_use = raw_pages + codec_pages;
        let resident = u64::from(raw_pages) * cfg.page_bytes() + u64::from(codec_pages) * cfg.codec_page_bytes();
        // K/V vectors (token x KV head) held in the GPU pool.
        let vectors: u64 = rings.iter().filter(|r| r.count > 0).map(|r| u64::from((r.count - 1) * cfg.page_size + r.fill)).sum();
        let mut report = StepReport {
            routing_entropy: 0.0,
            miss_rate: 0.0,
            expert_load: Vec::new(),
            expert_hits: Vec::new(),
            expert_misses: Vec::new(),
            step,
            context,
            gpu,
            host_ms,
            kv_bytes_resident: resident,
            kv_bytes_tokens: vectors * cfg.token_kv_bytes() / u64::from(cfg.kv_heads),
            pages_in_use,
            pages_total: cfg.n_ids(),
            shard_pages,
            ring_overflows: ctl.ring_overflows,
            evicted: 0,
            pages_evicted: ctl.pages_evicted,
            kept_attention: 1.0,
            attention_error: None,
            full_kv_bytes: None,
            kv_bytes_attended: resident,
            host_kv_bytes: 0,
            tier_bytes_moved: 0,
            expert_budget: Vec::new(),
            expert_importance: Vec::new(),
        };
        if let Some(router) = parts.router {
            let stats = router.read_stats(rt).await?;
            let summary = router.read_summary(rt).await?;
            let e = router.shape.n_experts as usize;
            let (mut load, mut hits, mut misses) = (vec![0f32; e], vec![0u64; e], vec![0u64; e]);
            for (i, s) in stats.iter().enumerate() {
                load[i % e] += s.load / cfg.layers as f32;
                // `resident` counts K/V vectors (a token's, one per KV head); `appended` tokens.
                let resident_tokens = (s.resident / cfg.kv_heads.max(1)).min(s.appended);
                hits[i % e] += u64::from(resident_tokens);
                misses[i % e] += u64::from(s.appended - resident_tokens);
            }
            let appended: u64 = stats.iter().map(|s| u64::from(s.appended)).sum();
            let missing: f64 = stats.iter().map(|s| f64::from(s.miss) * f64::from(s.appended)).sum();
            report.routing_entropy = summary.iter().map(|s| s.entropy).sum::<f32>() / summary.len().max(1) as f32;
            report.miss_rate = if appended > 0 { (missing / appended as f64) as f32 } else { 0.0 };
            (report.expert_load, report.expert_hits, report.expert_misses) = (load, hits, misses);
        }
        if let Some(s) = parts.scheduler {
            let lists = s.read_lists(rt).await?;
            report.evicted = lists.iter().map(|l| u64::from(l.evicted)).sum();
            report.kept_attention = lists.iter().map(|l| l.hit_rate).sum::<f32>() / lists.len().max(1) as f32;
            if let Some(ekva) = &s.ekva {
                let e = ekva.n_experts as usize;
                let mut budget = vec![0u64; e];
                for (i, g) in s.read_groups(rt).await?.iter().enumerate() {
                    if g.budget != crate::gpu_data::KEEP_ALL {
                        budget[i % e] += u64::from(g.budget);
                    }
                }
                let mut mean = vec![0f32; e];
                for (i, x) in s.read_importance(rt).await?.iter().enumerate() {
                    mean[i % e] += x / cfg.layers as f32;
                }
                (report.expert_budget, report.expert_importance) = (budget, mean);
            }
        }
        if let Some(q) = parts.quest {
            let sel: Vec<u32> = rt.read_all(&q.sel_counts).await?;
            report.kv_bytes_attended = sel.iter().map(|c| u64::from(*c)).sum::<u64>() * cfg.page_bytes();
        }
        Ok(report)
    }
}

impl StepReport {
    /// Column names of [`StepReport::csv_row`].
    pub const CSV_HEADER: &'static str = "step,context,route_ms,append_ms,compress_ms,gather_ms,attend_ms,evict_ms,miss_ms,host_ms,\
kv_bytes_resident,kv_bytes_tokens,kv_bytes_attended,full_kv_bytes,pages_in_use,pages_total,ring_overflows,evicted,pages_evicted,\
kept_attention,attention_error,routing_entropy,miss_rate,host_kv_bytes,tier_bytes_moved,shard_pages,expert_load,expert_hits,expert_misses,expert_budget,expert_importance";

    /// One CSV line (no newline): scalars as numbers, empty when absent; per-shard and
    /// per-expert vectors as `;`-separated values in one field.
    pub fn csv_row(&self) -> String {
        fn join<T: std::fmt::Display>(v: &[T]) -> String {
            v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(";")
        }
        let opt = |v: Option<String>| v.unwrap_or_default();
        let g = self.gpu.as_ref();
        let times: Vec<String> = [
            g.map(|g| g.route_ms),
            g.map(|g| g.append_ms),
            g.map(|g| g.compress_ms),
            g.map(|g| g.gather_ms),
            g.map(|g| g.attend_ms),
            g.map(|g| g.evict_ms),
            g.map(|g| g.miss_ms),
        ]
        .iter()
        .map(|t| opt(t.map(|x| format!("{x:.6}"))))
        .collect();
        format!(
            "{},{},{},{:.3},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            self.step,
            self.context,
            times.join(","),
            self.host_ms,
            self.kv_bytes_resident,
            self.kv_bytes_tokens,
            self.kv_bytes_attended,
            opt(self.full_kv_bytes.map(|b| b.to_string())),
            self.pages_in_use,
            self.pages_total,
            self.ring_overflows,
            self.evicted,
            self.pages_evicted,
            self.kept_attention,
            opt(self.attention_error.map(|e| format!("{e:e}"))),
            self.routing_entropy,
            self.miss_rate,
            self.host_kv_bytes,
            self.tier_bytes_moved,
            join(&self.shard_pages),
            join(&self.expert_load),
            join(&self.expert_hits),
            join(&self.expert_misses),
            join(&self.expert_budget),
            join(&self.expert_importance),
        )
    }
}

/// One layer of one decode step, as a trace keeps it (see `crate::trace` for every field).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerRecord {
    /// The decode step, counted from 0.
    pub step: u32,
    /// The layer, counted from 0.
    pub layer: u32,
    /// The routed experts of the step's tokens at this layer, `n_seqs x top_k`, sequence-major.
    pub experts: Vec<u32>,
    /// Page-list entries the layer's attention read (QUEST: its selected pages).
    pub pages_read: u64,
    /// Bytes of those pages, raw and compressed pages at their own sizes.
    pub bytes_read: u64,
    /// Pages held by the layer's shard rings after the step.
    pub pages_in_use: u64,
    /// Tokens the step's eviction took from the layer, summed over its page lists (one per sequence
    /// and KV head); 0 without a scheduler.
    pub tokens_evicted: u64,
    /// Slots compaction copied into holes at this layer; 0 without a scheduler.
    pub slots_moved: u64,
    /// Pages compaction returned to the free stack at this layer; 0 without a scheduler.
    pub pages_freed: u64,
    /// K/V bytes compaction copied: `slots_moved` x one head's K and V.
    pub bytes_moved: u64,
}

impl Pipeline {
    /// What the last step did at every layer, for a trace (`crate::trace`): call right after
    /// [`Pipeline::step`].
    pub async fn trace_records(&self, rt: &Runtime) -> Result<Vec<LayerRecord>> {
        let c = &self.kv.pool.cfg;
        let w = &self.cfg.workload;
        let lists_per_layer = (c.max_seqs * c.kv_heads) as usize;
        let maxp = c.max_pages_per_seq() as usize;
        let (lists, counts) = match &self.kv.quest {
            Some(q) => (rt.read_all::<u32>(&q.sel_list).await?, rt.read_all::<u32>(&q.sel_counts).await?),
            None => self.kv.pool.read_page_lists(rt).await?,
        };
        let rings: Vec<crate::gpu_data::RingState> = rt.read_all(&self.kv.pool.rings).await?;
        let keys_per_layer = lists_per_layer * c.n_shards as usize;
        let (sched_lists, ring_counts) = match &self.kv.scheduler {
            Some(s) => (s.read_lists(rt).await?, s.read_ring_counts(rt).await?),
            None => (Vec::new(), Vec::new()),
        };
        let slot_bytes = 2 * u64::from(c.vec_words()) * 4;
        let mut out = Vec::new();
        for layer in 0..c.layers {
            let l = layer as usize;
            let mut pages_read = 0u64;
            let mut bytes_read = 0u64;
            for li in l * lists_per_layer..(l + 1) * lists_per_layer {
                let n = counts[li] as usize;
                pages_read += n as u64;
                for &page in &lists[li * maxp..li * maxp + n.min(maxp)] {
                    bytes_read += if page < c.n_pages { c.page_bytes() } else { c.codec_page_bytes() };
                }
            }
            let keys = l * keys_per_layer..(l + 1) * keys_per_layer;
            let pages_in_use = rings[keys.clone()].iter().map(|r| u64::from(r.count)).sum();
            let tokens_evicted = sched_lists
                .get(l * lists_per_layer..(l + 1) * lists_per_layer)
                .map_or(0, |ls| ls.iter().map(|s| u64::from(s.evicted)).sum());
            let (slots_moved, pages_freed) = ring_counts
                .get(keys)
                .map_or((0, 0), |rc| rc.iter().fold((0u64, 0u64), |(m, f), x| (m + u64::from(x[0]), f + u64::from(x[1]))));
            out.push(LayerRecord {
                step: self.step.saturating_sub(1),
                layer,
                experts: self.router().read_experts(rt, layer, w.n_seqs).await?,
                pages_read,
                bytes_read,
                pages_in_use,
                tokens_evicted,
                slots_moved,
                pages_freed,
                bytes_moved: slots_moved * slot_bytes,
            });
        }
        Ok(out)
    }
}
