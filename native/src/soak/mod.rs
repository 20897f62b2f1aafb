//! `expertkv soak`: decoding for many steps with continuous churn, every sequence finishing at a
//! random length and freeing its pages while a new one takes its slot at position 0; the
//! synthetic workload through the decode step's stages under an evicting scheduler and a page
//! codec (either or both, `pool.rs`), or a GGUF model's whole engine (`model.rs`). Both report
//! through one [`Checker`]: every `--check-every` steps the pool is read back and its
//! invariants checked (`PoolSnapshot::check_invariants`: every page free or in one ring, free +
//! used = total, no token lost or duplicated, fills consistent); host RSS, the GPU memory the
//! device reports (where the backend reports it) and steps per second are recorded per window,
//! so leaks and slowdowns show as trends.

mod model;
mod pool;

use std::collections::HashSet;

use anyhow::{Result, bail};
use clap::Args;
use expertkv_core::append::PoolSnapshot;
use expertkv_core::append::invariants::TokenId;
use expertkv_core::config::PoolConfig;
use expertkv_core::runtime::Runtime;
use serde::Serialize;

use crate::GpuArgs;

#[derive(Args)]
pub struct SoakArgs {
    /// Decode steps (each: one token per sequence and layer appended, attention at every layer,
    /// eviction).
    #[arg(long, default_value_t = 20_000)]
    pub steps: u32,
    /// Sequences decoding at once (a finished one is replaced at once).
    #[arg(long, default_value_t = 4)]
    pub seqs: u32,
    #[arg(long, default_value_t = 2)]
    layers: u32,
    #[arg(long, default_value_t = 2)]
    kv_heads: u32,
    #[arg(long, default_value_t = 64)]
    head_dim: u32,
    /// Tokens a sequence decodes before it finishes, drawn uniformly from MIN:MAX.
    #[arg(long, default_value = "32:400")]
    lengths: String,
    /// An evicting scheduler (h2o, streaming-llm, lru, lru-plus, adakv, duo) or none.
    #[arg(long, default_value = "h2o")]
    pub scheduler: String,
    /// Tokens each (layer, sequence, KV head) keeps under the scheduler.
    #[arg(long, default_value_t = 64)]
    pub budget: u32,
    /// A page codec (int8, int4, fastv-dims), alone or under the scheduler [default: none].
    #[arg(long)]
    pub codec: Option<String>,
    /// The recall tier under the scheduler: every victim kept, PAGES of each list's best
    /// evicted pages attended at every layer [default: off].
    #[arg(long, value_name = "PAGES")]
    pub recall: Option<u32>,
    /// Steps between invariant checks (and report lines).
    #[arg(long, default_value_t = 1000)]
    pub check_every: u32,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// One JSON object per check instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Soak a GGUF model's whole engine instead of the pool alone: rounds of random prompts
    /// (--lengths tokens each, prompt and generated), --seqs decoded together by the batch
    /// decoder under --scheduler, --budget and --codec; the pool checked every --check-every
    /// steps and empty after every round.
    #[arg(long, value_name = "FILE")]
    pub model: Option<std::path::PathBuf>,
}

/// One window of the soak.
#[derive(Serialize)]
struct Window {
    step: u32,
    /// Tokens (x KV heads) cached now, and pages in use.
    cached: usize,
    pages_in_use: u32,
    /// Sequences finished so far.
    finished: u64,
    steps_per_s: f64,
    host_rss_mib: f64,
    /// GPU memory the device reports allocated, where the backend reports it.
    gpu_allocated_mib: Option<f64>,
}

impl Window {
    /// The window as a row of the soak's table.
    fn row(&self) -> String {
        format!(
            "| {} | {} | {} | {} | {:.1} | {:.1} MiB | {} |",
            self.step,
            self.cached,
            self.pages_in_use,
            self.finished,
            self.steps_per_s,
            self.host_rss_mib,
            self.gpu_allocated_mib.map_or("not reported".into(), |m| format!("{m:.1} MiB"))
        )
    }
}

fn rss_mib() -> f64 {
    // Resident pages are the second field of /proc/self/statm.
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|p| p.parse::<f64>().ok()))
        .map_or(f64::NAN, |pages| pages * 4096.0 / (1024.0 * 1024.0))
}

/// The soak's checks and report, whatever decodes: a window every `--check-every` steps.
struct Checker<'a> {
    rt: &'a Runtime,
    json: bool,
    cfg: PoolConfig,
    /// The rings whose order an eviction may change (not checked).
    compacted: HashSet<usize>,
    windows: Vec<Window>,
    window_start: u64,
    t0: std::time::Instant,
}

impl<'a> Checker<'a> {
    fn new(rt: &'a Runtime, json: bool, cfg: PoolConfig, compacted: HashSet<usize>) -> Self {
        if !json {
            println!("| step | cached | pages in use | finished | steps/s | host RSS | GPU allocated |");
            println!("|---|---|---|---|---|---|---|");
        }
        Checker { rt, json, cfg, compacted, windows: Vec::new(), window_start: 0, t0: std::time::Instant::now() }
    }

    /// The pool as `snap` read it after `step` steps, `finished` sequences done: its invariants
    /// (every token `appended` says was appended, where it knows), one window reported.
    fn window(&mut self, step: u64, snap: &PoolSnapshot, appended: &dyn Fn(TokenId) -> bool, finished: u64) -> Result<()> {
        let cached = snap
            .check_invariants(&self.cfg, appended, &self.compacted)
            .map_err(|e| anyhow::anyhow!("step {step}: the pool's invariants broke: {e}"))?;
        let secs = self.t0.elapsed().as_secs_f64();
        let w = Window {
            step: step as u32,
            cached,
            pages_in_use: self.cfg.pages_in_use(&snap.ctl),
            finished,
            steps_per_s: (step - self.window_start) as f64 / secs.max(1e-9),
            host_rss_mib: rss_mib(),
            gpu_allocated_mib: self.rt.device.generate_allocator_report().map(|r| r.total_allocated_bytes as f64 / (1024.0 * 1024.0)),
        };
        if self.json {
            println!("{}", serde_json::to_string(&w)?);
        } else {
            println!("{}", w.row());
        }
        self.windows.push(w);
        (self.window_start, self.t0) = (step, std::time::Instant::now());
        Ok(())
    }

    /// The soak's last line: `what` held, and how memory and speed moved from the first window
    /// to the last.
    fn summary(&self, what: &str) -> Result<()> {
        let (Some(first), Some(last)) = (self.windows.first(), self.windows.last()) else { bail!("the soak checked nothing") };
        let summary = format!(
            "soak: {what}; {} checks; host RSS {:.1} -> {:.1} MiB; steps/s {:.1} -> {:.1}",
            self.windows.len(),
            first.host_rss_mib,
            last.host_rss_mib,
            first.steps_per_s,
            last.steps_per_s
        );
        if self.json {
            println!("{}", serde_json::json!({ "summary": summary }));
        } else {
            println!("{summary}");
        }
        Ok(())
    }
}

pub fn run(gpu: &GpuArgs, a: &SoakArgs) -> Result<()> {
    let (min_len, max_len) = match a.lengths.split_once(':').map(|(x, y)| (x.trim().parse::<u32>(), y.trim().parse::<u32>())) {
        Some((Ok(x), Ok(y))) if 1 <= x && x <= y => (x, y),
        _ => bail!("--lengths: expected MIN:MAX with 1 <= MIN <= MAX, got `{}`", a.lengths),
    };
    if a.steps == 0 || a.check_every == 0 || a.seqs == 0 || a.layers == 0 || a.kv_heads == 0 {
        bail!("--steps, --check-every, --seqs, --layers and --kv-heads must be at least 1");
    }
    match &a.model {
        Some(model) => {
            if max_len < 4 {
                bail!("--lengths: a model soak needs sequences of at least 4 tokens");
            }
            model::run(gpu, a, model, (min_len, max_len))
        }
        None => pool::run(gpu, a, (min_len, max_len)),
    }
}
