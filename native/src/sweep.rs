use anyhow::{Context, Result};
use clap::Args;
use expertkv_core::config::Codec;
use expertkv_core::evict::config::{EkvaConfig, SchedulerConfig};
use expertkv_core::pipeline::{DemoConfig, Pipeline};
use expertkv_core::route::config::RouterConfig;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::{GpuArgs, fmt_bytes};

/// Run the pipeline over a grid of routers x schedulers x budgets on the built-in workload and
/// print one table row per combination.
#[derive(Args)]
pub struct SweepArgs {
    /// Schedulers (comma-separated names or name:key=value,... specs, a `key=value` after a comma
    /// belonging to the spec before it; `none` = full cache).
    #[arg(long, value_delimiter = ',', default_value = "h2o,streaming-llm,lru,lru-plus,adakv,duo")]
    schedulers: Vec<String>,
    /// Budgets: tokens per (layer, sequence, KV head) or shares of the context.
    #[arg(long, value_delimiter = ',', default_value = "50%,25%,10%")]
    budgets: Vec<String>,
    /// Codecs (names or specs), crossed with the schedulers (a codec under the evicting ones and
    /// the full cache, not QUEST or FlexGen).
    #[arg(long, value_delimiter = ',', default_value = "none")]
    codecs: Vec<String>,
    /// PyramidKV ratio applied to every evicting scheduler (first layer's budget over the last's).
    #[arg(long)]
    pyramid: Option<f32>,
    /// Budget allocators over every evicting scheduler: none (expert-blind) and/or
    /// ekva[:floor=F,alpha=A,decay=D] (budgets split over expert groups by importance).
    #[arg(long, value_delimiter = ',', default_value = "none")]
    allocators: Vec<String>,
    /// Routers (names or specs).
    #[arg(long, value_delimiter = ',', default_value = "topk")]
    routers: Vec<String>,
    #[arg(long, default_value_t = 8)]
    steps: u32,
    #[arg(long, default_value_t = 512)]
    prompt: u32,
    #[arg(long, default_value_t = 4)]
    seqs: u32,
    #[arg(long, default_value_t = 2)]
    layers: u32,
    #[arg(long, default_value_t = 64)]
    head_dim: u32,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// One JSON object per combination instead of a table.
    #[arg(long)]
    json: bool,
    /// Also draw PNG plots of attention error against bytes and time into this folder.
    #[arg(long, value_name = "DIR")]
    plot: Option<std::path::PathBuf>,
}

#[derive(Serialize)]
struct Row {
    router: String,
    scheduler: String,
    codec: String,
    budget: String,
    attention_error: Option<f64>,
    gpu_ms: f64,
    kv_bytes: u64,
    kv_read_bytes: u64,
    full_kv_bytes: Option<u64>,
    kept_attention: f32,
    miss_rate: f32,
    /// Codecs: f16 bytes of the cached tokens over the bytes resident.
    rho: Option<f64>,
    /// Codecs: bytes per token and KV head of a compressed page (layout formula).
    codec_bytes_per_token: Option<f64>,
    /// Codecs: reconstruction error of the compressed keys and values (rel. L2).
    reconstruction: Option<(f64, f64)>,
}

pub fn run(gpu: &GpuArgs, a: &SweepArgs) -> Result<()> {
    let rt = gpu.runtime()?;
    // clap splits at every comma; put `key=value` parts back on the spec they belong to.
    let specs = |v: &[String]| crate::eval::split_specs(&v.join(","));
    let routers: Vec<RouterConfig> = specs(&a.routers).iter().map(|r| RouterConfig::parse(r)).collect::<Result<_, _>>()?;
    let schedulers: Vec<Option<SchedulerConfig>> = specs(&a.schedulers)
        .iter()
        .map(|s| if s == "none" { Ok(None) } else { SchedulerConfig::parse(s).map(Some) })
        .collect::<Result<_, _>>()?;
    let codecs: Vec<Codec> = specs(&a.codecs).iter().map(|c| Codec::parse(c)).collect::<Result<_, _>>()?;
    let allocators: Vec<Option<EkvaConfig>> = specs(&a.allocators).iter().map(|s| EkvaConfig::parse(s)).collect::<Result<_, _>>()?;
    let mut grid = Vec::new();
    for r in &routers {
        for c in &codecs {
            for s in &schedulers {
                match s {
                    None => grid.push((r.clone(), None, "100%".to_string(), *c, None)),
                    // A codec runs under the evicting schedulers (not QUEST or FlexGen).
                    Some(s) if *c != Codec::None && !s.uses_evict_kernels() => {}
                    Some(s) => {
                        for b in &a.budgets {
                            for al in &allocators {
                                if al.is_none() || s.uses_evict_kernels() {
                                    grid.push((r.clone(), Some(s.clone()), b.clone(), *c, *al));
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    let bar = if a.json { ProgressBar::hidden() } else { ProgressBar::new(grid.len() as u64) };
    bar.set_style(ProgressStyle::with_template("sweep {bar:40} {pos}/{len} {msg}").unwrap_or_else(|_| ProgressStyle::default_bar()));
    let mut rows = Vec::new();
    for (router, sched, budget, codec, allocator) in grid {
        let sched_label = match (&sched, allocator) {
            (None, _) => "none".to_string(),
            (Some(s), None) => s.name().to_string(),
            (Some(s), Some(al)) => format!("{}+{}", s.name(), al.spec()),
        };
        bar.set_message(format!("{} / {sched_label} / {budget} / {}", router.name(), codec.name()));
        let mut cfg = DemoConfig {
            steps: a.steps,
            verify: false,
            router: router.clone(),
            scheduler: sched.clone(),
            budget: budget.clone(),
            pyramid: a.pyramid.filter(|_| sched.as_ref().is_some_and(|s| s.uses_evict_kernels())),
            allocator,
            ..Default::default()
        };
        cfg.workload.seed = a.seed;
        cfg.workload.prompt_len = a.prompt;
        cfg.workload.n_seqs = a.seqs;
        cfg.workload.layers = a.layers;
        cfg.workload.head_dim = a.head_dim;
        cfg.codec = codec;
        let label = format!("{} / {sched_label} / {budget} / {}", router.name(), codec.name());
        let mut p = pollster::block_on(Pipeline::new(&rt, cfg)).with_context(|| format!("building {label}"))?;
        pollster::block_on(p.prefill(&rt, &mut |_, _| {})).with_context(|| format!("prefill of {label}"))?;
        let mut errs = Vec::new();
        let mut times = Vec::new();
        let mut last = None;
        for _ in 0..a.steps {
            let r = pollster::block_on(p.step(&rt)).with_context(|| format!("step of {label}"))?;
            if let Some(e) = r.attention_error {
                errs.push(e);
            }
            if let Some(g) = &r.gpu {
                times.push(g.total_ms());
            }
            last = Some(r);
        }
        let Some(last) = last else { continue };
        // Against the full cache token for token: only where nothing was evicted.
        let reconstruction = if sched.is_none() {
            pollster::block_on(p.reconstruction_error(&rt)).with_context(|| format!("reconstruction of {label}"))?
        } else {
            None
        };
        let pc = &p.kv.pool.cfg;
        let row = Row {
            router: router.name().into(),
            scheduler: sched_label,
            codec: codec.spec(),
            budget,
            attention_error: (!errs.is_empty()).then(|| errs.iter().sum::<f64>() / errs.len() as f64),
            gpu_ms: expertkv_core::runtime::timer::median(&times),
            kv_bytes: last.kv_bytes_resident,
            kv_read_bytes: last.kv_bytes_attended,
            full_kv_bytes: last.full_kv_bytes,
            kept_attention: last.kept_attention,
            miss_rate: last.miss_rate,
            rho: (codec != Codec::None).then(|| last.kv_bytes_tokens as f64 / last.kv_bytes_resident as f64),
            codec_bytes_per_token: (codec != Codec::None).then(|| pc.codec_page_bytes() as f64 / f64::from(pc.page_size)),
            reconstruction,
        };
        if a.json {
            println!("{}", serde_json::to_string(&row)?);
        }
        rows.push(row);
        bar.inc(1);
    }
    bar.finish_and_clear();
    if !a.json {
        println!(
            "adapter: {} ({:?}); {} steps after a {}-token prompt, {} sequences x {} layers",
            rt.info.name, rt.info.backend, a.steps, a.prompt, a.seqs, a.layers
        );
        println!(
            "| router | scheduler | budget | codec | attention error (rel. L2) | GPU ms / step | KV resident | KV read / step | full KV | kept attention | routing miss |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
        for r in &rows {
            println!(
                "| {} | {} | {} | {} | {} | {:.3} | {} | {} | {} | {:.1}% | {:.1}% |",
                r.router,
                r.scheduler,
                r.budget,
                r.codec,
                r.attention_error.map(|e| format!("{e:.2e}")).unwrap_or_else(|| "0 (full)".into()),
                r.gpu_ms,
                fmt_bytes(r.kv_bytes),
                fmt_bytes(r.kv_read_bytes),
                r.full_kv_bytes.map(fmt_bytes).unwrap_or_else(|| fmt_bytes(r.kv_bytes)),
                100.0 * r.kept_attention,
                100.0 * r.miss_rate
            );
        }
        if let Some(dir) = &a.plot {
            let points: Vec<crate::plot::Point> = rows
                .iter()
                .map(|r| crate::plot::Point {
                    label: if r.codec == "none" { format!("{} {}", r.scheduler, r.budget) } else { r.codec.clone() },
                    series: if r.codec == "none" { r.scheduler.clone() } else { r.codec.split(':').next().unwrap_or("codec").to_string() },
                    kv_bytes: r.kv_bytes as f64,
                    gpu_ms: r.gpu_ms,
                    error: r.attention_error.unwrap_or(0.0),
                })
                .collect();
            let title = format!("{} steps after a {}-token prompt, {} sequences x {} layers", a.steps, a.prompt, a.seqs, a.layers);
            for path in crate::plot::write(dir, &title, &points)? {
                println!("plot: {}", path.display());
            }
        }
        if rows.iter().any(|r| r.rho.is_some()) {
            println!();
            println!(
                "| codec | rho (f16 bytes / resident) | bytes per token and head (f16: {}) | reconstruction error K / V | attention error |",
                2 * 2 * a.head_dim
            );
            println!("|---|---|---|---|---|");
            for r in rows.iter().filter(|r| r.rho.is_some()) {
                println!(
                    "| {} | {:.2} | {:.0} | {} | {} |",
                    r.codec,
                    r.rho.unwrap_or(0.0),
                    r.codec_bytes_per_token.unwrap_or(0.0),
                    r.reconstruction.map(|(k, v)| format!("{k:.2e} / {v:.2e}")).unwrap_or_else(|| "-".into()),
                    r.attention_error.map(|e| format!("{e:.2e}")).unwrap_or_else(|| "-".into())
                );
            }
        }
    }
    Ok(())
}
