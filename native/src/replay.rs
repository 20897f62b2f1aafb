//! `expertkv record` and `expertkv replay`: decode traces (format: `expertkv_core::trace`).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use expertkv_core::pipeline::Pipeline;
use expertkv_core::trace::{first_difference, read_trace, read_trace_partial};

use crate::{GpuArgs, demo, fmt_bytes};

#[derive(Args)]
pub struct RecordArgs {
    /// Where the trace goes.
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
    #[command(flatten)]
    demo: demo::DemoArgs,
}

pub fn record(gpu: &GpuArgs, a: &RecordArgs) -> Result<()> {
    if a.demo.trace.is_some() {
        bail!("record writes the trace to --out; drop --trace");
    }
    let mut d = a.demo.clone();
    d.trace = Some(a.out.clone());
    demo::run(gpu, &d)
}

#[derive(Args)]
pub struct ReplayArgs {
    /// A trace written by `expertkv record` (or `demo --trace`).
    file: PathBuf,
    /// Print the trace's per-step totals without running anything.
    #[arg(long)]
    summary: bool,
    /// Read a trace whose run stopped early (an error, a lost device, a killed process): its
    /// whole steps, replayed or summarised as a shorter run.
    #[arg(long)]
    partial: bool,
}

pub fn run(gpu: &GpuArgs, a: &ReplayArgs) -> Result<()> {
    let f = std::fs::File::open(&a.file).with_context(|| format!("opening {}", a.file.display()))?;
    let reader = std::io::BufReader::new(f);
    let trace = if a.partial {
        let (t, promised) = read_trace_partial(reader).with_context(|| format!("reading {}", a.file.display()))?;
        if let Some(p) = promised {
            let n = t.header.steps;
            println!(
                "note: the run stopped early: the trace holds {n} whole step{} of its {p}; replaying those",
                if n == 1 { "" } else { "s" }
            );
        }
        t
    } else {
        read_trace(reader).with_context(|| format!("reading {}", a.file.display()))?
    };
    let cfg = trace.header.config.clone();
    let w = &cfg.workload;
    println!(
        "trace {}: version {}, {} steps x {} layers; {} sequences, prompt {}, router {}, scheduler {}, codec {}",
        a.file.display(),
        trace.header.version,
        trace.header.steps,
        w.layers,
        w.n_seqs,
        w.prompt_len,
        cfg.router.name(),
        cfg.scheduler.as_ref().map_or("none", |s| s.name()),
        cfg.codec.spec()
    );
    if a.summary {
        println!(
            "{:>4} {:>10} {:>12} {:>10} {:>10} {:>10} {:>10} {:>12}",
            "step", "pages read", "bytes read", "in use", "evicted", "moved", "freed", "bytes moved"
        );
        for s in 0..trace.header.steps {
            let r = trace.step(s);
            let sum = |f: fn(&expertkv_core::trace::LayerRecord) -> u64| r.iter().map(f).sum::<u64>();
            println!(
                "{:>4} {:>10} {:>12} {:>10} {:>10} {:>10} {:>10} {:>12}",
                s,
                sum(|x| x.pages_read),
                fmt_bytes(sum(|x| x.bytes_read)),
                sum(|x| x.pages_in_use),
                sum(|x| x.tokens_evicted),
                sum(|x| x.slots_moved),
                sum(|x| x.pages_freed),
                fmt_bytes(sum(|x| x.bytes_moved))
            );
        }
        return Ok(());
    }
    let rt = gpu.runtime()?;
    let mut p = pollster::block_on(Pipeline::new(&rt, cfg.clone())).context("building the recorded pipeline")?;
    pollster::block_on(p.prefill(&rt, &mut |_, _| {})).context("prefill")?;
    for s in 0..trace.header.steps {
        pollster::block_on(p.step(&rt)).with_context(|| format!("step {s}"))?;
        let got = pollster::block_on(p.trace_records(&rt)).context("trace records")?;
        for (want, got) in trace.step(s).iter().zip(&got) {
            if let Some(d) = first_difference(want, got) {
                bail!(
                    "replay departs from the trace at step {s}, layer {}: {d}. The pipeline is deterministic on one adapter and \
                     driver; across devices, float differences can move ties in routing and eviction",
                    want.layer
                );
            }
        }
    }
    println!("replay on {}: all {} steps x {} layers match the trace", rt.info.name, trace.header.steps, w.layers);
    Ok(())
}
