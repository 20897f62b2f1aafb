//! The roofline planner: from the adapter's measured bandwidth and compute, predict a decode
//! step's attention time for a configuration (codec, budget, shape), and pick the configuration
//! that meets a latency or memory target. PiKV's step-time model and buffer rule are implemented
//! as written, so that their predictions can be printed next to measurements.
//!
//! Definitions (per decode step, all layers):
//! - kept tokens per (layer, sequence, KV head): the layer's budget under an evicting scheduler
//!   (PyramidKV and FastV included), the budget for QUEST (pages read) and FlexGen (GPU tier),
//!   else the whole context;
//! - bytes read = kept tokens x bytes per token and head (f16 or f32 K and V; a codec's
//!   compressed page bytes / page size);
//! - flops = 2 (multiply, add) x 2 (q.k and p.v) x head_dim x query heads x kept tokens;
//! - roofline time = max(bytes / bandwidth, flops / compute);
//! - PiKV: `T = d k B / rho (2 / beta + eta / gamma)`, with d k B the K/V elements of the full
//!   cache (head_dim x KV heads x batch x context x layers x 2), rho the measured compression
//!   (f16 bytes of the full cache over bytes read), 2 bytes per f16 element, beta the bandwidth,
//!   eta = 2 x group the flops per element, gamma the compute: the memory and compute terms
//!   added rather than overlapped;
//! - PiKV's buffer rule `S* = sqrt(L / (K G))`: L the context, K the pages kept per list, G the
//!   GPUs (1 here), S* the page size it recommends.

use serde::Serialize;

use crate::bench::Roofline;
use crate::config::Codec;
use crate::error::Result;
use crate::evict::config::SchedulerConfig;
use crate::pipeline::DemoConfig;

/// What one decode step's attention must read and compute.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct AttentionLoad {
    /// K/V bytes attention reads in the step, all layers: kept tokens x bytes per token and head.
    pub kv_bytes_read: u64,
    /// Floating-point operations of the step's attention: 4 x head_dim x query heads x kept tokens.
    pub flops: u64,
    /// K/V elements of the full cache (no budget, no codec).
    pub full_elements: u64,
    /// Bytes the full cache would read in f16.
    pub full_f16_bytes: u64,
    /// Kept tokens per (layer, sequence, KV head) list, averaged.
    pub kept_tokens: f64,
}

impl AttentionLoad {
    /// Compression of what attention reads against the full f16 cache (budget and codec).
    pub fn rho(&self) -> f64 {
        self.full_f16_bytes as f64 / self.kv_bytes_read.max(1) as f64
    }
}

/// The load of `cfg`'s last decode step (context = prompt + steps).
pub fn attention_load(cfg: &DemoConfig) -> Result<AttentionLoad> {
    let w = &cfg.workload;
    let context = u64::from(w.prompt_len + cfg.steps);
    let layers = u64::from(w.layers);
    let kept_per_layer: Vec<u64> = match (&cfg.scheduler, cfg.layer_budgets()?, cfg.budget_tokens()?) {
        (Some(s), Some(lb), _) if s.uses_evict_kernels() => lb.iter().map(|&b| u64::from(b).min(context)).collect(),
        (Some(SchedulerConfig::Quest | SchedulerConfig::FlexGen), _, Some(b)) => vec![u64::from(b).min(context); w.layers as usize],
        _ => vec![context; w.layers as usize],
    };
    let pool = cfg.pool_config();
    let bytes_per_token_head = match cfg.codec {
        Codec::None => pool.token_kv_bytes() / u64::from(pool.kv_heads),
        _ => pool.codec_page_bytes() / u64::from(pool.page_size),
    };
    let lists_per_layer = u64::from(w.n_seqs) * u64::from(w.kv_heads);
    let kept: u64 = kept_per_layer.iter().sum::<u64>() * lists_per_layer;
    let d = u64::from(w.head_dim);
    let q_heads_per_kv = u64::from(w.group);
    let full_elements = 2 * d * lists_per_layer * context * layers;
    Ok(AttentionLoad {
        kv_bytes_read: kept * bytes_per_token_head,
        flops: 2 * 2 * d * q_heads_per_kv * kept,
        full_elements,
        full_f16_bytes: full_elements * 2,
        kept_tokens: kept as f64 / (lists_per_layer * layers) as f64,
    })
}

/// Predicted attention time of one step.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct StepPrediction {
    /// Milliseconds to read `kv_bytes_read` at the measured bandwidth.
    pub memory_ms: f64,
    /// Milliseconds for `flops` at the measured compute rate.
    pub compute_ms: f64,
    /// max(memory, compute).
    pub roofline_ms: f64,
    /// PiKV's `T = d k B / rho (2 / beta + eta / gamma)`.
    pub pikv_ms: f64,
}

/// The roofline and PiKV predictions of `load` on a device measured as `r`; `group` is the query
/// heads per KV head (PiKV's eta = 2 x group).
pub fn predict(load: &AttentionLoad, r: &Roofline, group: u32) -> StepPrediction {
    let beta = r.bandwidth_gbps * 1e9;
    let gamma = r.compute_gflops * 1e9;
    let memory_ms = load.kv_bytes_read as f64 / beta * 1e3;
    let compute_ms = load.flops as f64 / gamma * 1e3;
    let eta = 2.0 * f64::from(group);
    let pikv_ms = load.full_elements as f64 / load.rho() * (2.0 / beta + eta / gamma) * 1e3;
    StepPrediction { memory_ms, compute_ms, roofline_ms: memory_ms.max(compute_ms), pikv_ms }
}

/// PiKV's buffer rule `S* = sqrt(L / (K G))`.
pub fn pikv_buffer_size(context: u64, kept_pages: u64, gpus: u64) -> f64 {
    (context as f64 / (kept_pages.max(1) * gpus.max(1)) as f64).sqrt()
}

/// A configuration the planner weighs.
#[derive(Clone, Debug, Serialize)]
pub struct Candidate {
    /// The page codec.
    pub codec: Codec,
    /// The budget as given: tokens (`256`) or a share of the context (`25%`).
    pub budget: String,
    /// What its last decode step's attention reads and computes.
    pub load: AttentionLoad,
    /// That step's predicted time.
    pub prediction: StepPrediction,
}

/// What the planner is asked to meet (either or both).
#[derive(Clone, Copy, Debug, Default)]
pub struct Target {
    /// Predicted attention time per step at most this.
    pub step_ms: Option<f64>,
    /// K/V bytes read (held) per step at most this.
    pub kv_bytes: Option<u64>,
}

/// The candidate to run: among those that meet the target, the one that keeps the most tokens,
/// then the one that compresses least (the quality proxies a roofline can rank); `None` when no
/// candidate meets it. Candidates are expected in any order.
pub fn choose(cands: &[Candidate], target: Target) -> Option<&Candidate> {
    let fits = |c: &&Candidate| {
        target.step_ms.is_none_or(|t| c.prediction.roofline_ms <= t) && target.kv_bytes.is_none_or(|b| c.load.kv_bytes_read <= b)
    };
    cands
        .iter()
        .filter(fits)
        .max_by(|a, b| a.load.kept_tokens.total_cmp(&b.load.kept_tokens).then(codec_fidelity(a.codec).cmp(&codec_fidelity(b.codec))))
}

/// Higher keeps more of the values (a ranking, not a measurement).
fn codec_fidelity(c: Codec) -> u32 {
    match c {
        Codec::None => 5,
        Codec::Int8 { .. } => 4,
        Codec::Int4 { .. } => 3,
        Codec::LowRank { .. } | Codec::Lora { .. } => 2,
        Codec::FastvDims { .. } => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(codec: Codec, budget: &str, sched: Option<SchedulerConfig>) -> DemoConfig {
        DemoConfig { codec, budget: budget.into(), scheduler: sched, ..Default::default() }
    }

    #[test]
    fn loads_follow_budget_and_codec() {
        let full = attention_load(&cfg(Codec::None, "100%", None)).unwrap();
        let w = DemoConfig::default().workload;
        let ctx = u64::from(w.prompt_len + DemoConfig::default().steps);
        assert_eq!(full.kv_bytes_read, u64::from(w.layers * w.n_seqs * w.kv_heads) * ctx * 2 * u64::from(w.head_dim) * 2);
        assert!((full.rho() - 1.0).abs() < 1e-12);
        let h2o = attention_load(&cfg(Codec::None, "25%", Some(SchedulerConfig::H2o { sinks: 4, window: 32 }))).unwrap();
        assert!((h2o.rho() - 4.0).abs() < 0.05, "{}", h2o.rho());
        let int4 = attention_load(&cfg(Codec::Int4 { group: 32 }, "100%", None)).unwrap();
        assert!(int4.rho() > 2.5 && int4.rho() < 3.5, "{}", int4.rho());
        assert_eq!(int4.flops, full.flops);
        let r = Roofline { bandwidth_gbps: 1000.0, compute_gflops: 1000.0 };
        let p = predict(&full, &r, w.group);
        assert!((p.memory_ms - full.kv_bytes_read as f64 / 1e9).abs() < 1e-9);
        assert!((p.pikv_ms - (p.memory_ms + p.compute_ms)).abs() < 1e-9 * p.pikv_ms.max(1.0), "{p:?}");
        assert!((pikv_buffer_size(4096, 16, 1) - 16.0).abs() < 1e-12);
    }

    #[test]
    fn the_planner_keeps_the_most_that_fits() {
        let r = Roofline { bandwidth_gbps: 100.0, compute_gflops: 1e6 };
        let mut cands = Vec::new();
        for codec in [Codec::None, Codec::Int8 { group: 32 }, Codec::Int4 { group: 32 }] {
            for (budget, sched) in [("100%", None), ("50%", Some(SchedulerConfig::H2o { sinks: 4, window: 32 }))] {
                // Codecs run with the full cache.
                if codec != Codec::None && sched.is_some() {
                    continue;
                }
                let c = cfg(codec, budget, sched);
                let load = attention_load(&c).unwrap();
                cands.push(Candidate { codec, budget: budget.into(), load, prediction: predict(&load, &r, 4) });
            }
        }
        let full_ms = cands[0].prediction.roofline_ms;
        // Loose target: the full f16 cache.
        let c = choose(&cands, Target { step_ms: Some(full_ms * 1.01), kv_bytes: None }).unwrap();
        assert_eq!((c.codec, c.budget.as_str()), (Codec::None, "100%"));
        // Half the time: a whole context in int4 or int8 beats halving the budget in f16.
        let c = choose(&cands, Target { step_ms: Some(full_ms * 0.55), kv_bytes: None }).unwrap();
        assert_eq!(c.budget, "100%");
        assert!(c.codec != Codec::None);
        assert!(choose(&cands, Target { step_ms: Some(full_ms * 0.01), kv_bytes: None }).is_none());
    }
}
