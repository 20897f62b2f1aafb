use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use expertkv_core::attend::{AttendOptions, SplitVariant};
use expertkv_core::bench::{AttendShape, BenchRecord, UploadPath, bench_attend, copy_roofline, gbps};
use expertkv_core::config::{Codec, KvDtype};
use expertkv_core::route::config::RouterConfig;
use expertkv_core::runtime::Runtime;
use indicatif::{ProgressBar, ProgressStyle};

use crate::{GpuArgs, fmt_bytes};

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Which {
    /// The copy roofline alone.
    Copy,
    /// Host-to-GPU bandwidth, beside the copy roofline: through the queue's `write_buffer`, and
    /// as a copy from a host-memory buffer (what an expert cache's fetch moves at); then whether
    /// such a copy runs beside a compute dispatch submitted with it (what a prefetch can hide).
    Upload,
    /// Decode attention over the paged pool.
    Attend,
    /// The routers' expert selection (bias + top-k).
    Route,
    /// Decode attention with the pool's shards on several devices (`--devices N`) against one.
    Devices,
    /// Every headline in one process: copy, attention (f16, int8, int4) at four shapes, routing,
    /// the decode step, the model's decode speed; rounds in a shuffled order, PyTorch
    /// interleaved with `--torch` (see `bench suite --help` and BENCHMARKS.md).
    Suite,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Variant {
    Auto,
    Tiled,
    Subgroup,
}

#[derive(Args)]
pub struct BenchArgs {
    #[arg(value_enum)]
    which: Which,
    /// Small shapes and few repetitions (CI, CPU adapters).
    #[arg(long)]
    quick: bool,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
    /// Attention shape: batch (default: 8 and 1, the two reference shapes).
    #[arg(long)]
    batch: Option<u32>,
    /// Attention shape: cached tokens per sequence.
    #[arg(long)]
    tokens: Option<u32>,
    #[arg(long, default_value_t = 32)]
    q_heads: u32,
    #[arg(long, default_value_t = 8)]
    kv_heads: u32,
    #[arg(long, default_value_t = 128)]
    head_dim: u32,
    #[arg(long, default_value = "f16")]
    dtype: String,
    #[arg(long, default_value_t = 16)]
    page_size: u32,
    /// Pages per split chunk of the attention kernel.
    #[arg(long, default_value_t = 32)]
    chunk_pages: u32,
    /// Fill the pool position by position, N positions of every sequence per append, as a
    /// decode pipeline's prefill does (0: sequence by sequence, each list's pages nearly
    /// contiguous).
    #[arg(long, default_value_t = 0)]
    interleave: u32,
    #[arg(long, value_enum, default_value = "auto")]
    variant: Variant,
    /// Subgroup kernel: invocations per token (16 or 8; default: the widest the device allows).
    #[arg(long)]
    lanes: Option<u32>,
    /// Subgroup kernel: tokens in flight per token group (1..=8).
    #[arg(long, default_value_t = 4)]
    tokens_in_flight: u32,
    /// Subgroup kernel: reduce every head's score in every lane instead of reduce-scattering.
    #[arg(long)]
    no_transpose: bool,
    /// Tile kernel: how far a score may rise above its head's reference maximum before the
    /// sums are rescaled (natural-log units, at most 2; 0 or below: whenever it rises).
    #[arg(long, default_value_t = expertkv_core::attend::RESCALE_SLACK, allow_negative_numbers = true)]
    rescale_slack: f32,
    /// Which kernel reads int4 pages: auto (the tile kernel where the device and shape allow
    /// it), slot (the slot-block kernel), tile, or coop (the tensor cores, through wgpu's
    /// experimental cooperative matrices).
    #[arg(long, default_value = "auto")]
    quant_kernel: String,
    /// Tile kernel: tiles between moves of its f16 value sums into f32.
    #[arg(long, default_value_t = expertkv_core::attend::F16_FLUSH_TILES)]
    f16_flush: u32,
    /// Tile kernel: invocations per workgroup (32, 64 or 128; 0: the default).
    #[arg(long, default_value_t = 0)]
    tile_wg: u32,
    /// Timed repetitions (median reported).
    #[arg(long)]
    reps: Option<u32>,
    /// Also run PyTorch SDPA on the same shapes (bench/torch_baseline.py, python3 with torch)
    /// and report the ratio.
    #[arg(long)]
    torch: bool,
    /// Attention: page codecs to compare, comma-separated (none, int8, int4, fastv-dims,
    /// low-rank[:rank=R], lora[:rank=R]); `none` is the baseline the others are compared with.
    #[arg(long, value_delimiter = ',', default_value = "none")]
    codecs: Vec<String>,
    /// Devices: how many (the adapters `--adapter` allows, one device each, opened again in
    /// turn when there are fewer adapters).
    #[arg(long, default_value_t = 2)]
    devices: u32,
    /// Routing: tokens per call.
    #[arg(long, default_value_t = 65536)]
    route_tokens: u32,
    /// Routing: experts.
    #[arg(long, default_value_t = 256)]
    experts: u32,
    /// Routing: experts per token.
    #[arg(long, default_value_t = 8)]
    top_k: u32,
    /// Routing: routers to time (name or name:key=value,...; default all seven).
    #[arg(long)]
    router: Vec<String>,
    /// Path of the PyTorch baseline script.
    #[arg(long, default_value = "bench/torch_baseline.py")]
    torch_script: String,
    /// Suite: the PyTorch decode-step script.
    #[arg(long, default_value = "bench/torch_pikv_step.py")]
    torch_step_script: String,
    /// Suite: seed of the configurations' order in each round [default: from the clock, printed].
    #[arg(long)]
    seed: Option<u64>,
    /// Suite: rounds, each measuring every configuration once [default: 5, 2 with --quick].
    #[arg(long)]
    rounds: Option<u32>,
    /// Suite: stop starting new rounds once another would end past this many minutes (the
    /// report covers the rounds done; at least one round always runs).
    #[arg(long)]
    max_minutes: Option<f64>,
    /// Suite: the model whose decode speed it measures (skipped when missing or with --quick).
    #[arg(long, default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: std::path::PathBuf,
}

fn record(
    rt: &Runtime,
    kernel: &str,
    shape: String,
    m: &expertkv_core::bench::Measurement,
    bytes: u64,
    copy_gbps: f64,
    variant: String,
) -> BenchRecord {
    let g = gbps(bytes, m.median_ms);
    BenchRecord {
        kernel: kernel.into(),
        shape,
        median_ms: m.median_ms,
        min_ms: m.min_ms,
        bytes,
        gbps: g,
        copy_gbps,
        ratio_to_copy: g / copy_gbps,
        adapter: rt.info.name.clone(),
        backend: format!("{:?}", rt.info.backend),
        variant,
        shader_checks: rt.checks.name().into(),
        timing: m.timing.into(),
        samples: m.samples,
    }
}

#[derive(serde::Deserialize)]
struct TorchLine {
    median_ms: f64,
    gbps: f64,
    #[serde(default)]
    device: String,
}

fn run_route(rt: &Runtime, a: &BenchArgs, warmup: u32, reps: u32, copy_gbps: f64) -> Result<()> {
    let routers = if a.router.is_empty() {
        RouterConfig::all_defaults()
    } else {
        a.router.iter().map(|s| RouterConfig::parse(s)).collect::<Result<Vec<_>, _>>()?
    };
    let tokens = if a.quick { a.route_tokens.min(4096) } else { a.route_tokens };
    let shape = format!("t{}_e{}_k{}", tokens, a.experts, a.top_k);
    let logit_bytes = u64::from(tokens) * u64::from(a.experts) * 4;
    let torch = if a.torch { Some(run_torch_route(&a.torch_script, tokens, a.experts, a.top_k, reps)?) } else { None };
    for r in routers {
        let m = pollster::block_on(expertkv_core::bench::bench_route(rt, r.clone(), tokens, a.experts, a.top_k, warmup, reps))
            .with_context(|| format!("routing benchmark {}", r.name()))?;
        // The hash router reads only the chosen experts' logits (for the gates).
        let bytes = if matches!(r, RouterConfig::Hash) { u64::from(tokens) * u64::from(a.top_k) * 4 } else { logit_bytes };
        let rec = record(rt, "route", shape.clone(), &m, bytes, copy_gbps, r.name().into());
        let tokens_per_s = f64::from(tokens) / (m.median_ms * 1e-3);
        if a.json {
            let mut v = serde_json::to_value(&rec)?;
            v["router"] = serde_json::to_value(&r)?;
            v["tokens_per_s"] = tokens_per_s.into();
            if let Some(t) = &torch {
                v["torch_ms"] = t.median_ms.into();
                v["speedup_vs_torch"] = (t.median_ms / m.median_ms).into();
            }
            println!("{v}");
        } else {
            let vs = torch
                .as_ref()
                .map(|t| format!("  {:.1}x pytorch topk(softmax) ({:.4} ms)", t.median_ms / m.median_ms, t.median_ms))
                .unwrap_or_default();
            println!(
                "route   {:<22} {:<14} median {:.4} ms  {:>8.1} Mtokens/s  {:>8.1} GB/s of logits  ratio to copy {:.2}{vs}",
                shape,
                r.name(),
                m.median_ms,
                tokens_per_s / 1e6,
                rec.gbps,
                rec.ratio_to_copy
            );
        }
    }
    Ok(())
}

fn run_torch_route(script: &str, tokens: u32, experts: u32, top_k: u32, reps: u32) -> Result<TorchLine> {
    let out = Command::new("python3")
        .arg(script)
        .args(["--json", "--route", "--tokens", &tokens.to_string(), "--experts", &experts.to_string(), "--top-k", &top_k.to_string()])
        .args(["--reps", &reps.to_string()])
        .output()
        .with_context(|| format!("running python3 {script}"))?;
    if !out.status.success() {
        bail!("{script} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.trim_start().starts_with('{')).context("no JSON line from the PyTorch baseline")?;
    Ok(serde_json::from_str(line)?)
}

fn run_torch(script: &str, s: &AttendShape, reps: u32) -> Result<TorchLine> {
    let out = Command::new("python3")
        .arg(script)
        .args(["--json", "--batch", &s.batch.to_string(), "--tokens", &s.tokens.to_string()])
        .args(["--q-heads", &s.q_heads.to_string(), "--kv-heads", &s.kv_heads.to_string(), "--head-dim", &s.head_dim.to_string()])
        .args(["--dtype", s.dtype.name(), "--reps", &reps.to_string()])
        .output()
        .with_context(|| format!("running python3 {script}"))?;
    if !out.status.success() {
        bail!("{script} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.trim_start().starts_with('{')).context("no JSON line from the PyTorch baseline")?;
    Ok(serde_json::from_str(line)?)
}

pub fn run(gpu: &GpuArgs, a: &BenchArgs) -> Result<()> {
    if a.which == Which::Devices {
        let defaults: Vec<(u32, u32)> = if a.quick { vec![(2, 4096), (1, 16384)] } else { vec![(8, 32768), (1, 131072)] };
        let shapes = match (a.batch, a.tokens) {
            (None, None) => defaults,
            (bt, t) => vec![(bt.unwrap_or(1), t.unwrap_or(if a.quick { 4096 } else { 32768 }))],
        };
        let reps = a.reps.unwrap_or(if a.quick { 5 } else { 30 });
        let b = crate::bench_devices::DevicesBench {
            devices: a.devices,
            shapes,
            q_heads: a.q_heads,
            kv_heads: a.kv_heads,
            head_dim: a.head_dim,
            dtype: KvDtype::parse(&a.dtype)?,
            page_size: a.page_size,
            chunk_pages: a.chunk_pages,
            warmup: if a.quick { 1 } else { 3 },
            reps,
            json: a.json,
        };
        return crate::bench_devices::run(gpu, &b);
    }
    let rt = gpu.runtime()?;
    if a.which == Which::Suite {
        let o = crate::suite::SuiteOptions {
            quick: a.quick,
            torch: a.torch,
            json: a.json,
            seed: a.seed,
            rounds: a.rounds,
            max_minutes: a.max_minutes,
            reps: a.reps,
            model: a.model.clone(),
            torch_script: a.torch_script.clone(),
            torch_step_script: a.torch_step_script.clone(),
        };
        crate::suite::run(&rt, &o)?;
        return Ok(());
    }
    let (warmup, reps) = if a.quick { (2, a.reps.unwrap_or(5)) } else { (10, a.reps.unwrap_or(50)) };
    let copy_bytes = if a.quick { 32 << 20 } else { (1u64 << 30).min(rt.max_binding_bytes()) };
    let (ck, cm) = pollster::block_on(copy_roofline(&rt, copy_bytes, warmup, reps)).context("copy roofline")?;
    let copy_gbps = gbps(ck.bytes_moved(), cm.median_ms);
    let copy_rec = record(&rt, "copy", format!("{}", ck.bytes), &cm, ck.bytes_moved(), copy_gbps, "vec4".into());
    if a.json {
        println!("{}", serde_json::to_string(&copy_rec)?);
    } else {
        println!("adapter: {} ({:?}); shader checks {}; timing {}", rt.info.name, rt.info.backend, rt.checks.name(), cm.timing);
        println!(
            "copy    {:>10} moved  median {:.4} ms  {:>8.1} GB/s (read+write)  = roofline",
            fmt_bytes(ck.bytes_moved()),
            cm.median_ms,
            copy_gbps
        );
    }
    drop(ck);
    match a.which {
        Which::Copy | Which::Suite | Which::Devices => return Ok(()),
        Which::Upload => {
            let bytes = if a.quick { 32 << 20 } else { (256u64 << 20).min(rt.max_binding_bytes()) };
            for path in [UploadPath::WriteBuffer, UploadPath::HostCopy] {
                let m = pollster::block_on(expertkv_core::bench::upload_bandwidth(&rt, path, bytes, warmup.min(3), reps.min(20)))
                    .with_context(|| format!("upload bandwidth ({})", path.name()))?;
                let rec = record(&rt, "upload", format!("{bytes}"), &m, bytes, copy_gbps, path.name().into());
                if a.json {
                    println!("{}", serde_json::to_string(&rec)?);
                } else {
                    println!(
                        "upload  {:>10} host-to-GPU  median {:.4} ms  {:>8.1} GB/s  ({}, host clock; the words checked)",
                        fmt_bytes(bytes),
                        m.median_ms,
                        rec.gbps,
                        path.name()
                    );
                }
            }
            let o = pollster::block_on(expertkv_core::bench::copy_compute_overlap(&rt, bytes, warmup.min(3), reps.min(20)))
                .context("a copy beside a compute dispatch")?;
            if a.json {
                let mut v = serde_json::to_value(&o)?;
                v["measure"] = "copy_compute_overlap".into();
                v["hidden"] = o.hidden().into();
                v["adapter"] = rt.info.name.clone().into();
                println!("{v}");
            } else {
                println!(
                    "overlap {:>10} host-to-GPU copy {:.3} ms, {:.1} GFLOP dispatch {:.3} ms; in one submission {:.3} ms (copy first), {:.3} ms (dispatch first), an empty submission {:.3} ms: {:.0}% of the shorter hidden (host clock; the words and sums checked)",
                    fmt_bytes(o.bytes),
                    o.copy_ms,
                    o.flops as f64 / 1e9,
                    o.compute_ms,
                    o.copy_then_compute_ms,
                    o.compute_then_copy_ms,
                    o.empty_ms,
                    100.0 * o.hidden()
                );
            }
            return Ok(());
        }
        Which::Route => return run_route(&rt, a, warmup, reps, copy_gbps),
        Which::Attend => {}
    }
    let dtype = KvDtype::parse(&a.dtype)?;
    let defaults: Vec<(u32, u32)> = if a.quick { vec![(2, 4096), (1, 16384)] } else { vec![(8, 32768), (1, 131072)] };
    let shapes: Vec<AttendShape> = match (a.batch, a.tokens) {
        (None, None) => defaults,
        (b, t) => vec![(b.unwrap_or(1), t.unwrap_or(if a.quick { 4096 } else { 32768 }))],
    }
    .into_iter()
    .map(|(batch, tokens)| AttendShape {
        batch,
        q_heads: a.q_heads,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        tokens,
        dtype,
        page_size: a.page_size,
        codec: Codec::None,
        interleave: a.interleave,
    })
    .collect();
    let codecs: Vec<Codec> = a.codecs.iter().map(|c| Codec::parse(c)).collect::<expertkv_core::error::Result<_>>()?;
    let variant = match a.variant {
        Variant::Auto => None,
        Variant::Tiled => Some(SplitVariant::Tiled),
        Variant::Subgroup => Some(
            expertkv_core::attend::subgroup_layout_with(&rt, a.head_dim, dtype, &a.lanes.map_or(vec![16, 8], |l| vec![l]))
                .context("this adapter or shape cannot run the subgroup kernel with these lanes")?,
        ),
    };
    if a.lanes.is_some() && a.variant != Variant::Subgroup {
        bail!("--lanes applies to --variant subgroup");
    }
    for s0 in &shapes {
        let torch = if a.torch { Some(run_torch(&a.torch_script, s0, reps)?) } else { None };
        let mut baseline_ms: Option<f64> = None;
        for codec in &codecs {
            let s = &AttendShape { codec: *codec, ..s0.clone() };
            let bar = if a.json { ProgressBar::hidden() } else { ProgressBar::new(u64::from(s.batch) * u64::from(s.tokens)) };
            bar.set_style(
                ProgressStyle::with_template("filling {bar:40} {pos}/{len} tokens").unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            let opts = AttendOptions {
                chunk_pages: a.chunk_pages,
                variant,
                tokens_in_flight: a.tokens_in_flight,
                transpose: !a.no_transpose,
                rescale_slack: a.rescale_slack,
                quant_kernel: expertkv_core::attend::QuantKernel::parse(&a.quant_kernel)?,
                f16_flush_tiles: a.f16_flush,
                tile_wg: a.tile_wg,
                ..Default::default()
            };
            let ab = pollster::block_on(bench_attend(&rt, s, opts, warmup, reps, &mut |d, _| bar.set_position(d)))
                .with_context(|| format!("attention benchmark {}", s.label()))?;
            bar.finish_and_clear();
            // GB/s of the bytes the pool holds (and attention reads); rho = f16 bytes / those.
            let rec = record(&rt, "attend_decode", s.label(), &ab.total, ab.resident_bytes, copy_gbps, ab.variant.clone());
            let rho = s0.kv_bytes() as f64 / ab.resident_bytes as f64;
            if *codec == Codec::None {
                baseline_ms = Some(rec.median_ms);
            }
            // The step-time model: bandwidth-bound attention takes t(f16) / rho.
            let predicted = baseline_ms.map(|b| b / rho);
            if a.json {
                let mut v = serde_json::to_value(&rec)?;
                v["split_ms"] = ab.split.median_ms.into();
                v["codec"] = codec.name().into();
                if let Some(c) = &ab.codec_split {
                    v["codec_split_ms"] = c.median_ms.into();
                }
                v["rho"] = rho.into();
                if let Some(p) = predicted {
                    v["predicted_ms"] = p.into();
                }
                if let Some(b) = baseline_ms {
                    v["speedup_vs_f16_pool"] = (b / rec.median_ms).into();
                }
                if let Some(t) = &torch {
                    v["torch_ms"] = t.median_ms.into();
                    v["torch_gbps"] = t.gbps.into();
                    v["torch_device"] = t.device.clone().into();
                    v["ratio_to_torch"] = (rec.gbps / t.gbps).into();
                    v["speedup_vs_torch"] = (t.median_ms / rec.median_ms).into();
                }
                println!("{v}");
            } else {
                println!(
                    "attend  {:<44} {}  median {:.4} ms (split {:.4})  {:>8.1} GB/s resident  ratio to copy {:.2}",
                    rec.shape, rec.variant, rec.median_ms, ab.split.median_ms, rec.gbps, rec.ratio_to_copy
                );
                if *codec != Codec::None {
                    print!("        rho {rho:.2} ({} resident)", fmt_bytes(ab.resident_bytes));
                    if let (Some(b), Some(p)) = (baseline_ms, predicted) {
                        print!(
                            "  {:.2}x the f16 pool; model t(f16)/rho = {p:.4} ms, measured/model {:.2}",
                            b / rec.median_ms,
                            rec.median_ms / p
                        );
                    }
                    println!();
                }
                if let Some(t) = &torch {
                    println!(
                        "        pytorch sdpa f16 ({}) median {:.4} ms  {:>8.1} GB/s  speedup over sdpa {:.2}x",
                        t.device,
                        t.median_ms,
                        t.gbps,
                        t.median_ms / rec.median_ms
                    );
                }
            }
        }
    }
    Ok(())
}
