use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use expertkv_core::config::{Codec, KvDtype, ShardMap};
use expertkv_core::evict::config::{EkvaConfig, SchedulerConfig, Threshold};
use expertkv_core::pipeline::{DemoConfig, Pipeline};
use expertkv_core::route::config::RouterConfig;
use indicatif::{ProgressBar, ProgressStyle};

use crate::{GpuArgs, check_positive, fmt_bytes};

/// Every flag overrides the config file, which overrides the defaults.
#[derive(Args, Clone)]
pub struct DemoArgs {
    /// TOML file with any fields of the run (see README); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Decode steps to run after the prompt [default: 16].
    #[arg(long)]
    steps: Option<u32>,
    /// Sequences decoded together [default: 4].
    #[arg(long)]
    seqs: Option<u32>,
    /// [default: 2]
    #[arg(long)]
    layers: Option<u32>,
    /// Prompt tokens per sequence [default: 1024].
    #[arg(long)]
    prompt: Option<u32>,
    /// [default: 4]
    #[arg(long)]
    kv_heads: Option<u32>,
    /// Query heads per KV head [default: 4].
    #[arg(long)]
    group: Option<u32>,
    /// [default: 64]
    #[arg(long)]
    head_dim: Option<u32>,
    /// [default: 16]
    #[arg(long)]
    experts: Option<u32>,
    /// [default: 2]
    #[arg(long)]
    top_k: Option<u32>,
    /// Router: name or name:key=value,... One of hash, topk, load-balance, cache-aware (pikv),
    /// entropy (eplb), adaptive, hierarchical [default: cache-aware].
    #[arg(long)]
    router: Option<String>,
    /// Scheduler: name or name:key=value,... One of h2o, streaming-llm, lru, lru-plus, adakv,
    /// duo, quest, flexgen, fastv-tokens[:from_layer=L], or none for the full cache
    /// [default: h2o].
    #[arg(long)]
    scheduler: Option<String>,
    /// Tokens each (layer, sequence, KV head) keeps under the scheduler: a number or a share of
    /// the final context such as 25% [default: 25%].
    #[arg(long)]
    budget: Option<String>,
    /// PyramidKV over the scheduler: the first layer's budget over the last's (linear in depth,
    /// averaging --budget) [default: off].
    #[arg(long)]
    pyramid: Option<f32>,
    /// Budget allocator over the scheduler: none, or ekva[:floor=F,alpha=A,decay=D] (EKVA: each
    /// list's budget split over expert groups by importance, routing frequency and attention mass)
    /// [default: none].
    #[arg(long)]
    allocator: Option<String>,
    /// Utility threshold: fixed:TAU (evict tokens under TAU x mean mass even under budget) or
    /// adaptive:TARGET or adaptive:TARGET,STEP (TAU follows the kept-attention share) [default: fixed:0].
    #[arg(long)]
    threshold: Option<String>,
    /// The recall tier under the scheduler: what it evicts is kept (in host memory where the
    /// device reads it in place) and each list attends its PAGES best evicted pages at every layer
    /// (0: no tier) [default: 0].
    #[arg(long, value_name = "PAGES")]
    recall: Option<u32>,
    /// Page codec: none, int8[:group=G], int4[:group=G], fastv-dims[:keep=R], low-rank[:rank=R],
    /// lora[:rank=R]; needs --scheduler
    /// none [default: none].
    #[arg(long)]
    codec: Option<String>,
    /// With a scheduler, skip the full-cache pool kept to measure the attention error.
    #[arg(long)]
    no_reference: bool,
    /// K/V storage: f16 or f32 [default: f16].
    #[arg(long)]
    dtype: Option<String>,
    /// Slots per page [default: 16].
    #[arg(long)]
    page_size: Option<u32>,
    /// Pages per split chunk of the attention kernels [default: 8].
    #[arg(long)]
    chunk_pages: Option<u32>,
    /// Shards per (layer, sequence), a power of two [default: 4].
    #[arg(long)]
    shards: Option<u32>,
    /// Shard map: pikv, expert, token-block [default: pikv].
    #[arg(long)]
    shard_map: Option<String>,
    /// Pages in the pool (default: enough for prompt and steps).
    #[arg(long)]
    pages: Option<u32>,
    /// [default: 42]
    #[arg(long)]
    seed: Option<u64>,
    /// Skip the CPU reference kept in lockstep (faster on large runs).
    #[arg(long)]
    no_verify: bool,
    /// One JSON object per step (and a final summary) instead of a table.
    #[arg(long)]
    json: bool,
    /// Print a checksum of every step's decisions (routing, evictions, pool placement), the number
    /// the browser demo's test compares with the page's (`scripts/web.sh test`).
    #[arg(long)]
    checksum: bool,
    /// Also write every step's metrics to FILE: CSV when it ends in .csv, JSON lines otherwise.
    #[arg(long, value_name = "FILE")]
    metrics: Option<std::path::PathBuf>,
    /// Also record a decode trace to FILE (the format is in core/src/trace.rs; `expertkv replay`
    /// reads it back).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<std::path::PathBuf>,
}

/// Where `--metrics` goes.
enum MetricsSink {
    Csv(std::io::BufWriter<std::fs::File>),
    Json(std::io::BufWriter<std::fs::File>),
}

impl MetricsSink {
    fn create(path: &std::path::Path) -> Result<MetricsSink> {
        use std::io::Write;
        let f = std::fs::File::create(path).with_context(|| format!("--metrics: cannot create {}", path.display()))?;
        let mut w = std::io::BufWriter::new(f);
        if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("csv")) {
            writeln!(w, "{}", expertkv_core::pipeline::StepReport::CSV_HEADER)?;
            Ok(MetricsSink::Csv(w))
        } else {
            Ok(MetricsSink::Json(w))
        }
    }

    fn write(&mut self, r: &expertkv_core::pipeline::StepReport) -> Result<()> {
        use std::io::Write;
        // Each step's row written through, so a killed process leaves every finished step.
        match self {
            MetricsSink::Csv(w) => {
                writeln!(w, "{}", r.csv_row())?;
                w.flush()?;
            }
            MetricsSink::Json(w) => {
                writeln!(w, "{}", serde_json::to_string(r)?)?;
                w.flush()?;
            }
        }
        Ok(())
    }

    fn finish(self) -> Result<()> {
        use std::io::Write;
        match self {
            MetricsSink::Csv(mut w) | MetricsSink::Json(mut w) => w.flush()?,
        }
        Ok(())
    }
}

pub(crate) fn parse_threshold(s: &str) -> Result<Threshold> {
    let (kind, rest) = s.split_once(':').unwrap_or((s, ""));
    let nums: Vec<f32> = rest
        .split(',')
        .filter(|x| !x.trim().is_empty())
        .map(|x| x.trim().parse::<f32>())
        .collect::<Result<_, _>>()
        .context("--threshold numbers")?;
    Ok(match (kind, nums.as_slice()) {
        ("fixed", [tau]) => Threshold::Fixed { tau: *tau },
        ("adaptive", [target]) => Threshold::Adaptive { target: *target, step: 0.2 },
        ("adaptive", [target, step]) => Threshold::Adaptive { target: *target, step: *step },
        _ => anyhow::bail!("--threshold: expected fixed:TAU or adaptive:TARGET[,STEP], got `{s}`"),
    })
}

/// The flags that override a demo configuration (a TOML file or the defaults), shared by `demo`
/// and the viewer's `view` / `demo --view` (which take a subset: the rest stay `None`).
#[derive(Clone, Debug, Default)]
pub struct Overrides<'a> {
    pub config: Option<&'a std::path::Path>,
    pub steps: Option<u32>,
    pub seqs: Option<u32>,
    pub layers: Option<u32>,
    pub prompt: Option<u32>,
    pub kv_heads: Option<u32>,
    pub group: Option<u32>,
    pub head_dim: Option<u32>,
    pub experts: Option<u32>,
    pub top_k: Option<u32>,
    pub seed: Option<u64>,
    pub page_size: Option<u32>,
    pub chunk_pages: Option<u32>,
    pub shards: Option<u32>,
    pub router: Option<&'a str>,
    pub scheduler: Option<&'a str>,
    pub budget: Option<&'a str>,
    pub pyramid: Option<f32>,
    pub allocator: Option<&'a str>,
    pub threshold: Option<&'a str>,
    pub recall: Option<u32>,
    pub codec: Option<&'a str>,
    pub dtype: Option<&'a str>,
    pub shard_map: Option<&'a str>,
    pub pages: Option<u32>,
    pub no_verify: bool,
    pub no_reference: bool,
}

impl Overrides<'_> {
    /// The configuration file (or the defaults) with these flags applied, checked.
    pub fn build(&self) -> Result<DemoConfig> {
        let mut cfg = match self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
                toml::from_str::<DemoConfig>(&text).with_context(|| format!("{} is not a valid demo config", path.display()))?
            }
            None => DemoConfig::default(),
        };
        let w = &mut cfg.workload;
        for (dst, src) in [
            (&mut cfg.steps, self.steps),
            (&mut w.n_seqs, self.seqs),
            (&mut w.layers, self.layers),
            (&mut w.prompt_len, self.prompt),
            (&mut w.kv_heads, self.kv_heads),
            (&mut w.group, self.group),
            (&mut w.head_dim, self.head_dim),
            (&mut w.n_experts, self.experts),
            (&mut w.top_k, self.top_k),
            (&mut cfg.page_size, self.page_size),
            (&mut cfg.chunk_pages, self.chunk_pages),
            (&mut cfg.n_shards, self.shards),
        ] {
            if let Some(v) = src {
                *dst = v;
            }
        }
        if let Some(s) = self.seed {
            w.seed = s;
        }
        if let Some(r) = self.router {
            cfg.router = RouterConfig::parse(r)?;
        }
        if let Some(s) = self.scheduler {
            cfg.scheduler = if s == "none" { None } else { Some(SchedulerConfig::parse(s)?) };
        }
        if let Some(b) = self.budget {
            cfg.budget = b.to_string();
        }
        if self.pyramid.is_some() {
            cfg.pyramid = self.pyramid;
        }
        if let Some(al) = self.allocator {
            cfg.allocator = EkvaConfig::parse(al)?;
        }
        if let Some(t) = self.threshold {
            cfg.threshold = parse_threshold(t)?;
        }
        if let Some(r) = self.recall {
            cfg.recall = r;
        }
        if self.no_reference {
            cfg.reference_attention = false;
        }
        if let Some(c) = self.codec {
            cfg.codec = Codec::parse(c)?;
        }
        if let Some(d) = self.dtype {
            cfg.dtype = KvDtype::parse(d)?;
        }
        if let Some(m) = self.shard_map {
            cfg.shard_map = ShardMap::parse(m, cfg.n_shards)?;
        } else if self.shards.is_some() {
            // Keep the configured map, at the new shard count.
            cfg.shard_map = ShardMap::parse(cfg.shard_map.name(), cfg.n_shards)?;
        }
        if self.pages.is_some() {
            cfg.pool_pages = self.pages;
        }
        if self.no_verify {
            cfg.verify = false;
        }
        for (n, v) in
            [("steps", cfg.steps), ("seqs", cfg.workload.n_seqs), ("layers", cfg.workload.layers), ("prompt", cfg.workload.prompt_len)]
        {
            check_positive(n, v)?;
        }
        cfg.workload.validate()?;
        cfg.router.validate(cfg.workload.n_experts, cfg.workload.top_k)?;
        cfg.budget_tokens()?;
        cfg.pool_config().validate()?;
        Ok(cfg)
    }
}

fn build_config(a: &DemoArgs) -> Result<DemoConfig> {
    Overrides {
        config: a.config.as_deref(),
        steps: a.steps,
        seqs: a.seqs,
        layers: a.layers,
        prompt: a.prompt,
        kv_heads: a.kv_heads,
        group: a.group,
        head_dim: a.head_dim,
        experts: a.experts,
        top_k: a.top_k,
        seed: a.seed,
        page_size: a.page_size,
        chunk_pages: a.chunk_pages,
        shards: a.shards,
        router: a.router.as_deref(),
        scheduler: a.scheduler.as_deref(),
        budget: a.budget.as_deref(),
        pyramid: a.pyramid,
        allocator: a.allocator.as_deref(),
        threshold: a.threshold.as_deref(),
        recall: a.recall,
        codec: a.codec.as_deref(),
        dtype: a.dtype.as_deref(),
        shard_map: a.shard_map.as_deref(),
        pages: a.pages,
        no_verify: a.no_verify,
        no_reference: a.no_reference,
    }
    .build()
}

pub fn run(gpu: &GpuArgs, a: &DemoArgs) -> Result<()> {
    let cfg = build_config(a)?;
    // Fail before any GPU work when the metrics file cannot be written.
    let mut sink = a.metrics.as_deref().map(MetricsSink::create).transpose()?;
    let mut trace = match &a.trace {
        Some(path) => {
            let f = std::fs::File::create(path).with_context(|| format!("--trace: cannot create {}", path.display()))?;
            Some(expertkv_core::trace::TraceWriter::new(std::io::BufWriter::new(f), &expertkv_core::trace::TraceHeader::new(cfg.clone()))?)
        }
        None => None,
    };
    let pool_cfg = cfg.pool_config();
    let w = cfg.workload.clone();
    let rt = gpu.runtime()?;
    let mut p = pollster::block_on(Pipeline::new(&rt, cfg.clone())).context("building the pipeline")?;
    if !a.json {
        println!(
            "expertkv demo: {} sequences x {} layers, prompt {} tokens, {} decode steps; {} pages of {} slots, {} shards ({} map); router {} over {} experts, top-{}",
            w.n_seqs,
            w.layers,
            w.prompt_len,
            cfg.steps,
            cfg.dtype.name(),
            cfg.page_size,
            cfg.n_shards,
            cfg.shard_map.name(),
            cfg.router.name(),
            w.n_experts,
            w.top_k
        );
        println!(
            "adapter: {} ({:?}, {:?}); tier {}; attention {}; shader checks {}",
            rt.info.name,
            rt.info.backend,
            rt.info.device_type,
            rt.tier.name(),
            p.kv.attn.describe(),
            rt.checks.name()
        );
        println!(
            "pool: {} pages x {} = {} of K/V in {} buffer(s), {} of metadata",
            pool_cfg.n_pages,
            fmt_bytes(pool_cfg.page_bytes()),
            fmt_bytes(p.kv.pool.kv_bytes_allocated()),
            p.kv.pool.n_buffers(),
            fmt_bytes(p.kv.pool.meta_bytes_allocated())
        );
        if pool_cfg.codec != Codec::None {
            println!(
                "codec {}: {} compressed pages x {} = {} ({} per token and head against {} in f16)",
                pool_cfg.codec.name(),
                pool_cfg.codec_pages,
                fmt_bytes(pool_cfg.codec_page_bytes()),
                fmt_bytes(p.kv.pool.codec_bytes_allocated()),
                fmt_bytes(pool_cfg.codec_page_bytes() / u64::from(pool_cfg.page_size)),
                fmt_bytes(pool_cfg.page_bytes() / u64::from(pool_cfg.page_size))
            );
        }
    }
    let total = u64::from(w.n_seqs) * u64::from(w.layers) * u64::from(w.prompt_len);
    let bar = if a.json { ProgressBar::hidden() } else { ProgressBar::new(total) };
    bar.set_style(
        ProgressStyle::with_template("prefill {bar:40} {pos}/{len} tokens {elapsed}").unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let t0 = std::time::Instant::now();
    pollster::block_on(p.prefill(&rt, &mut |done, _| bar.set_position(done))).context("prefill")?;
    bar.finish_and_clear();
    let evicting = cfg.scheduler.is_some() || cfg.codec != Codec::None;
    if !a.json {
        println!("prefill: {total} tokens routed and appended in {:.2} s", t0.elapsed().as_secs_f64());
        if p.fused() {
            println!("decode steps: one submission each (no host round trip)");
        } else {
            println!("decode steps: staged submissions (the CPU lockstep, the full-cache reference or a host tier read back mid-step)");
        }
        if let (Some(sch), Ok(Some(b))) = (&cfg.scheduler, cfg.budget_tokens()) {
            println!(
                "scheduler {} keeps {b} tokens per (layer, sequence, KV head) ({} of a {}-token context); threshold {:?}",
                sch.name(),
                cfg.budget,
                w.prompt_len + cfg.steps,
                cfg.threshold
            );
            if let Ok(Some(lb)) = cfg.layer_budgets()
                && lb.iter().any(|&x| x != b)
            {
                let shown: Vec<String> = lb.iter().map(|&x| if x == u32::MAX { "all".into() } else { x.to_string() }).collect();
                println!("per-layer budgets: {}", shown.join(" "));
            }
            if let Some(al) = &cfg.allocator {
                println!("allocator {}: each list's budget split over its {} expert groups by importance", al.spec(), w.n_experts);
            }
        }
        print!(
            "{:>4} {:>6} {:>8} {:>8} {:>9} {:>8} {:>9} {:>8}  {:<22} {:>10}",
            "step", "ctx", "route", "append", "attend", "evict", "gpu", "host", "KV resident (fill)", "pages"
        );
        if evicting {
            print!(" {:>7} {:>7} {:>9} {:>10}", "evicted", "kept", "attn err", "full KV");
        }
        println!(" {:>6} {:>6}  shard pages", "H(rt)", "miss");
    }
    let mut gpu_totals = Vec::new();
    let mut last_split = None;
    let mut digest = expertkv_core::digest::DecisionDigest::new();
    for _ in 0..cfg.steps {
        let r = pollster::block_on(p.step(&rt)).context("decode step")?;
        if a.checksum {
            pollster::block_on(digest.absorb_step(&rt, &p)).context("decision checksum")?;
        }
        if !r.expert_budget.is_empty() {
            last_split = Some((r.expert_budget.clone(), r.expert_importance.clone()));
        }
        if let Some(s) = &mut sink {
            s.write(&r)?;
        }
        if let Some(t) = &mut trace {
            for rec in pollster::block_on(p.trace_records(&rt)).context("trace records")? {
                t.write(&rec)?;
            }
            t.flush()?;
        }
        if a.json {
            println!("{}", serde_json::to_string(&r)?);
            continue;
        }
        let ms = |v: f64| format!("{v:.3}ms");
        let cols = match &r.gpu {
            Some(g) => {
                let t = g.total_ms();
                gpu_totals.push(t);
                // "append" is the write side: the append and the compression of filled pages.
                [ms(g.route_ms), ms(g.append_ms + g.compress_ms), ms(g.gather_ms + g.attend_ms), ms(g.evict_ms), ms(t)]
            }
            None => std::array::from_fn(|_| "-".to_string()),
        };
        let fill = 100.0 * r.kv_bytes_tokens as f64 / r.kv_bytes_resident.max(1) as f64;
        // With a codec the tokens' f16 bytes exceed the resident bytes: show the ratio.
        let fill_txt = if cfg.codec != Codec::None { format!("rho {:.2}", fill / 100.0) } else { format!("{fill:.1}%") };
        print!(
            "{:>4} {:>6} {:>8} {:>8} {:>9} {:>8} {:>9} {:>6.2}ms  {:<22} {:>10}",
            r.step,
            r.context,
            cols[0],
            cols[1],
            cols[2],
            cols[3],
            cols[4],
            r.host_ms,
            format!("{} ({fill_txt})", fmt_bytes(r.kv_bytes_resident)),
            format!("{}/{}", r.pages_in_use, r.pages_total),
        );
        if evicting {
            print!(
                " {:>7} {:>6.1}% {:>9} {:>10}",
                r.evicted,
                100.0 * r.kept_attention,
                r.attention_error.map(|e| format!("{e:.2e}")).unwrap_or_else(|| "-".into()),
                r.full_kv_bytes.map(fmt_bytes).unwrap_or_else(|| "-".into())
            );
        }
        println!(" {:>6.3} {:>5.1}%  {:?}", r.routing_entropy, 100.0 * r.miss_rate, r.shard_pages);
    }
    if a.checksum {
        if a.json {
            println!("{}", serde_json::json!({"checksum": digest.hex(), "steps": digest.steps(), "fingerprint": digest.fingerprint()}));
        } else {
            println!("decision checksum over {} steps: {}", digest.steps(), digest.hex());
            let f = digest.fingerprint();
            if let Some(last) = f.chunks(3).last() {
                println!("attention output fingerprint: {} sums, last step's {last:.6?}", f.len());
            }
        }
    }
    if let Some((budget, imp)) = last_split
        && !a.json
    {
        let total: u64 = budget.iter().sum();
        let parts: Vec<String> = budget
            .iter()
            .zip(&imp)
            .enumerate()
            .map(|(e, (b, i))| format!("e{e} {:.1}% (imp {i:.3})", 100.0 * *b as f64 / total.max(1) as f64))
            .collect();
        println!("ekva budget split at the last eviction ({total} tokens): {}", parts.join(", "));
    }
    if let Some((fg, _)) = &p.kv.flexgen
        && !a.json
    {
        println!("{}", flexgen_line(&fg.stats));
    }
    if let Some(t) = trace {
        t.finish()?;
        if !a.json
            && let Some(path) = &a.trace
        {
            println!("trace: {} ({} steps x {} layers)", path.display(), cfg.steps, w.layers);
        }
    }
    if let Some(s) = sink {
        s.finish()?;
        if !a.json
            && let Some(path) = &a.metrics
        {
            println!("metrics: {}", path.display());
        }
    }
    if let Some(q) = &p.kv.quest
        && !a.json
    {
        println!("quest: attention reads at most {} pages per (layer, sequence, KV head) list", q.keep_pages);
    }
    if let Some((ek, ev)) = pollster::block_on(p.reconstruction_error(&rt)).context("reconstruction error")?
        && !a.json
    {
        println!("codec {}: reconstruction error (rel. L2 against f16) K {ek:.2e}, V {ev:.2e}", cfg.codec.name());
    }
    let v = pollster::block_on(p.verify(&rt)).context("verification")?;
    if a.json {
        println!("{}", serde_json::to_string(&serde_json::json!({"verify": &v, "config": cfg}))?);
    } else {
        if !gpu_totals.is_empty() {
            println!("median GPU time per step: {:.3} ms", expertkv_core::runtime::timer::median(&gpu_totals));
        }
        match &v {
            Some(v) => println!(
                "check: GPU pool identical to the CPU reference ({} cached tokens; rings, pages, free lists, slot metadata, control words, K/V); \
                 attention of all {} layer passes within tolerance of the f64 reference (max |err| {:.1e}, the worst {:.0}% of its tolerance)",
                v.tokens_checked,
                v.attention_checked,
                v.attention_max_abs_err,
                100.0 * v.attention_worst_share
            ),
            None => println!("check: skipped (--no-verify)"),
        }
    }
    Ok(())
}

/// FlexGen's tier traffic in one line (`demo` and `run`), with its spill tier's if it has one.
pub fn flexgen_line(s: &expertkv_core::evict::flexgen::TierStats) -> String {
    let mut line = format!(
        "flexgen: {} in host memory ({} pages); {} pages offloaded, {} fetched back; {} moved to the host, {} to the GPU",
        fmt_bytes(s.host_bytes),
        s.host_pages,
        s.offloaded_pages,
        s.fetched_pages,
        fmt_bytes(s.bytes_to_host),
        fmt_bytes(s.bytes_to_gpu)
    );
    if s.pages_to_spill > 0 || s.spill_failed.is_some() {
        line += &format!(
            "; the page store holds {} pages ({} sent, {} brought back, {} lost)",
            s.spilled_pages, s.pages_to_spill, s.pages_from_spill, s.lost_pages
        );
    }
    if let Some(f) = &s.spill_failed {
        eprintln!("warning: {f}; the host tier went on without the page store");
    }
    line
}
