use anyhow::{Context, Result};
use clap::Args;
use expertkv_core::config::{KvDtype, ShardMap};
use expertkv_core::pipeline::{DemoConfig, Pipeline};
use expertkv_core::workload::WorkloadConfig;
use indicatif::{ProgressBar, ProgressStyle};

use crate::{GpuArgs, check_positive, fmt_bytes};

#[derive(Args)]
pub struct DemoArgs {
    /// Decode steps to run after the prompt.
    #[arg(long, default_value_t = 16)]
    steps: u32,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 4)]
    seqs: u32,
    #[arg(long, default_value_t = 2)]
    layers: u32,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 1024)]
    prompt: u32,
    #[arg(long, default_value_t = 4)]
    kv_heads: u32,
    /// Query heads per KV head.
    #[arg(long, default_value_t = 4)]
    group: u32,
    #[arg(long, default_value_t = 64)]
    head_dim: u32,
    #[arg(long, default_value_t = 16)]
    experts: u32,
    #[arg(long, default_value_t = 2)]
    top_k: u32,
    /// K/V storage: f16 or f32.
    #[arg(long, default_value = "f16")]
    dtype: String,
    /// Slots per page.
    #[arg(long, default_value_t = 16)]
    page_size: u32,
    /// Shards per (layer, sequence), a power of two.
    #[arg(long, default_value_t = 4)]
    shards: u32,
    /// Shard map: pikv, expert, token-block.
    #[arg(long, default_value = "pikv")]
    shard_map: String,
    /// Pages in the pool (default: enough for prompt and steps).
    #[arg(long)]
    pages: Option<u32>,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Skip the CPU reference kept in lockstep (faster on large runs).
    #[arg(long)]
    no_verify: bool,
    /// One JSON object per step (and a final summary) instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(gpu: &GpuArgs, a: &DemoArgs) -> Result<()> {
    for (n, v) in [
        ("steps", a.steps),
        ("seqs", a.seqs),
        ("layers", a.layers),
        ("prompt", a.prompt),
        ("page-size", a.page_size),
    ] {
        check_positive(n, v)?;
    }
    let dtype = KvDtype::parse(&a.dtype)?;
    let shard_map = ShardMap::parse(&a.shard_map, a.shards)?;
    let cfg = DemoConfig {
        workload: WorkloadConfig {
            seed: a.seed,
            n_seqs: a.seqs,
            layers: a.layers,
            kv_heads: a.kv_heads,
            group: a.group,
            head_dim: a.head_dim,
            n_experts: a.experts,
            top_k: a.top_k,
            prompt_len: a.prompt,
            ..Default::default()
        },
        steps: a.steps,
        page_size: a.page_size,
        dtype,
        n_shards: a.shards,
        shard_map,
        pool_pages: a.pages,
        chunk_pages: 8,
        verify: !a.no_verify,
    };
    let pool_cfg = cfg.pool_config();
    pool_cfg.validate()?;
    let rt = gpu.runtime()?;
    let mut p =
        pollster::block_on(Pipeline::new(&rt, cfg.clone())).context("building the pipeline")?;
    if !a.json {
        println!(
            "expertkv demo: {} sequences x {} layers, prompt {} tokens, {} decode steps; {} pages of {} slots, {} shards ({} map), top-{} of {} experts",
            a.seqs,
            a.layers,
            a.prompt,
            a.steps,
            dtype.name(),
            a.page_size,
            a.shards,
            shard_map.name(),
            a.top_k,
            a.experts
        );
        println!(
            "adapter: {} ({:?}, {:?}); tier {}; attention {}; shader checks {}",
            rt.info.name,
            rt.info.backend,
            rt.info.device_type,
            rt.tier.name(),
            p.attn.variant.name(),
            rt.checks.name()
        );
        println!(
            "pool: {} pages x {} = {} of K/V in {} buffer(s), {} of metadata",
            pool_cfg.n_pages,
            fmt_bytes(pool_cfg.page_bytes()),
            fmt_bytes(p.pool.kv_bytes_allocated()),
            p.pool.n_buffers(),
            fmt_bytes(p.pool.meta_bytes_allocated())
        );
    }
    let total = u64::from(a.seqs) * u64::from(a.layers) * u64::from(a.prompt);
    let bar = if a.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total)
    };
    bar.set_style(
        ProgressStyle::with_template("prefill {bar:40} {pos}/{len} tokens {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let t0 = std::time::Instant::now();
    pollster::block_on(p.prefill(&rt, &mut |done, _| bar.set_position(done))).context("prefill")?;
    bar.finish_and_clear();
    if !a.json {
        println!(
            "prefill: {total} tokens appended in {:.2} s",
            t0.elapsed().as_secs_f64()
        );
        println!(
            "{:>4} {:>6} {:>9} {:>9} {:>9} {:>10} {:>9}  {:<24} {:>11}  shard pages",
            "step",
            "ctx",
            "append",
            "gather",
            "attend",
            "gpu total",
            "host",
            "KV resident (fill)",
            "pages"
        );
    }
    let mut gpu_totals = Vec::new();
    for _ in 0..a.steps {
        let r = pollster::block_on(p.step(&rt)).context("decode step")?;
        if a.json {
            println!("{}", serde_json::to_string(&r)?);
            continue;
        }
        let (ap, ga, at, tot) = match &r.gpu {
            Some(g) => {
                let t = g.append_ms + g.gather_ms + g.attend_ms;
                gpu_totals.push(t);
                (
                    format!("{:.3}ms", g.append_ms),
                    format!("{:.3}ms", g.gather_ms),
                    format!("{:.3}ms", g.attend_ms),
                    format!("{t:.3}ms"),
                )
            }
            None => ("-".into(), "-".into(), "-".into(), "-".into()),
        };
        let fill = 100.0 * r.kv_bytes_tokens as f64 / r.kv_bytes_resident.max(1) as f64;
        println!(
            "{:>4} {:>6} {:>9} {:>9} {:>9} {:>10} {:>7.2}ms  {:<24} {:>11}  {:?}",
            r.step,
            r.context,
            ap,
            ga,
            at,
            tot,
            r.host_ms,
            format!("{} ({fill:.1}%)", fmt_bytes(r.kv_bytes_resident)),
            format!("{}/{}", r.pages_in_use, r.pages_total),
            r.shard_pages
        );
    }
    let v = pollster::block_on(p.verify(&rt)).context("verification")?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string(&serde_json::json!({"verify": &v, "config": cfg}))?
        );
    } else {
        if !gpu_totals.is_empty() {
            println!(
                "median GPU time per step: {:.3} ms",
                expertkv_core::timer::median(&gpu_totals)
            );
        }
        match &v {
            Some(v) => println!(
                "check: GPU pool identical to the CPU reference ({} cached tokens); attention max |err| {:.1e} vs f64 reference (tolerance {:.0e})",
                v.tokens_checked, v.attention_max_abs_err, v.attention_tolerance
            ),
            None => println!("check: skipped (--no-verify)"),
        }
    }
    if let Some(v) = v
        && v.attention_max_abs_err > v.attention_tolerance
    {
        anyhow::bail!(
            "attention differs from the f64 reference by {:.2e} (tolerance {:.0e})",
            v.attention_max_abs_err,
            v.attention_tolerance
        );
    }
    Ok(())
}
