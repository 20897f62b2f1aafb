//! What the viewer draws: plain data taken from a pipeline after each step ([`Snapshot`]), the
//! run it belongs to ([`RunInfo`]) and a ring of recent steps ([`ViewerState`]). Nothing here
//! touches the GPU; `capture` fills a snapshot from a live [`Pipeline`](expertkv_core::pipeline::Pipeline).

use std::collections::VecDeque;

use expertkv_core::PoolConfig;
use expertkv_core::gpu_data::ExpertStats;
use expertkv_core::pipeline::{DemoConfig, StageTimes, StepReport};
use expertkv_core::trace::LayerRecord;

/// Steps kept for the charts over time.
pub const HISTORY: usize = 128;

/// The run a viewer shows: its configuration and where the steps come from.
#[derive(Clone, Debug)]
pub struct RunInfo {
    /// The run's configuration (for a model, its pool and policies).
    pub config: DemoConfig,
    /// The pool geometry the pipeline was built with.
    pub pool: PoolConfig,
    /// Tokens each (layer, sequence, KV head) list keeps under the scheduler.
    pub budget_tokens: Option<u32>,
    /// The GPU adapter: its name and, in brackets, its backend.
    pub adapter: String,
    /// `live` or the trace file being replayed.
    pub source: Source,
}

#[derive(Clone, Debug, PartialEq, Eq)]
/// Where a run's steps come from.
pub enum Source {
    /// The synthetic workload, run as the viewer watches.
    Live,
    /// A recorded trace (its path), re-run and compared step by step.
    Trace(String),
    /// A GGUF model (its path and where its routing labels come from) decoding a prompt: the
    /// configuration describes the model's pool and policies, a step is one generated token.
    Model {
        /// Path of the GGUF file.
        path: String,
        /// What labels the tokens with experts, as `LabelSource::name` gives it (e.g. the MoE
        /// file's router).
        labels: String,
    },
}

/// Per-(layer, expert) router statistics after a step, layer-major (`layer * experts + expert`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExpertGrid {
    /// Layers: the grid's rows.
    pub layers: usize,
    /// Experts per layer: the grid's columns.
    pub experts: usize,
    /// Moving-average share of routing slots (routing frequency).
    pub load: Vec<f32>,
    /// Tokens routed to the expert still in the KV cache (KV occupancy).
    pub resident: Vec<u32>,
    /// Tokens routed to the expert since the start.
    pub appended: Vec<u32>,
    /// Share of the expert's routed tokens no longer cached.
    pub miss: Vec<f32>,
}

impl ExpertGrid {
    /// From the router's statistics buffer (`Router::read_stats`), laid out `layer * experts + e`.
    /// `kv_heads`: the pool's KV heads (`resident` counts one K/V vector per token and head).
    pub fn from_stats(stats: &[ExpertStats], layers: usize, experts: usize, kv_heads: u32) -> ExpertGrid {
        let n = (layers * experts).min(stats.len());
        let s = &stats[..n];
        ExpertGrid {
            layers,
            experts,
            load: s.iter().map(|x| x.load).collect(),
            resident: s.iter().map(|x| (x.resident / kv_heads.max(1)).min(x.appended)).collect(),
            appended: s.iter().map(|x| x.appended).collect(),
            miss: s.iter().map(|x| x.miss).collect(),
        }
    }
}

/// Pages by where they live: raw and compressed pages on the GPU, pages in host memory (FlexGen).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tiers {
    /// Raw pages in use on the GPU.
    pub gpu_raw: u64,
    /// Raw pages in the pool.
    pub gpu_raw_capacity: u64,
    /// Compressed pages in use on the GPU.
    pub gpu_codec: u64,
    /// Compressed pages in the pool (0 without a codec).
    pub gpu_codec_capacity: u64,
    /// Pages held in host memory (FlexGen; 0 otherwise).
    pub host: u64,
}

/// A replayed step beside its recording.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceStep {
    /// The recorded records of the step (one per layer).
    pub recorded: Vec<LayerRecord>,
    /// Where the re-run first departed from the recording at this step; `None`: it matches.
    pub departure: Option<String>,
}

/// Everything the panels draw of one step.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// The step's report.
    pub report: StepReport,
    /// Empty (`layers == 0`) where the router's statistics were not read.
    pub experts: ExpertGrid,
    /// Pages held by each shard ring, in pool key order: `((layer * seqs + seq) * kv_heads + head) * shards + shard`.
    pub ring_pages: Vec<u32>,
    /// Pages in use and in the pool, by tier.
    pub tiers: Tiers,
    /// When replaying a trace: the recorded step and where the re-run departed from it.
    pub trace: Option<TraceStep>,
    /// A model's run: the prompt and the text generated so far.
    pub text: Option<String>,
    /// A MoE model's experts in tiers: which are on the GPU, and the traffic.
    pub residency: Option<ExpertResidency>,
}

/// A MoE model's experts in tiers after a step (a GPU cache of slots per layer over host
/// memory): which experts sit in the GPU's slots, which the step chose, and the fetches.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExpertResidency {
    /// Layers: the grid's rows.
    pub layers: usize,
    /// Experts per layer: the grid's columns.
    pub experts: usize,
    /// GPU slots per layer.
    pub slots: u32,
    /// `layer * experts + e`: the expert is in one of the layer's slots.
    pub resident: Vec<bool>,
    /// `layer * experts + e`: the step chose the expert.
    pub chosen: Vec<bool>,
    /// The step's hits, misses and bytes moved host-to-GPU.
    pub step: [u64; 3],
    /// The same since the run began.
    pub total: [u64; 3],
    /// GPU bytes of the slots, and host bytes of every expert.
    pub bytes: [u64; 2],
    /// Prefetch: experts fetched ahead this step and, of them, the ones chosen; the same since
    /// the run began (all 0 without prefetch).
    pub prefetch: [u64; 4],
    /// The run's routing as an on-demand LRU cache of each size would have served it:
    /// `(slots per layer, hit rate)`, from the fewest slots a step allows (empty: not known).
    pub reuse: Vec<(u32, f32)>,
}

/// What a pipeline driver tells the viewer.
#[derive(Clone, Debug)]
pub enum Event {
    /// A pipeline was (re)built; the history starts over.
    Started(Box<RunInfo>),
    /// Prefill progress, in tokens.
    Prefill {
        /// Tokens appended so far.
        done: u64,
        /// Tokens the prefill appends in all.
        total: u64,
    },
    /// Prefill is done; decode steps may follow.
    Ready,
    /// One decode step.
    Step(Box<Snapshot>),
    /// The run reached its last step.
    Finished,
    /// Building or stepping failed; the run stops.
    Error(String),
}

/// Where the run is.
#[derive(Clone, Debug, PartialEq)]
pub enum Phase {
    /// Waiting for a pipeline to be built.
    Idle,
    /// Prefilling the prompt.
    Prefill {
        /// Tokens appended so far.
        done: u64,
        /// Tokens the prefill appends in all.
        total: u64,
    },
    /// Prefilled; decode steps run (or wait for Run or Step).
    Decoding,
    /// The run reached its last step.
    Finished,
    /// Building or stepping failed, with the error; the run has stopped.
    Failed(String),
}

/// The viewer's data: the run, the latest snapshot and a ring of recent step reports.
#[derive(Clone, Debug)]
pub struct ViewerState {
    /// The run being shown; `None` until a pipeline starts.
    pub info: Option<RunInfo>,
    /// The latest step's snapshot; `None` before the first step.
    pub latest: Option<Snapshot>,
    /// Reports of the latest steps, at most [`HISTORY`], oldest first.
    pub history: VecDeque<StepReport>,
    /// Where the run is.
    pub phase: Phase,
    /// Replayed steps that departed from their recording, first one first.
    pub departures: Vec<(u32, String)>,
}

impl Default for ViewerState {
    fn default() -> Self {
        ViewerState { info: None, latest: None, history: VecDeque::with_capacity(HISTORY), phase: Phase::Idle, departures: Vec::new() }
    }
}

/// Which statistic the heat grid shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HeatMode {
    #[default]
    /// Moving-average share of routing slots per (layer, expert).
    Routing,
    /// Routed tokens still in the KV cache per (layer, expert).
    Occupancy,
    /// Share of routed tokens no longer in the KV cache per (layer, expert).
    MissRate,
}

impl HeatMode {
    /// Every mode, in the order of the selector.
    pub const ALL: [HeatMode; 3] = [HeatMode::Routing, HeatMode::Occupancy, HeatMode::MissRate];

    /// The mode's name in the heat panel, e.g. `routing frequency`.
    pub fn label(self) -> &'static str {
        match self {
            HeatMode::Routing => "routing frequency",
            HeatMode::Occupancy => "KV occupancy",
            HeatMode::MissRate => "miss rate",
        }
    }
}

/// A heat grid: `rows x cols` values, row-major, and the value the colour scale tops out at.
#[derive(Clone, Debug, PartialEq)]
pub struct HeatGrid {
    /// Rows: layers, or 1 where only per-expert data exists.
    pub rows: usize,
    /// Columns: experts.
    pub cols: usize,
    /// Row labels (`L0`, `L1`, ..., or `all layers` where only per-expert data exists).
    pub row_labels: Vec<String>,
    /// `rows x cols` values, row-major, in `unit`.
    pub values: Vec<f32>,
    /// The value the colour scale tops out at: the largest value (1 for miss rates, and where every
    /// value is 0).
    pub max: f32,
    /// What the values measure, for the panel's caption.
    pub unit: &'static str,
}

/// The allocator's split of the budget over experts at the latest eviction.
#[derive(Clone, Debug, PartialEq)]
pub struct BudgetSplit {
    /// Tokens each expert's groups may keep, summed over lists.
    pub tokens: Vec<u64>,
    /// `tokens` over their total.
    pub shares: Vec<f64>,
    /// Each expert's importance under the allocator, averaged over layers.
    pub importance: Vec<f32>,
    /// The sum of `tokens`.
    pub total: u64,
}

/// Stage names and colours of the stacked step-time bars, in pipeline order.
pub const STAGES: [&str; 7] = ["route", "append", "compress", "gather", "attend", "evict", "miss"];

/// GPU milliseconds of each stage, in [`STAGES`] order.
pub fn stage_segments(t: &StageTimes) -> [f64; 7] {
    [t.route_ms, t.append_ms, t.compress_ms, t.gather_ms, t.attend_ms, t.evict_ms, t.miss_ms]
}

impl ViewerState {
    /// Take in an event: a started run clears the history, a step is [`ViewerState::push`]ed, the
    /// others set the phase.
    pub fn apply(&mut self, ev: Event) {
        match ev {
            Event::Started(info) => {
                self.info = Some(*info);
                self.latest = None;
                self.history.clear();
                self.departures.clear();
                self.phase = Phase::Idle;
            }
            Event::Prefill { done, total } => self.phase = Phase::Prefill { done, total },
            Event::Ready => self.phase = Phase::Decoding,
            Event::Step(s) => self.push(*s),
            Event::Finished => self.phase = Phase::Finished,
            Event::Error(e) => self.phase = Phase::Failed(e),
        }
    }

    /// Add a step: its report joins the ring, its grids replace the previous ones.
    pub fn push(&mut self, s: Snapshot) {
        if self.history.len() == HISTORY {
            self.history.pop_front();
        }
        self.history.push_back(s.report.clone());
        if let Some(d) = s.trace.as_ref().and_then(|t| t.departure.clone()) {
            self.departures.push((s.report.step, d));
        }
        self.latest = Some(s);
        if !matches!(self.phase, Phase::Failed(_) | Phase::Finished) {
            self.phase = Phase::Decoding;
        }
    }

    /// The heat grid of `mode`: per (layer, expert) from the router's statistics, or one row per
    /// expert (averaged or summed over layers) from the step report where those are missing.
    pub fn heat(&self, mode: HeatMode) -> Option<HeatGrid> {
        let s = self.latest.as_ref()?;
        let g = &s.experts;
        let (rows, cols, row_labels, values): (usize, usize, Vec<String>, Vec<f32>) = if g.layers > 0 && g.experts > 0 {
            let v = match mode {
                HeatMode::Routing => g.load.clone(),
                HeatMode::Occupancy => g.resident.iter().map(|&x| x as f32).collect(),
                HeatMode::MissRate => g.miss.clone(),
            };
            (g.layers, g.experts, (0..g.layers).map(|l| format!("L{l}")).collect(), v)
        } else {
            let r = &s.report;
            let v: Vec<f32> = match mode {
                HeatMode::Routing => r.expert_load.clone(),
                HeatMode::Occupancy => r.expert_hits.iter().map(|&x| x as f32).collect(),
                HeatMode::MissRate => r
                    .expert_hits
                    .iter()
                    .zip(&r.expert_misses)
                    .map(|(&h, &m)| if h + m > 0 { m as f32 / (h + m) as f32 } else { 0.0 })
                    .collect(),
            };
            if v.is_empty() {
                return None;
            }
            (1, v.len(), vec!["all".into()], v)
        };
        let (max, unit) = match mode {
            HeatMode::Routing => (values.iter().copied().fold(0.0, f32::max), "share of routing slots (moving average)"),
            HeatMode::Occupancy => (values.iter().copied().fold(0.0, f32::max), "routed tokens still cached"),
            HeatMode::MissRate => (1.0, "share of routed tokens evicted"),
        };
        Some(HeatGrid { rows, cols, row_labels, values, max: if max > 0.0 { max } else { 1.0 }, unit })
    }

    /// The EKVA budget split at the latest step; `None` without the allocator.
    pub fn budget_split(&self) -> Option<BudgetSplit> {
        let r = &self.latest.as_ref()?.report;
        if r.expert_budget.is_empty() {
            return None;
        }
        let total: u64 = r.expert_budget.iter().sum();
        let shares = r.expert_budget.iter().map(|&t| if total > 0 { t as f64 / total as f64 } else { 0.0 }).collect();
        Some(BudgetSplit { tokens: r.expert_budget.clone(), shares, importance: r.expert_importance.clone(), total })
    }

    /// Tokens evicted at each step in the history, with the step numbers.
    pub fn evictions(&self) -> Vec<(u32, u64)> {
        self.history.iter().map(|r| (r.step, r.evicted)).collect()
    }

    /// Per-stage GPU time of each step in the history that has timestamps.
    pub fn step_times(&self) -> Vec<(u32, [f64; 7])> {
        self.history.iter().filter_map(|r| r.gpu.as_ref().map(|g| (r.step, stage_segments(g)))).collect()
    }

    /// Pages of each shard ring (rows: (layer, sequence, KV head); columns: shards) and the ring
    /// capacity they fill.
    pub fn ring_fill(&self) -> Option<(usize, usize, &[u32], u32)> {
        let s = self.latest.as_ref()?;
        let info = self.info.as_ref()?;
        let shards = info.pool.n_shards as usize;
        if shards == 0 || s.ring_pages.is_empty() {
            return None;
        }
        Some((s.ring_pages.len() / shards, shards, &s.ring_pages, info.pool.ring_capacity))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(step: u32) -> StepReport {
        StepReport {
            step,
            context: 100 + step,
            gpu: Some(StageTimes {
                route_ms: 1.0,
                append_ms: 2.0,
                compress_ms: 0.75,
                gather_ms: 0.5,
                attend_ms: 4.0,
                evict_ms: 1.5,
                miss_ms: 0.25,
            }),
            host_ms: 0.0,
            kv_bytes_resident: 4096,
            kv_bytes_tokens: 2048,
            pages_in_use: 3,
            pages_total: 10,
            shard_pages: vec![1, 2],
            ring_overflows: 0,
            routing_entropy: 1.0,
            miss_rate: 0.5,
            expert_load: vec![0.25, 0.75],
            expert_hits: vec![3, 1],
            expert_misses: vec![1, 3],
            evicted: u64::from(step),
            pages_evicted: step,
            kept_attention: 0.9,
            attention_error: None,
            full_kv_bytes: None,
            kv_bytes_attended: 4096,
            host_kv_bytes: 0,
            tier_bytes_moved: 0,
            expert_budget: vec![30, 10],
            expert_importance: vec![0.6, 0.4],
        }
    }

    fn snap(step: u32) -> Snapshot {
        Snapshot {
            report: report(step),
            experts: ExpertGrid::default(),
            ring_pages: Vec::new(),
            tiers: Tiers::default(),
            trace: None,
            text: None,
            residency: None,
        }
    }

    #[test]
    fn history_is_a_ring_of_the_latest_steps() {
        let mut s = ViewerState::default();
        for step in 0..(HISTORY as u32 + 5) {
            s.apply(Event::Step(Box::new(snap(step))));
        }
        assert_eq!(s.history.len(), HISTORY);
        assert_eq!(s.history.front().map(|r| r.step), Some(5));
        assert_eq!(s.evictions().last(), Some(&(HISTORY as u32 + 4, HISTORY as u64 + 4)));
        assert_eq!(s.phase, Phase::Decoding);
    }

    #[test]
    fn heat_falls_back_to_per_expert_report_data() {
        let mut s = ViewerState::default();
        s.push(snap(0));
        let h = s.heat(HeatMode::MissRate).expect("grid");
        assert_eq!((h.rows, h.cols), (1, 2));
        assert_eq!(h.values, vec![0.25, 0.75]);
        let h = s.heat(HeatMode::Routing).expect("grid");
        assert_eq!(h.max, 0.75);
    }

    #[test]
    fn budget_split_shares_sum_to_one() {
        let mut s = ViewerState::default();
        s.push(snap(0));
        let b = s.budget_split().expect("split");
        assert_eq!(b.total, 40);
        assert!((b.shares.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert_eq!(b.shares[0], 0.75);
    }

    #[test]
    fn started_clears_the_history() {
        let mut s = ViewerState::default();
        s.push(snap(0));
        s.apply(Event::Error("boom".into()));
        assert_eq!(s.phase, Phase::Failed("boom".into()));
        let cfg = DemoConfig::default();
        let info = RunInfo { pool: cfg.pool_config(), config: cfg, budget_tokens: None, adapter: "x".into(), source: Source::Live };
        s.apply(Event::Started(Box::new(info)));
        assert!(s.history.is_empty() && s.latest.is_none());
        assert_eq!(s.phase, Phase::Idle);
    }
}
