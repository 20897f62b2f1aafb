//! `expertkv plan`: measure the adapter's rooflines, predict each candidate configuration's
//! attention time per decode step (roofline and PiKV's model), optionally measure it, and pick
//! the configuration that meets a latency or memory target.

use anyhow::{Context, Result, bail};
use clap::Args;
use expertkv_core::bench::measure_roofline;
use expertkv_core::config::Codec;
use expertkv_core::evict::config::SchedulerConfig;
use expertkv_core::pipeline::{DemoConfig, Pipeline};
use expertkv_core::plan::{Candidate, Target, attention_load, choose, pikv_buffer_size, predict};

use crate::{GpuArgs, fmt_bytes};

#[derive(Args)]
pub struct PlanArgs {
    /// Latency target: predicted attention time per decode step (all layers), milliseconds.
    #[arg(long)]
    target_ms: Option<f64>,
    /// Memory target: K/V bytes attention reads per step, MiB.
    #[arg(long)]
    target_mib: Option<f64>,
    /// Codecs to weigh (each runs with the whole context).
    #[arg(long, value_delimiter = ',', default_value = "none,int8,int4")]
    codecs: Vec<String>,
    /// Budgets to weigh for the uncompressed cache (with --scheduler).
    #[arg(long, value_delimiter = ',', default_value = "100%,50%,25%,10%")]
    budgets: Vec<String>,
    /// Scheduler for budgets under 100%.
    #[arg(long, default_value = "h2o")]
    scheduler: String,
    /// Also run every candidate for --steps decode steps and print its measured attention time.
    #[arg(long)]
    measure: bool,
    #[arg(long, default_value_t = 4)]
    steps: u32,
    /// With --measure: also time the chosen configuration at these page sizes (PiKV's buffer rule).
    #[arg(long, value_delimiter = ',')]
    page_sizes: Vec<u32>,
    /// Small rooflines (CPU adapters, CI).
    #[arg(long)]
    quick: bool,
    #[arg(long, default_value_t = 4)]
    seqs: u32,
    #[arg(long, default_value_t = 2)]
    layers: u32,
    #[arg(long, default_value_t = 1024)]
    prompt: u32,
    #[arg(long, default_value_t = 64)]
    head_dim: u32,
    #[arg(long, default_value_t = 4)]
    kv_heads: u32,
    /// Query heads per KV head.
    #[arg(long, default_value_t = 4)]
    group: u32,
    #[arg(long, default_value_t = 16)]
    page_size: u32,
}

fn base(a: &PlanArgs) -> DemoConfig {
    let mut cfg = DemoConfig { steps: a.steps, verify: false, reference_attention: false, page_size: a.page_size, ..Default::default() };
    cfg.workload.n_seqs = a.seqs;
    cfg.workload.layers = a.layers;
    cfg.workload.prompt_len = a.prompt;
    cfg.workload.head_dim = a.head_dim;
    cfg.workload.kv_heads = a.kv_heads;
    cfg.workload.group = a.group;
    cfg
}

/// Median attention time (gather + attend, GPU timestamps) over the decode steps.
fn measure(rt: &expertkv_core::Runtime, cfg: &DemoConfig) -> Result<f64> {
    let mut p = pollster::block_on(Pipeline::new(rt, cfg.clone())).context("building the pipeline")?;
    pollster::block_on(p.prefill(rt, &mut |_, _| {})).context("prefill")?;
    let mut ms = Vec::new();
    for _ in 0..cfg.steps {
        let r = pollster::block_on(p.step(rt)).context("decode step")?;
        if let Some(g) = r.gpu {
            ms.push(g.gather_ms + g.attend_ms);
        }
    }
    if ms.is_empty() {
        bail!("this adapter has no GPU timestamps: nothing to measure");
    }
    Ok(expertkv_core::runtime::timer::median(&ms))
}

pub fn run(gpu: &GpuArgs, a: &PlanArgs) -> Result<()> {
    let positive = |t: f64| t.is_finite() && t > 0.0;
    if a.target_ms.is_some_and(|t| !positive(t)) || a.target_mib.is_some_and(|t| !positive(t)) {
        bail!("--target-ms and --target-mib must be positive");
    }
    let sched = SchedulerConfig::parse(&a.scheduler)?;
    let codecs: Vec<Codec> = a.codecs.iter().map(|c| Codec::parse(c)).collect::<Result<_, _>>()?;
    let mut configs = Vec::new();
    for codec in &codecs {
        if *codec != Codec::None {
            configs.push(DemoConfig { codec: *codec, scheduler: None, budget: "100%".into(), ..base(a) });
            continue;
        }
        for b in &a.budgets {
            let full = b.trim() == "100%";
            configs.push(DemoConfig { scheduler: (!full).then(|| sched.clone()), budget: b.clone(), ..base(a) });
        }
    }
    let rt = gpu.runtime()?;
    let roof = pollster::block_on(measure_roofline(&rt, a.quick)).context("measuring the rooflines")?;
    println!(
        "adapter: {} ({:?}); measured: copy {:.1} GB/s, f32 FMA {:.1} GFLOP/s",
        rt.info.name, rt.info.backend, roof.bandwidth_gbps, roof.compute_gflops
    );
    let w = &configs.first().context("no candidate: give --codecs and --budgets")?.workload;
    println!(
        "workload: {} sequences x {} layers, {} KV heads x {} query heads each, head_dim {}, context {} tokens",
        w.n_seqs,
        w.layers,
        w.kv_heads,
        w.group,
        w.head_dim,
        w.prompt_len + a.steps
    );
    let mut cands = Vec::new();
    let mut measured = Vec::new();
    for cfg in &configs {
        let load = attention_load(cfg).with_context(|| format!("{} at {}", cfg.codec.spec(), cfg.budget))?;
        cands.push(Candidate { codec: cfg.codec, budget: cfg.budget.clone(), load, prediction: predict(&load, &roof, cfg.workload.group) });
        measured.push(if a.measure { Some(measure(&rt, cfg)?) } else { None });
    }
    println!(
        "| codec | budget | kept tokens / list | KV read / step | rho | memory ms | compute ms | roofline ms | PiKV model ms | measured ms | measured / roofline |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (c, m) in cands.iter().zip(&measured) {
        let p = &c.prediction;
        println!(
            "| {} | {} | {:.0} | {} | {:.2} | {:.4} | {:.4} | {:.4} | {:.4} | {} | {} |",
            c.codec.spec(),
            c.budget,
            c.load.kept_tokens,
            fmt_bytes(c.load.kv_bytes_read),
            c.load.rho(),
            p.memory_ms,
            p.compute_ms,
            p.roofline_ms,
            p.pikv_ms,
            m.map_or("-".into(), |m| format!("{m:.4}")),
            m.map_or("-".into(), |m| format!("{:.2}", m / p.roofline_ms))
        );
    }
    let target = Target { step_ms: a.target_ms, kv_bytes: a.target_mib.map(|m| (m * 1048576.0) as u64) };
    let Some(best) = choose(&cands, target) else {
        bail!("no candidate meets the target (predicted); relax it or add smaller budgets or codecs");
    };
    let i = cands.iter().position(|c| std::ptr::eq(c, best)).unwrap_or(0);
    let chosen = &configs[i];
    println!(
        "plan: codec {} at budget {} (predicted {:.4} ms, {} read per step){}",
        best.codec.spec(),
        best.budget,
        best.prediction.roofline_ms,
        fmt_bytes(best.load.kv_bytes_read),
        if target.step_ms.is_none() && target.kv_bytes.is_none() { " — no target given: the most faithful candidate" } else { "" }
    );
    println!(
        "run it: expertkv demo --seqs {} --layers {} --prompt {} --head-dim {} --kv-heads {} --group {} --page-size {} --scheduler {} --budget {} --codec {}",
        a.seqs,
        a.layers,
        a.prompt,
        a.head_dim,
        a.kv_heads,
        a.group,
        a.page_size,
        chosen.scheduler.as_ref().map_or("none".to_string(), |s| s.name().to_string()),
        chosen.budget,
        chosen.codec.spec()
    );
    // PiKV's buffer rule for the chosen configuration.
    let context = u64::from(a.prompt + a.steps);
    let kept_pages = (best.load.kept_tokens / f64::from(a.page_size)).ceil() as u64;
    println!(
        "PiKV buffer rule: S* = sqrt(L / (K G)) = sqrt({context} / ({kept_pages} x 1)) = {:.1} tokens per page (this run: {})",
        pikv_buffer_size(context, kept_pages, 1),
        a.page_size
    );
    if a.measure {
        for &ps in &a.page_sizes {
            let cfg = DemoConfig { page_size: ps, ..chosen.clone() };
            let kp = (best.load.kept_tokens / f64::from(ps)).ceil() as u64;
            match measure(&rt, &cfg) {
                Ok(ms) => println!(
                    "  page size {ps:>3}: measured attention {ms:.4} ms per step (S* at this page size: {:.1})",
                    pikv_buffer_size(context, kp, 1)
                ),
                Err(e) => println!("  page size {ps:>3}: {e:#}"),
            }
        }
    }
    Ok(())
}
