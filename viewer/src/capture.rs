//! Snapshots of a live [`Pipeline`]: the step report plus what the pipeline's public readers
//! give per (layer, expert) and per shard ring. Reads small buffers back; call between steps.

use expertkv_core::Runtime;
use expertkv_core::append::KvPool;
use expertkv_core::gpu_data::{ExpertStats, RingState};
use expertkv_core::pipeline::{Pipeline, StepReport};
use expertkv_core::trace::{Trace, first_difference};

use crate::state::{ExpertGrid, RunInfo, Snapshot, Source, Tiers, TraceStep};

/// The run a pipeline makes.
pub fn run_info(rt: &Runtime, p: &Pipeline, source: Source) -> RunInfo {
    RunInfo {
        config: p.cfg.clone(),
        pool: p.kv.pool.cfg.clone(),
        budget_tokens: p.cfg.budget_tokens().ok().flatten(),
        adapter: format!("{} ({:?})", rt.info.name, rt.info.backend),
        source,
    }
}

/// Everything the panels need after `p.step()` returned `report`.
pub async fn capture(rt: &Runtime, p: &Pipeline, report: StepReport) -> expertkv_core::Result<Snapshot> {
    let stats = p.router().read_stats(rt).await?;
    let host = p.kv.flexgen.as_ref().map_or(0, |(fg, _)| fg.stats.host_pages);
    capture_pool(rt, &p.kv.pool, (&stats, p.cfg.workload.n_experts as usize), host, report).await
}

/// A snapshot of any engine's pool (the synthetic pipeline's or a model's): `stats` are the
/// route stage's per-(layer, expert) statistics of `experts` experts (empty: none), `host_pages`
/// the pages in host memory.
pub async fn capture_pool(
    rt: &Runtime,
    pool: &KvPool,
    (stats, experts): (&[ExpertStats], usize),
    host_pages: u64,
    report: StepReport,
) -> expertkv_core::Result<Snapshot> {
    let c = &pool.cfg;
    let experts =
        if stats.is_empty() { ExpertGrid::default() } else { ExpertGrid::from_stats(stats, c.layers as usize, experts, c.kv_heads) };
    let rings: Vec<RingState> = rt.read_all(&pool.rings).await?;
    let ctl = pool.read_ctl(rt).await?;
    let codec_capacity = u64::from(c.n_ids() - c.n_pages);
    let tiers = Tiers {
        gpu_raw: u64::from(c.n_pages.saturating_sub(ctl.free_top)),
        gpu_raw_capacity: u64::from(c.n_pages),
        gpu_codec: codec_capacity.saturating_sub(u64::from(ctl.codec_free_top)),
        gpu_codec_capacity: codec_capacity,
        host: host_pages,
    };
    Ok(Snapshot { report, experts, ring_pages: rings.iter().map(|r| r.count).collect(), tiers, trace: None, text: None, residency: None })
}

/// The last step of a pipeline re-running `trace`, compared with the recording (call right after
/// `p.step()`, as `expertkv replay` does).
pub async fn trace_step(rt: &Runtime, p: &Pipeline, trace: &Trace, step: u32) -> expertkv_core::Result<TraceStep> {
    let got = p.trace_records(rt).await?;
    let recorded = trace.step(step).to_vec();
    let departure = if recorded.len() != got.len() {
        Some(format!("{} layers recorded, {} replayed", recorded.len(), got.len()))
    } else {
        recorded.iter().zip(&got).find_map(|(want, got)| first_difference(want, got).map(|d| format!("layer {}: {d}", want.layer)))
    };
    Ok(TraceStep { recorded, departure })
}
