//! Timing the forward pass: decode steps submitted back to back ([`GpuLlama::time_steps`]), and
//! where a step's GPU time goes, stage by stage ([`StageTimer`]: timestamps written between the
//! passes of the step's one command buffer).

use std::collections::BTreeMap;

use super::GpuLlama;
#[cfg(not(target_arch = "wasm32"))]
use crate::Error;
use crate::Result;
use expertkv_core::runtime::Runtime;
#[cfg(not(target_arch = "wasm32"))]
use expertkv_core::runtime::dispatch::dispatches_encoded;
use expertkv_core::step::{StepTimer, Timing};

/// Timestamps written between a step's passes (`write_timestamp` on the command encoder,
/// [`Timing::Marks`]), each labelled with the stage that ran since the one before: the GPU time
/// of embed, attention inputs, route, append, compress, gather, attention, FFN or experts, head,
/// evict and the miss recount, summed over the layers. Needs the device's
/// `TIMESTAMP_QUERY_INSIDE_ENCODERS`.
pub struct StageTimer {
    pub(super) timer: StepTimer,
    /// Every collected recording's kind (decode or prefill) and stage times
    /// ([`StageTimer::collect`]).
    log: Vec<(&'static str, BTreeMap<&'static str, f64>)>,
}

impl StageTimer {
    /// Room for `capacity` timestamps; `None` when the device cannot write them between passes.
    pub fn new(rt: &Runtime, capacity: u32) -> Option<StageTimer> {
        StepTimer::new(rt, capacity, Timing::Marks).map(|timer| StageTimer { timer, log: Vec::new() })
    }

    /// Read the last recording's stage times (after its submission) into the log, as a
    /// recording of `kind`: milliseconds per stage, summed over the stage's marks.
    pub(super) async fn collect(&mut self, rt: &Runtime, kind: &'static str) -> Result<()> {
        let stages = self.timer.read(rt).await?;
        self.log.push((kind, stages));
        Ok(())
    }
}

/// Decode steps [`GpuLlama::time_steps`] times stage by stage.
#[cfg(not(target_arch = "wasm32"))]
pub const PROFILED_STEPS: u32 = 5;

/// Timestamps a step or prefill chunk of `layers` layers writes at most.
pub(super) fn marks_per_recording(layers: u32) -> u32 {
    14 * layers + 8
}

/// The log's recordings of `kind`: their count, each stage's median milliseconds per
/// recording (decode steps) or its sum over them (prefill chunks), and the total.
fn summary(log: &[(&'static str, BTreeMap<&'static str, f64>)], kind: &str, sum: bool) -> serde_json::Value {
    let mut by_stage: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    let mut count = 0;
    for (_, s) in log.iter().filter(|(k, _)| *k == kind) {
        count += 1;
        for (k, v) in s {
            by_stage.entry(k).or_default().push(*v);
        }
    }
    if count == 0 {
        return serde_json::Value::Null;
    }
    let stat = |v: &[f64]| if sum { v.iter().sum() } else { expertkv_core::runtime::timer::median(v) };
    let stages: BTreeMap<&str, f64> = by_stage.into_iter().map(|(k, v)| (k, stat(&v))).collect();
    let total: f64 = stages.values().sum();
    serde_json::json!({ "recordings": count, "total_ms": total, "stages_ms": stages })
}

impl GpuLlama {
    /// Time `n` decode steps of `token` (for every sequence) submitted back to back with
    /// nothing read between them, as a serving loop that keeps the GPU busy would run: the first
    /// half untimed (an idle GPU takes a while to reach its serving clock), the second half
    /// timed: wall time per step, and the host's share (staging, encoding, submitting). Where
    /// the device writes timestamps between passes, the last five steps of the
    /// untimed half are also timed stage by stage (each read back before the next, so they
    /// are not in the wall time): `gpu` holds each stage's median GPU milliseconds per step.
    /// The steps' K/V stay in the pool and the positions advance (an evicting scheduler evicts
    /// in every step, as in [`GpuLlama::forward`]); the per-expert counts are not updated. Not
    /// with a host tier or an expert cache (the host acts between layers), nor while every
    /// eviction is checked ([`GpuLlama::verify_evictions`]).
    #[cfg(not(target_arch = "wasm32"))]
    pub async fn time_steps(&mut self, rt: &Runtime, token: u32, n: u32) -> Result<serde_json::Value> {
        if self.kv.flexgen.is_some() || self.expert_cache().is_some() || self.verify_evictions {
            return Err(Error::Input(
                "timing back-to-back steps needs no host tier, expert cache or eviction check (the host acts between layers or after the eviction)"
                    .into(),
            ));
        }
        let c = &self.kv.pool.cfg;
        // Under a budget the pool holds the budget and positions run on to the context.
        let cap = match self.kept_per_list {
            Some(_) => self.max_context,
            None => (c.ring_capacity - 1) * c.page_size - c.page_size,
        };
        let room = cap.saturating_sub(self.positions.iter().copied().max().unwrap_or(0));
        if n < 2 || n > room {
            return Err(Error::Input(format!("time_steps: {n} steps, the context has room for {room} (at least 2)")));
        }
        let tokens = vec![token; self.n_seqs as usize];
        let warmup = n / 2;
        let profiled = warmup.saturating_sub(PROFILED_STEPS)..warmup;
        let outer = self.timer.take();
        let mut timer = StageTimer::new(rt, marks_per_recording(self.cfg.block_count));
        let mut timer_log = Vec::new();
        let d0 = dispatches_encoded();
        let mut t0 = std::time::Instant::now();
        let mut host = std::time::Duration::ZERO;
        for i in 0..n {
            if i == profiled.start {
                self.timer = timer.take();
            }
            if i == warmup {
                rt.read::<f32>(&self.s.logits, 0, 1).await?;
                t0 = std::time::Instant::now();
                host = std::time::Duration::ZERO;
            }
            let h0 = std::time::Instant::now();
            // No pauses without a host tier or an expert cache: one segment.
            let segments = self.encode_step(rt, &tokens)?;
            rt.queue.submit(segments.into_iter().map(|s| s.cb));
            host += h0.elapsed();
            if let Some(t) = &mut self.timer
                && profiled.contains(&i)
            {
                t.collect(rt, "decode").await?;
                if i + 1 == profiled.end {
                    timer_log = std::mem::take(&mut t.log);
                    self.timer = None;
                }
            }
            for p in &mut self.positions {
                *p += 1;
            }
            self.step += 1;
        }
        rt.read::<f32>(&self.s.logits, 0, 1).await?;
        let wall = t0.elapsed();
        self.timer = outer;
        rt.check("model forward")?;
        self.kv.pool.check_errors(rt, self.n_seqs * self.cfg.block_count).await?;
        let timed = f64::from(n - warmup);
        let dispatches = (dispatches_encoded() - d0) / u64::from(n);
        Ok(serde_json::json!({
            "dispatches_per_step": dispatches,
            "measure": "decode_steps",
            "steps": n - warmup,
            "warmup_steps": warmup,
            "wall_ms_per_step": wall.as_secs_f64() * 1e3 / timed,
            "tokens_per_s": timed * f64::from(self.n_seqs) / wall.as_secs_f64(),
            "host_ms_per_step": host.as_secs_f64() * 1e3 / timed,
            "gpu": summary(&timer_log, "decode", false),
            "recall": match &self.kv.recall {
                Some(t) => serde_json::json!({
                    "pages": t.cfg.pages,
                    "host_memory": t.host_memory,
                    "bytes_read_per_step": t.bytes_read_per_step(rt, &self.kv.pool).await?,
                    "digest_bytes_read_per_step": t.digest_bytes_read_per_step(rt, &self.kv.pool).await?,
                    "digest_bytes": t.digest_bytes(),
                }),
                None => serde_json::Value::Null,
            },
        }))
    }

    /// Time every following step and prefill chunk stage by stage, on the GPU (each read back
    /// before the next is recorded, so use it to see where the time goes, not for throughput);
    /// [`GpuLlama::stage_times`] ends it. False where the device cannot write timestamps
    /// between passes.
    pub fn time_stages(&mut self, rt: &Runtime) -> bool {
        self.timer = StageTimer::new(rt, marks_per_recording(self.cfg.block_count));
        self.timer.is_some()
    }

    /// The stage times since [`GpuLlama::time_stages`], and stop timing: `prefill` (each
    /// stage's milliseconds summed over the chunks) and `decode` (each stage's median per
    /// step), `null` where none ran.
    pub fn stage_times(&mut self) -> serde_json::Value {
        let log = self.timer.take().map(|t| t.log).unwrap_or_default();
        serde_json::json!({ "prefill": summary(&log, "prefill", true), "decode": summary(&log, "decode", false) })
    }
}
