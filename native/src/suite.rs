//! `expertkv bench suite`: every headline in one command and one process. The configurations
//! (copy roofline; f16, int8 and int4 attention at four shapes; routing; the full decode step;
//! the model's decode speed; and, with `--torch`, PyTorch on each of them) are measured once per
//! round, in an order shuffled with a printed seed, each attention pool and pipeline allocated
//! and filled afresh every time. A line reports the median over rounds of each round's median,
//! the fastest round, and the spread (slowest - fastest) / median; a line whose spread is above
//! 5% says it is unstable. Every ratio to PyTorch is taken against PyTorch measured in the same
//! call, interleaved with the rest.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
use expertkv_core::attend::AttendOptions;
use expertkv_core::bench::{AttendShape, bench_attend, bench_route, copy_roofline, gbps};
use expertkv_core::config::{Codec, KvDtype};
use expertkv_core::evict::config::SchedulerConfig;
use expertkv_core::pipeline::{DemoConfig, Pipeline};
use expertkv_core::rng::Rng;
use expertkv_core::route::config::RouterConfig;
use expertkv_core::runtime::Runtime;
use expertkv_core::workload::WorkloadConfig;

/// Spread above which a line is marked unstable.
pub const UNSTABLE_SPREAD: f64 = 0.05;

/// What `bench suite` is told (a subset of `bench`'s arguments, see `crate::bench::BenchArgs`).
pub struct SuiteOptions {
    pub quick: bool,
    pub torch: bool,
    pub json: bool,
    pub seed: Option<u64>,
    pub rounds: Option<u32>,
    /// Start no round that would end (at the mean round's length) past this many minutes.
    pub max_minutes: Option<f64>,
    pub reps: Option<u32>,
    pub model: PathBuf,
    pub torch_script: String,
    pub torch_step_script: String,
}

/// One decode-step configuration of the suite.
#[derive(Clone, Debug)]
struct StepCase {
    experts: u32,
    top_k: u32,
    /// `None`: the full cache; `Some`: H2O keeping this share of the context.
    budget: Option<&'static str>,
    codec: Codec,
}

impl StepCase {
    fn label(&self) -> String {
        let what = match (self.budget, self.codec) {
            (Some(b), _) => format!("h2o {b}"),
            (None, Codec::None) => "full cache f16".into(),
            (None, c) => format!("full cache {}", c.name()),
        };
        format!("step E{} k{} {what}", self.experts, self.top_k)
    }

    /// The line of `bench/torch_pikv_step.py` measuring the same step.
    fn torch_key(&self) -> String {
        let budget = match self.budget {
            Some(b) => b.trim_end_matches('%').parse::<f64>().map(|p| p / 100.0).unwrap_or(1.0),
            None => 1.0,
        };
        let codec = if self.codec == Codec::None { "none" } else { "int8" };
        format!("torch step E{} k{} {codec} budget {budget}", self.experts, self.top_k)
    }
}

/// One measured configuration.
#[derive(Clone, Debug)]
enum Item {
    Copy { bytes: u64 },
    Attend(AttendShape),
    Route { tokens: u32, experts: u32, top_k: u32 },
    Step(StepCase),
    Model { steps: u32 },
    TorchAttend(AttendShape),
    TorchRoute { tokens: u32, experts: u32, top_k: u32 },
    TorchStep,
}

impl Item {
    fn label(&self) -> String {
        match self {
            Item::Copy { bytes } => format!("copy {} MiB", bytes >> 20),
            Item::Attend(s) => attend_label(s),
            Item::Route { tokens, experts, top_k } => format!("route topk t{tokens} e{experts} k{top_k}"),
            Item::Step(c) => c.label(),
            Item::Model { .. } => "model decode".into(),
            Item::TorchAttend(s) => format!("torch sdpa f16 b{} x {}", s.batch, s.tokens),
            Item::TorchRoute { tokens, experts, top_k } => format!("torch topk(softmax) t{tokens} e{experts} k{top_k}"),
            Item::TorchStep => "torch step".into(),
        }
    }
}

fn attend_label(s: &AttendShape) -> String {
    let codec = if s.codec == Codec::None { "f16".to_string() } else { s.codec.spec() };
    format!("attend {codec} p{} b{} x {}", s.page_size, s.batch, s.tokens)
}

/// What one measurement of one item gave: milliseconds, and bytes moved where that means
/// something (GB/s = bytes / ms).
struct Sample {
    /// The item's place in the unshuffled list (the report's order).
    item: usize,
    label: String,
    ms: f64,
    bytes: Option<u64>,
    /// Tokens per second, for the model line.
    tokens_per_s: Option<f64>,
    note: String,
}

/// The suite's summary of one line over the rounds.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Line {
    pub label: String,
    pub median_ms: f64,
    pub min_ms: f64,
    pub spread: f64,
    pub rounds: usize,
    pub gbps: Option<f64>,
    pub tokens_per_s: Option<f64>,
    pub ratio_to_copy: Option<f64>,
    /// PyTorch's time over this line's (above 1: faster than PyTorch), both medians of this call.
    pub speedup_vs_torch: Option<f64>,
    pub torch_ms: Option<f64>,
    pub unstable: bool,
    pub note: String,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// The configurations of a suite, in their unshuffled order.
fn items(o: &SuiteOptions, rt: &Runtime) -> Result<Vec<Item>> {
    let mut out = Vec::new();
    let copy = if o.quick { 32u64 << 20 } else { (1u64 << 30).min(rt.max_binding_bytes()) };
    out.push(Item::Copy { bytes: copy });
    let shapes: &[(u32, u32)] = if o.quick { &[(1, 4096), (2, 2048)] } else { &[(1, 131072), (8, 32768), (32, 8192), (64, 4096)] };
    // f16 pages of 16 slots (its fastest); int8 (its default groups) and int4 (value groups of
    // 64) pages of 64, as BENCHMARKS.md's headlines.
    let codecs: [(Codec, u32); 3] = [(Codec::None, 16), (Codec::parse("int8")?, 64), (Codec::parse("int4:group=64")?, 64)];
    for &(batch, tokens) in shapes {
        let base = AttendShape {
            batch,
            q_heads: 32,
            kv_heads: 8,
            head_dim: 128,
            tokens,
            dtype: KvDtype::F16,
            page_size: 16,
            codec: Codec::None,
            interleave: 0,
        };
        for (codec, page_size) in codecs {
            out.push(Item::Attend(AttendShape { codec, page_size, ..base.clone() }));
        }
        if o.torch {
            out.push(Item::TorchAttend(base));
        }
    }
    let (tokens, experts, top_k) = if o.quick { (4096, 64, 4) } else { (65536, 256, 8) };
    out.push(Item::Route { tokens, experts, top_k });
    if o.torch {
        out.push(Item::TorchRoute { tokens, experts, top_k });
    }
    for (experts, top_k) in [(8, 2), (256, 8)] {
        for (budget, codec) in [(None, Codec::None), (Some("25%"), Codec::None), (None, Codec::parse("int8")?)] {
            out.push(Item::Step(StepCase { experts, top_k, budget, codec }));
        }
    }
    if o.torch {
        out.push(Item::TorchStep);
    }
    if !o.quick && o.model.exists() {
        out.push(Item::Model { steps: 200 });
    }
    Ok(out)
}

/// The decode step's configuration: one layer, GQA 32/8, head_dim 128, 32K context (as
/// `bench/torch_pikv_step.py`), the fused step (no lockstep, no reference pool).
fn step_config(c: &StepCase, quick: bool) -> Result<DemoConfig> {
    let (n_seqs, prompt_len, steps) = if quick { (2, 256, 6) } else { (8, 32768, 24) };
    let d = DemoConfig::default();
    Ok(DemoConfig {
        workload: WorkloadConfig {
            n_seqs,
            layers: 1,
            kv_heads: 8,
            group: 4,
            head_dim: 128,
            n_experts: c.experts,
            top_k: c.top_k,
            prompt_len,
            ..WorkloadConfig::default()
        },
        steps,
        chunk_pages: 32,
        verify: false,
        reference_attention: false,
        router: RouterConfig::CacheAware { lambda: 1.0 },
        scheduler: c.budget.map(|_| SchedulerConfig::parse("h2o")).transpose()?,
        budget: c.budget.unwrap_or("100%").into(),
        codec: c.codec,
        ..d
    })
}

fn measure(rt: &Runtime, o: &SuiteOptions, model: Option<&[u8]>, item: &Item, warmup: u32, reps: u32) -> Result<Vec<Sample>> {
    let label = item.label();
    let one =
        |ms: f64, bytes: Option<u64>, note: String| Ok(vec![Sample { item: 0, label: label.clone(), ms, bytes, tokens_per_s: None, note }]);
    match item {
        Item::Copy { bytes } => {
            let (k, m) = pollster::block_on(copy_roofline(rt, *bytes, warmup, reps))?;
            one(m.median_ms, Some(k.bytes_moved()), "read + write".into())
        }
        Item::Attend(s) => {
            let ab = pollster::block_on(bench_attend(
                rt,
                s,
                AttendOptions { chunk_pages: 32, ..Default::default() },
                warmup,
                reps,
                &mut |_, _| {},
            ))?;
            one(ab.total.median_ms, Some(ab.resident_bytes), ab.variant)
        }
        Item::Route { tokens, experts, top_k } => {
            let m = pollster::block_on(bench_route(rt, RouterConfig::Topk, *tokens, *experts, *top_k, warmup, reps))?;
            one(m.median_ms, Some(u64::from(*tokens) * u64::from(*experts) * 4), "bias + top-k".into())
        }
        Item::Step(c) => {
            let cfg = step_config(c, o.quick)?;
            let steps = cfg.steps;
            let mut p = pollster::block_on(Pipeline::new(rt, cfg))?;
            if !p.fused() {
                bail!("{label}: the suite times the fused step");
            }
            pollster::block_on(p.prefill(rt, &mut |_, _| {}))?;
            // The first third warms the clocks; the rest are timed, each step's wall time
            // including its report's read-back (as the PyTorch step synchronises after each).
            let mut wall = Vec::new();
            let mut gpu = Vec::new();
            for i in 0..steps {
                let t0 = std::time::Instant::now();
                let r = pollster::block_on(p.step(rt))?;
                if i >= steps / 3 {
                    wall.push(t0.elapsed().as_secs_f64() * 1e3);
                    if let Some(g) = &r.gpu {
                        gpu.push(g.total_ms());
                    }
                }
            }
            let g = if gpu.is_empty() { String::new() } else { format!("GPU {:.4} ms of stages", median(&mut gpu)) };
            one(median(&mut wall), None, g)
        }
        Item::Model { steps } => {
            let bytes = model.context("the model's bytes were not read")?;
            let g = expertkv_model::gguf::Gguf::parse(bytes)?;
            let mut m = pollster::block_on(expertkv_model::forward::GpuLlama::load(
                rt,
                &g,
                expertkv_model::forward::ModelOptions::new(1, steps + 64),
            ))?;
            let v = pollster::block_on(m.time_steps(rt, 1, *steps))?;
            let ms = v["wall_ms_per_step"].as_f64().context("time_steps: no wall_ms_per_step")?;
            let mut s = one(ms, None, format!("{} back to back, one sequence", v["steps"]))?;
            s[0].tokens_per_s = v["tokens_per_s"].as_f64();
            Ok(s)
        }
        Item::TorchAttend(s) => {
            let t = torch_json(
                &o.torch_script,
                &["--batch", &s.batch.to_string(), "--tokens", &s.tokens.to_string(), "--reps", &reps.to_string()],
            )?;
            let line = t.first().context("no JSON line from the PyTorch baseline")?;
            one(num(line, "median_ms")?, Some(s.kv_bytes()), String::new())
        }
        Item::TorchRoute { tokens, experts, top_k } => {
            let t = torch_json(
                &o.torch_script,
                &[
                    "--route",
                    "--tokens",
                    &tokens.to_string(),
                    "--experts",
                    &experts.to_string(),
                    "--top-k",
                    &top_k.to_string(),
                    "--reps",
                    &reps.to_string(),
                ],
            )?;
            let line = t.first().context("no JSON line from the PyTorch baseline")?;
            one(num(line, "median_ms")?, None, String::new())
        }
        Item::TorchStep => {
            let mut args = vec!["--sweep-shapes", "--codec", "none,int8", "--budget", "0.25,1.0"];
            if o.quick {
                args.extend(["--batch", "2", "--context", "1024"]);
            }
            let lines = torch_json(&o.torch_step_script, &args)?;
            let mut out = Vec::new();
            for l in lines {
                let (Some(e), Some(k), Some(codec), Some(budget)) =
                    (l["experts"].as_u64(), l["top_k"].as_u64(), l["codec"].as_str(), l["budget"].as_f64())
                else {
                    continue;
                };
                let ms = num(&l, "wall_ms_per_step")?;
                out.push(Sample {
                    item: 0,
                    label: format!("torch step E{e} k{k} {codec} budget {budget}"),
                    ms,
                    bytes: None,
                    tokens_per_s: None,
                    note: String::new(),
                });
            }
            if out.is_empty() {
                bail!("{}: no step lines", o.torch_step_script);
            }
            Ok(out)
        }
    }
}

fn num(v: &serde_json::Value, key: &str) -> Result<f64> {
    v[key].as_f64().with_context(|| format!("the PyTorch line has no number `{key}`: {v}"))
}

/// Run a PyTorch script with `--json` and `args`; its JSON lines.
fn torch_json(script: &str, args: &[&str]) -> Result<Vec<serde_json::Value>> {
    let out = Command::new("python3")
        .arg(script)
        .arg("--json")
        .args(args)
        .output()
        .with_context(|| format!("running python3 {script} (--torch needs python3 with torch and a CUDA device)"))?;
    if !out.status.success() {
        bail!("{script} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.trim_start().starts_with('{'))
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

pub fn run(rt: &Runtime, o: &SuiteOptions) -> Result<Vec<Line>> {
    let seed = o.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64 & 0xffff_ffff)
    });
    let rounds = o.rounds.unwrap_or(if o.quick { 2 } else { 5 }).max(1);
    let (warmup, reps) = if o.quick { (2, o.reps.unwrap_or(5)) } else { (10, o.reps.unwrap_or(30)) };
    let items = items(o, rt)?;
    // The model is read once: every round measures the same bytes.
    let model = if items.iter().any(|i| matches!(i, Item::Model { .. })) {
        Some(std::fs::read(&o.model).with_context(|| format!("reading {}", o.model.display()))?)
    } else {
        None
    };
    if !o.quick && !o.model.exists() {
        eprintln!("bench suite: no {} (scripts/fetch_model.sh fetches it): the model's line is left out", o.model.display());
    }
    if o.json {
        println!(
            "{}",
            serde_json::json!({"suite": "expertkv", "seed": seed, "rounds": rounds, "reps": reps, "adapter": rt.info.name, "backend": format!("{:?}", rt.info.backend), "configurations": items.len()})
        );
    } else {
        println!(
            "bench suite: {} configurations x {rounds} rounds, {reps} repetitions each, order seed {seed} (--seed {seed} replays it); adapter {} ({:?})",
            items.len(),
            rt.info.name,
            rt.info.backend
        );
    }
    // Clocks: a few hundred milliseconds of copies before the first round, so an idle GPU is at
    // its working clock when the first configuration is timed.
    let t0 = std::time::Instant::now();
    while t0.elapsed().as_millis() < if o.quick { 50 } else { 2000 } {
        pollster::block_on(copy_roofline(rt, 64 << 20, 0, 5))?;
    }
    let mut samples: BTreeMap<String, Vec<Sample>> = BTreeMap::new();
    let mut order: Vec<(usize, String)> = Vec::new();
    let started = std::time::Instant::now();
    let mut rounds_done = 0;
    for round in 0..rounds {
        if let (Some(limit), true) = (o.max_minutes, round > 0) {
            let per_round = started.elapsed().as_secs_f64() / f64::from(round);
            if started.elapsed().as_secs_f64() + per_round > limit * 60.0 {
                eprintln!("bench suite: stopping after {round} of {rounds} rounds ({:.0} s each; --max-minutes {limit})", per_round);
                break;
            }
        }
        let round_start = std::time::Instant::now();
        let mut idx: Vec<usize> = (0..items.len()).collect();
        let mut rng = Rng::new(seed ^ (u64::from(round) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        for i in (1..idx.len()).rev() {
            idx.swap(i, rng.below(i as u32 + 1) as usize);
        }
        for &i in &idx {
            let item = &items[i];
            if !o.json {
                eprint!("\rround {}/{rounds}: {:<48}", round + 1, item.label());
            }
            for mut s in
                measure(rt, o, model.as_deref(), item, warmup, reps).with_context(|| format!("round {}: {}", round + 1, item.label()))?
            {
                s.item = i;
                if !order.iter().any(|(_, l)| *l == s.label) {
                    order.push((i, s.label.clone()));
                }
                samples.entry(s.label.clone()).or_default().push(s);
            }
        }
        rounds_done += 1;
        if !o.json {
            eprintln!("\rround {}/{rounds} done in {:.1} s{:<40}", round + 1, round_start.elapsed().as_secs_f64(), "");
        }
    }
    if o.json {
        println!("{}", serde_json::json!({"suite_rounds_done": rounds_done, "seconds": started.elapsed().as_secs_f64()}));
    }
    if !o.json {
        eprintln!("\r{:<80}", "");
    }
    // The report in the unshuffled order of the configurations.
    order.sort();
    let order: Vec<String> = order.into_iter().map(|(_, l)| l).collect();
    let summary = |label: &str| -> Option<(f64, f64, f64, usize)> {
        let v = samples.get(label)?;
        let mut ms: Vec<f64> = v.iter().map(|s| s.ms).collect();
        let (lo, hi) = ms.iter().fold((f64::MAX, f64::MIN), |(l, h), &x| (l.min(x), h.max(x)));
        let m = median(&mut ms);
        Some((m, lo, (hi - lo) / m, v.len()))
    };
    let copy_gbps = items.iter().find_map(|i| match i {
        Item::Copy { bytes } => summary(&i.label()).map(|(m, ..)| gbps(2 * bytes, m)),
        _ => None,
    });
    // expertkv's lines, then PyTorch's (a PyTorch line is compared with nothing).
    let (ours, torch): (Vec<&String>, Vec<&String>) = order.iter().partition(|l| !l.starts_with("torch"));
    let mut lines = Vec::new();
    for label in ours.into_iter().chain(torch) {
        let Some((m, lo, spread, n)) = summary(label) else { continue };
        let v = &samples[label];
        let g = v[0].bytes.map(|b| gbps(b, m));
        let vs_torch = torch_label_for(label, &items).as_deref().and_then(summary);
        let mut tps: Vec<f64> = v.iter().filter_map(|s| s.tokens_per_s).collect();
        lines.push(Line {
            label: label.clone(),
            median_ms: m,
            min_ms: lo,
            spread,
            rounds: n,
            gbps: g,
            tokens_per_s: (!tps.is_empty()).then(|| median(&mut tps)),
            ratio_to_copy: g.zip(copy_gbps).filter(|_| !label.starts_with("copy")).map(|(a, c)| a / c),
            speedup_vs_torch: vs_torch.map(|t| t.0 / m),
            torch_ms: vs_torch.map(|t| t.0),
            unstable: spread > UNSTABLE_SPREAD || vs_torch.is_some_and(|t| t.2 > UNSTABLE_SPREAD),
            note: v.last().map(|s| s.note.clone()).unwrap_or_default(),
        });
    }
    for l in &lines {
        if o.json {
            println!("{}", serde_json::to_string(l)?);
        } else {
            print!("{:<40} median {:>9.4} ms  min {:>9.4}  spread {:>5.1}%", l.label, l.median_ms, l.min_ms, 100.0 * l.spread);
            if let Some(g) = l.gbps {
                print!("  {g:>7.1} GB/s");
            }
            if let Some(r) = l.ratio_to_copy {
                print!("  {r:.2} of copy");
            }
            if let Some(t) = l.tokens_per_s {
                print!("  {t:.1} tokens/s");
            }
            if let (Some(s), Some(t)) = (l.speedup_vs_torch, l.torch_ms) {
                print!("  {s:.2}x pytorch ({t:.4} ms)");
            }
            if l.unstable {
                print!("  UNSTABLE");
            }
            if !l.note.is_empty() {
                print!("  [{}]", l.note);
            }
            println!();
        }
    }
    Ok(lines)
}

/// The PyTorch line an expertkv line is compared with, if any.
fn torch_label_for(label: &str, items: &[Item]) -> Option<String> {
    for i in items {
        match i {
            Item::Attend(s) if attend_label(s) == label => {
                return Some(Item::TorchAttend(AttendShape { codec: Codec::None, page_size: 16, ..s.clone() }).label());
            }
            Item::Route { tokens, experts, top_k } if i.label() == label => {
                return Some(Item::TorchRoute { tokens: *tokens, experts: *experts, top_k: *top_k }.label());
            }
            Item::Step(c) if c.label() == label => return Some(c.torch_key()),
            _ => {}
        }
    }
    None
}
