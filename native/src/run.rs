//! `expertkv run`: greedy decoding of a real model (a GGUF file, SmolLM2-135M by default) on the
//! GPU, its K/V in the expertkv pool.

use std::io::Write;

use anyhow::{Context, Result, bail};
use clap::Args;
use expertkv_core::config::{Codec, KvDtype};
use expertkv_core::evict::config::{Budget, SchedulerConfig};
use expertkv_core::route::config::RouterConfig;
use expertkv_model::experts::{ExpertCache, ExpertPrefetch};
use expertkv_model::forward::trace::{ModelTraceHeader, TraceSink};
use expertkv_model::forward::{GpuLlama, ModelOptions};
use expertkv_model::text::{GenerateOptions, TextModel};
use expertkv_model::tokenizer::Tokenizer;
use expertkv_model::{LlamaConfig, gguf::Gguf};

use crate::batch::BatchOptions;
use crate::moe_spec::{Moefied, Moefier, parse_moe};
use crate::{GpuArgs, fmt_bytes};

#[derive(Args)]
pub struct RunArgs {
    /// Text to continue.
    #[arg(long, default_value = "The capital of France is")]
    pub prompt: String,
    /// Tokens to generate (greedy).
    #[arg(long, default_value_t = 16)]
    pub tokens: u32,
    /// After generating, time this many more decode steps submitted back to back (nothing read
    /// between them, as a serving loop runs) and print the decode speed as JSON; needs no
    /// evicting scheduler; with --prompts, every sequence of the batch decodes [default: 0, off].
    #[arg(long, default_value_t = 0)]
    pub time_steps: u32,
    /// Time the prefill and every decode step stage by stage on the GPU (timestamps between
    /// the passes; each step read back before the next) and print where the time goes as a JSON
    /// line; with --time-steps, that line also holds the stages of a few of its steps.
    #[arg(long)]
    pub profile: bool,
    /// Prompt tokens one prefill pass takes (1 to 1024): larger chunks make fewer, larger
    /// products, smaller ones hold less scratch memory.
    #[arg(long, default_value_t = expertkv_model::forward::PREFILL_CHUNK)]
    pub prefill_chunk: u32,
    /// The model: a GGUF file (llama, qwen2, qwen3, qwen3moe, olmoe or qwen2moe architecture) [default: models/SmolLM2-135M-Instruct.Q4_1.gguf,
    /// fetched by scripts/fetch_model.sh].
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// K/V storage in the pool: f16 or f32.
    #[arg(long, default_value = "f16")]
    dtype: String,
    /// Page codec of the K/V pool (int8, int4, fastv-dims, low-rank, lora; name or
    /// name:key=value, for example int4:group=64): every page that leaves its ring's head is
    /// compressed on the GPU; the low-rank codecs fit their basis on the first 64 positions
    /// [default: none, f16 pages].
    #[arg(long)]
    codec: Option<String>,
    /// Evict over the model's own attention with an evicting scheduler (h2o, streaming-llm, lru,
    /// lru-plus, adakv, duo, fastv-tokens), or select pages for its queries with quest; name or
    /// name:key=value,... H2O's recent window is half the budget unless given [default: none,
    /// the full cache].
    #[arg(long)]
    scheduler: Option<String>,
    /// Tokens each (layer, KV head) keeps (or QUEST attends) under --scheduler, or a share of the whole context
    /// (`25%` of the prompt and the generated tokens).
    #[arg(long, default_value = "64")]
    budget: String,
    /// PyramidKV over --scheduler: the first layer's budget over the last's (linear in depth,
    /// averaging --budget) [default: off].
    #[arg(long)]
    pyramid: Option<f32>,
    /// The scheduler's utility threshold: fixed:TAU (evict tokens under TAU x the mean mass even
    /// under budget), adaptive:TARGET or adaptive:TARGET,STEP [default: fixed:0].
    #[arg(long)]
    threshold: Option<String>,
    /// The recall tier under --scheduler: what it evicts is kept (in host memory where the
    /// device reads it in place) and each list attends its PAGES best evicted pages at every
    /// layer [default: off].
    #[arg(long, value_name = "PAGES")]
    recall: Option<u32>,
    /// With --recall: of its 32 candidate pages, how many the tier pages' key bounds nominate
    /// (an i8 minimum and maximum a key dimension a page, in device memory), the digests the
    /// rest [default: 0, the digests all].
    #[arg(long, default_value_t = 0, value_name = "N")]
    recall_bounds: u32,
    /// MoEfy the FFNs: E:K splits each layer's neurons into E experts (balanced spherical
    /// k-means of the gate rows) and evaluates only the top K per token, as ranked by the
    /// router (the token against each expert's centroid); E:K:fitted ranks them with a linear
    /// router fitted to the experts' activation mass on a calibration text the project ships
    /// (about 25 s on two cores, far better quality) [default: dense].
    #[arg(long, value_name = "E:K[:fitted]")]
    moe: Option<String>,
    /// With --moe, or a MoE file: one of the pipeline's routers chooses the experts from the
    /// router's scores (hash, topk, load-balance, entropy, adaptive, hierarchical; name or
    /// name:key=value,...) [default: the scores' plain top K].
    #[arg(long)]
    router: Option<String>,
    #[command(flatten)]
    routing: crate::routing::RoutingArgs,
    #[command(flatten)]
    experts: crate::experts_args::ExpertArgs,
    /// Map the model file instead of reading it into memory: its pages come from the OS page
    /// cache as the weights are uploaded and a MoE file's experts are copied into their host
    /// tier, so host memory holds the experts once, not the file as well. The file must not be
    /// changed while the run maps it (a truncated file ends the process with SIGBUS).
    #[arg(long)]
    mmap: bool,
    /// One GPU memory budget (bytes, with K, M or G) for the K/V pool and a MoE file's experts:
    /// the pool the run needs first, then as many expert slots per layer as the rest holds (the
    /// others in host memory). A budget too small for the pool and one step's experts is refused
    /// with the minimum. The rest of the model's weights are outside it.
    #[arg(long, value_name = "BYTES")]
    gpu_mem: Option<String>,
    /// Record every pass (prefill chunk or decode step) into FILE, one JSON line each: the
    /// tokens fed, each layer's chosen experts, expert fetches and weight bytes moved, K/V pages
    /// in use and moved between tiers (`expertkv compare A B` sets two runs side by side). A
    /// prefix restored from --kv-store is not a pass (positions jump past it).
    #[arg(long, value_name = "FILE")]
    trace: Option<std::path::PathBuf>,
    /// End with one JSON line: the prompt's and the generated token ids, the text, the timings
    /// and the K/V in use (what scripts and the browser test compare).
    #[arg(long)]
    pub json: bool,
    /// Check every eviction against the CPU reference (utilities, budgets, victims, list
    /// counts, then the whole pool); slow: the pool crosses to the host twice a token.
    #[arg(long)]
    verify_evictions: bool,
    /// Decode the prompts of this file (one per line, blank lines skipped) instead of
    /// --prompt, --batch at a time (continuous batching: a finished sequence's pages are freed
    /// and the next prompt takes its place); each prompt generates --tokens tokens or stops at
    /// end-of-sequence.
    #[arg(long, value_name = "FILE")]
    pub prompts: Option<std::path::PathBuf>,
    /// Sequences decoded together with --prompts (1 to 64).
    #[arg(long, default_value_t = 1)]
    pub batch: u32,
    #[command(flatten)]
    pub store: crate::store::KvStoreArgs,
}

/// The model file's path (`--model`, else SmolLM2 under `EXPERTKV_MODELS_DIR` or `models/`) and
/// its bytes; `run` and `eval` share it.
pub fn read_model(model: Option<&std::path::Path>) -> Result<(std::path::PathBuf, Vec<u8>)> {
    let path = model.map(std::path::Path::to_path_buf).unwrap_or_else(default_model);
    let bytes = std::fs::read(&path)
        .with_context(|| format!("cannot read the model {} (scripts/fetch_model.sh fetches SmolLM2-135M)", path.display()))?;
    Ok((path, bytes))
}

/// A model file's bytes: read into memory, or mapped ([`open_model`]).
pub enum ModelBytes {
    /// The whole file, read at start (a later change to the file cannot reach the run).
    Read(Vec<u8>),
    /// The file mapped read-only: its pages come from the OS page cache as they are used.
    Mapped(memmap2::Mmap),
}

impl std::ops::Deref for ModelBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            ModelBytes::Read(v) => v,
            ModelBytes::Mapped(m) => m,
        }
    }
}

/// [`read_model`], or with `map` the file mapped instead of read.
pub fn open_model(model: Option<&std::path::Path>, map: bool) -> Result<(std::path::PathBuf, ModelBytes)> {
    if !map {
        return read_model(model).map(|(p, b)| (p, ModelBytes::Read(b)));
    }
    let path = model.map(std::path::Path::to_path_buf).unwrap_or_else(default_model);
    let file = std::fs::File::open(&path)
        .with_context(|| format!("cannot open the model {} (scripts/fetch_model.sh fetches SmolLM2-135M)", path.display()))?;
    // SAFETY: the mapping is read-only and private; the file must not be truncated while it is
    // mapped (documented at `--mmap`), the one way a mapping's bytes can fail to be there.
    let map = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("cannot map the model {}", path.display()))?;
    Ok((path, ModelBytes::Mapped(map)))
}

/// SmolLM2 under `EXPERTKV_MODELS_DIR` or `models/`.
fn default_model() -> std::path::PathBuf {
    let dir = std::env::var("EXPERTKV_MODELS_DIR").unwrap_or_else(|_| "models".into());
    std::path::Path::new(&dir).join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

pub fn run(gpu: &GpuArgs, a: &RunArgs) -> Result<()> {
    let (path, bytes) = open_model(a.model.as_deref(), a.mmap)?;
    let g = Gguf::parse(&bytes).with_context(|| format!("{} is not a readable GGUF file", path.display()))?;
    let tok = Tokenizer::from_gguf(&g).context("the model's tokenizer")?;
    let batch = crate::batch::prompts(a.batch, a.prompts.as_deref())?;
    // With --prompts, the longest prompt sizes the context and the budget.
    let prompt = match &batch {
        Some(prompts) => crate::batch::longest(&tok, prompts)?,
        None => tok.encode_prompt(&a.prompt, true).map_err(|e| anyhow::anyhow!("--prompt: {e}"))?,
    };
    if prompt.is_empty() {
        bail!("--prompt is empty");
    }
    let dtype = KvDtype::parse(&a.dtype)?;
    let codec = a.codec.as_deref().map_or(Ok(Codec::None), Codec::parse)?;
    let scheduler = match a.scheduler.as_deref() {
        None | Some("none") => None,
        Some(spec) => {
            let budget = Budget::parse(&a.budget)?.tokens(prompt.len() as u32 + a.tokens);
            Some((SchedulerConfig::parse_for_budget(spec, budget)?, budget))
        }
    };
    let moe = match a.moe.as_deref() {
        Some(spec) => parse_moe(spec)?,
        None => None,
    };
    let threshold = a.threshold.as_deref().map_or(Ok(Default::default()), crate::demo::parse_threshold)?;
    let labels = a.routing.labels_spec()?;
    if moe.is_some() && labels.is_some() {
        bail!("--labels labels a dense FFN's tokens; with --moe the MoEfied FFN's own router labels them (give one)");
    }
    // The route stage's source: a MoE file's router, else --moe's or --labels'; the stage runs
    // when a routing option asks for it (RoutingArgs::routing).
    let lc = LlamaConfig::from_gguf(&g)?;
    let shape = if lc.expert_count > 0 {
        Some((lc.expert_count, lc.expert_used_count))
    } else {
        moe.as_ref().or(labels.as_ref()).map(|s| (s.config.experts as u32, s.config.top_k as u32))
    };
    let routing = a.routing.routing(shape)?;
    let expert_cache = a.experts.config(&lc)?;
    if a.experts.policy()?.1 != ExpertPrefetch::None && a.experts.expert_slots.is_none() && a.gpu_mem.is_none() {
        bail!("--expert-prefetch fetches into an expert cache: give --expert-slots or --gpu-mem too");
    }
    if a.gpu_mem.is_some() && expert_cache.is_some() {
        bail!("--gpu-mem sets the expert slots from the budget: give it or --expert-slots, not both");
    }
    if a.recall_bounds > 0 && a.recall.is_none() {
        bail!("--recall-bounds shares out the recall tier's candidates: give --recall PAGES too");
    }
    // An unreachable or misconfigured store is refused before the model loads. Under FlexGen
    // it is the tier below host memory; otherwise prompts share their prefix pages through it.
    let flexgen = matches!(scheduler, Some((SchedulerConfig::FlexGen, _)));
    let spill = if flexgen { a.store.spill()? } else { None };
    let mut kv_store = if flexgen { None } else { a.store.connect(&bytes, a.moe.as_deref().unwrap_or("dense"))? };
    let rt = gpu.runtime()?;
    println!("adapter: {} ({:?})", rt.info.name, rt.info.backend);
    let context = prompt.len() as u32 + a.tokens + 1 + a.time_steps;
    let opts = ModelOptions::new(a.batch, context)
        .dtype(dtype)
        .scheduler(scheduler.clone())
        .codec(codec)
        .routing(routing)
        .pyramid(a.pyramid)
        .threshold(threshold)
        .expert_cache(expert_cache)
        .recall(a.recall)
        .recall_bounds(a.recall_bounds)
        .prefill_chunk(a.prefill_chunk);
    // One budget for the pool and the experts: split before loading, measured after.
    let (opts, mut gpu_mem) = match a.gpu_mem.as_deref() {
        Some(spec) => {
            let budget = crate::store::parse_bytes(spec).with_context(|| format!("--gpu-mem {spec}"))?;
            let (o, p) = crate::gpu_mem::plan(budget, &g, &lc, opts, a.experts.policy()?, rt.max_binding_bytes())?;
            (o, Some(p))
        }
        None => (opts, None),
    };
    let t0 = std::time::Instant::now();
    let mut m = pollster::block_on(GpuLlama::load(&rt, &g, opts)).context("loading the model onto the GPU")?;
    if let Some(p) = &mut gpu_mem {
        p.measure(&m)?;
        println!("{}", p.line());
    }
    if let Some(file) = &a.trace {
        if a.time_steps > 0 {
            bail!("--trace records the run's passes; --time-steps times passes outside it: give one or the other");
        }
        let out = std::fs::File::create(file).with_context(|| format!("--trace: cannot create {}", file.display()))?;
        let (e, k) = shape.unwrap_or((0, 0));
        let args: Vec<String> = std::env::args().skip(1).collect();
        let header = ModelTraceHeader::new(
            &path.display().to_string(),
            expertkv_core::digest::hash64(&bytes),
            [lc.block_count, e, k, a.batch],
            &args.join(" "),
        );
        m.record_trace(TraceSink::new(Box::new(std::io::BufWriter::new(out)), &header)?);
    }
    if a.verify_evictions {
        if m.kv.scheduler.is_none() {
            bail!(
                "--verify-evictions checks an evicting scheduler's evictions: give --scheduler (h2o, streaming-llm, lru, lru-plus, adakv, duo, fastv-tokens)"
            );
        }
        m.verify_evictions = true;
    }
    let c = m.cfg.clone();
    let arch = c.arch.name();
    let ffn = if c.expert_count > 0 {
        let gating = match c.expert_gating() {
            expertkv_model::Gating::Unit => "each weighing 1 (MoEfied)",
            expertkv_model::Gating::Softmax => "softmax-weighted",
            expertkv_model::Gating::SoftmaxShare => "weighted by their share of the softmax",
        };
        let shared = if c.arch.shared_expert() { format!(", a shared expert of {}", c.shared_feed_forward_length) } else { String::new() };
        format!("{} experts of {}, top-{} {gating}{shared}", c.expert_count, c.feed_forward_length, c.expert_used_count)
    } else {
        c.feed_forward_length.to_string()
    };
    println!(
        "model: {} ({arch}, {} layers, hidden {}, {}/{} heads x {}, FFN {ffn}, vocab {}), loaded in {:.2} s; KV pool {} ({})",
        path.display(),
        c.block_count,
        c.embedding_length,
        c.head_count,
        c.head_count_kv,
        c.head_dim,
        c.vocab_size,
        t0.elapsed().as_secs_f64(),
        fmt_bytes(m.kv.pool.cfg.page_bytes() * u64::from(m.kv.pool.cfg.n_pages)),
        dtype.name()
    );
    if moe.is_some() && c.expert_count > 0 {
        bail!(
            "--moe MoEfies a dense model's FFNs; {} is a MoE file with {} experts per layer and its own router (drop --moe)",
            path.display(),
            c.expert_count
        );
    }
    if let Some(spec) = &moe {
        let mc = &spec.config;
        let Moefied { moe: experts, how } = Moefier::new(&g, &bytes, &path).moefy(spec)?;
        m.set_moe(&rt, &g, &experts).context("uploading the experts")?;
        if let Some(spec) = &a.router {
            pollster::block_on(m.set_moe_router(&rt, RouterConfig::parse(spec)?))?;
        }
        println!(
            "moefied: {} experts per layer, top-{} per token ({:.0}% of the FFN's neurons evaluated), {how}; router: {}",
            mc.experts,
            mc.top_k,
            100.0 * experts.fraction_evaluated(),
            m.moe_router().map_or_else(
                || experts.fitted.map_or("the centroid scores' top k".to_string(), |n| format!("fitted on {n} calibration tokens, top k")),
                |r| r.name().to_string()
            )
        );
    } else if let Some(spec) = &a.router {
        if c.expert_count == 0 {
            bail!("--router chooses experts: give --moe E:K too (or a MoE file)");
        }
        pollster::block_on(m.set_moe_router(&rt, RouterConfig::parse(spec)?))?;
        println!("router: {} over the file's own experts", spec);
    }
    if let Some(spec) = &labels {
        let Moefied { moe: experts, how } = Moefier::new(&g, &bytes, &path).moefy(spec)?;
        m.set_labels(&rt, &experts).context("the labelling router")?;
        println!("labels: {} experts per layer, top-{} per token, the FFN dense; {how}", spec.config.experts, spec.config.top_k);
    }
    if let (Some((tier, limit)), Some((fg, _))) = (spill, m.kv.flexgen.as_mut()) {
        fg.set_spill(Box::new(tier), limit)?;
    }
    if let (Some(_), Some(why)) = (&kv_store, m.prefix_refusal()) {
        bail!("--kv-store restores a prefix where a prefill would have put it, which needs raw pages and no policy between tokens: {why}");
    }
    if let Some(prompts) = &batch {
        let opts = BatchOptions { tokens: a.tokens, json: a.json, time_steps: a.time_steps };
        crate::batch::run(&rt, &mut m, &tok, prompts, kv_store.as_mut(), opts)?;
        if let Some((fg, _)) = m.kv.flexgen.as_mut() {
            fg.release_spilled();
        }
        return Ok(());
    }
    print!("{}", a.prompt);
    std::io::stdout().flush()?;
    let mut tm = TextModel::new(m, tok)?;
    if a.profile && !tm.llama_mut().time_stages(&rt) {
        bail!("--profile: this adapter cannot write GPU timestamps between passes");
    }
    let t1 = std::time::Instant::now();
    // The prompt's longest stored prefix, fetched instead of prefilled (part of the TTFT).
    let cached = match &mut kv_store {
        Some(s) => s.fetch(&rt, tm.llama_mut(), 0, &prompt)? as usize,
        None => 0,
    };
    let mut first_piece = None;
    let mut piece_times = Vec::new();
    let opts = GenerateOptions { max_tokens: a.tokens, stop_at_eos: true };
    // The prompt's full pages go to the store for the next process once the first token is
    // out, written by a thread while this one decodes.
    let mut stored = Ok(false);
    let out = pollster::block_on(tm.generate_after_prefix(
        &rt,
        &a.prompt,
        cached,
        &opts,
        |p| {
            first_piece.get_or_insert_with(std::time::Instant::now);
            piece_times.push(std::time::Instant::now());
            print!("{}", p.text);
            std::io::stdout().flush().is_ok()
        },
        |m| {
            if let Some(s) = &mut kv_store {
                stored = s.store_in_background(&rt, m, 0, &prompt).map(|()| true);
            }
        },
    ))?;
    let m = tm.llama();
    let generated = out.tokens;
    // The first token comes straight from the prompt's last logits: prefill ends there.
    let t2 = first_piece.unwrap_or_else(std::time::Instant::now);
    let prefill_s = (t2 - t1).as_secs_f64();
    let decode_s = t2.elapsed().as_secs_f64();
    // Waiting for the store's writer is not decoding (its start, a read of the prompt's pages
    // after the first token, is).
    if let Some(s) = &mut kv_store {
        if !stored? {
            s.store(&rt, m, 0, &prompt)?;
        }
        s.finish();
    }
    println!();
    if let (Some(s), Some((cfg, budget))) = (&m.kv.scheduler, &scheduler) {
        let lists = pollster::block_on(s.read_lists(&rt))?;
        let evicted: u64 = lists.iter().map(|l| u64::from(l.evicted_total)).sum();
        let checked = if a.verify_evictions { "; every eviction equal to the CPU reference's" } else { "" };
        let thaw = match pollster::block_on(s.read_thaw(&rt))? {
            Some(t) => format!(
                "; {} compressed pages thawed for evictions{}",
                t.pages_total,
                if t.deferred_rings_total > 0 {
                    format!(", {} ring evictions deferred for want of raw pages", t.deferred_rings_total)
                } else {
                    String::new()
                }
            ),
            None => String::new(),
        };
        println!("scheduler {}: {budget} tokens per (layer, KV head); {evicted} token K/V evicted over the run{thaw}{checked}", cfg.name());
    }
    if let Some((fg, _)) = &m.kv.flexgen {
        println!("{}", crate::demo::flexgen_line(&fg.stats));
        let t = m.transfer_totals();
        if m.expert_cache().is_some() {
            println!(
                "one transfer schedule: {} of {} steps that moved anything moved K/V pages and experts together ({} pages, {} experts on demand, {} ahead; {} to the GPU)",
                t.steps_moving_both,
                t.steps_moving,
                t.pages,
                t.experts,
                t.experts_ahead,
                crate::fmt_bytes(t.page_bytes + t.expert_bytes + t.ahead_bytes)
            );
        }
    }
    if let Some(line) = crate::routing::summary(&rt, m)? {
        println!("{line}");
    }
    if let Some((e, _)) = m.moe_shape() {
        // How evenly the router spread the tokens: per layer, the busiest expert's share.
        let counts = m.expert_counts();
        let e = e as usize;
        let shares: Vec<f64> =
            counts.chunks(e).map(|c| *c.iter().max().unwrap_or(&0) as f64 / c.iter().sum::<u64>().max(1) as f64).collect();
        let mean = shares.iter().sum::<f64>() / shares.len().max(1) as f64;
        println!(
            "routing: the busiest expert of a layer took {:.0}% of its slots on average (an even spread: {:.0}%)",
            100.0 * mean,
            100.0 / e as f64
        );
    }
    // Raw and compressed pages, and their bytes as allocated (with a low-rank codec's basis).
    let ctl = pollster::block_on(m.kv.pool.read_ctl(&rt))?;
    let pc = &m.kv.pool.cfg;
    let used = pc.pages_in_use(&ctl);
    let bytes = pollster::block_on(m.kv_bytes_in_use(&rt))?;
    println!(
        "prefill: {} tokens{} in {:.2} s; decode: {} tokens in {:.2} s ({:.2} tokens/s, one submission per token, \
{} dispatches per token); context: {} tokens x {} layers; K/V pages in use: {used} ({})",
        prompt.len(),
        if cached > 0 { format!(" ({cached} of them fetched from the page store)") } else { String::new() },
        prefill_s,
        generated.len(),
        decode_s,
        generated.len() as f64 / decode_s.max(1e-9),
        m.dispatches_per_step(),
        m.positions[0],
        c.block_count,
        fmt_bytes(bytes)
    );
    if let Some(s) = &kv_store {
        crate::store::warn_failed(&s.report);
        println!("{}", crate::store::report_line(&s.report, prompt.len()));
    }
    if let Some(ec) = m.expert_cache() {
        let t = ec.total;
        println!(
            "experts: {} of {} slots per layer on the GPU ({}; all {} in host memory, {}); {} hits, {} misses ({:.0}% hit rate), {} moved host-to-GPU",
            ec.cfg.slots,
            c.expert_count,
            fmt_bytes(ec.gpu_bytes()),
            c.expert_count,
            fmt_bytes(ec.host_bytes()),
            t.hits,
            t.misses,
            100.0 * t.hit_rate(),
            fmt_bytes(t.bytes)
        );
        if ec.cfg.prefetch != ExpertPrefetch::None {
            println!(
                "prefetch ({}): {} experts fetched ahead, {} of them then chosen ({:.0}%)",
                ec.cfg.prefetch.name(),
                t.prefetched,
                t.prefetch_used,
                100.0 * t.prefetch_used as f64 / t.prefetched.max(1) as f64
            );
        }
    }
    if let Some(r) = m.expert_reuse().filter(|r| r.references() > 0) {
        // Fewer slots than one step's choices cannot exist.
        let k = m.moe_shape().map_or(1, |(_, k)| k);
        let least = expertkv_model::experts::min_slots(a.batch, k, r.by_rank.len() as u32);
        let rates: Vec<String> =
            (least..=r.by_rank.len() as u32).map(|s| format!("{s}: {:.0}%", 100.0 * r.hits(s) as f64 / r.references() as f64)).collect();
        println!("expert reuse (decode steps' routing; an LRU cache's hit rate at each number of slots per layer): {}", rates.join(", "));
    }
    // Time per output token: between consecutive tokens reaching the host (p50, p99 nearest rank).
    let mut gaps: Vec<f64> = piece_times.windows(2).map(|w| (w[1] - w[0]).as_secs_f64() * 1e3).collect();
    gaps.sort_by(f64::total_cmp);
    let rank = |q: f64| gaps[((q * gaps.len() as f64).ceil() as usize).clamp(1, gaps.len()) - 1];
    let tpot = (!gaps.is_empty()).then(|| (rank(0.5), rank(0.99)));
    if a.json {
        let line = serde_json::json!({
            "prompt_ids": prompt,
            "generated_ids": generated,
            "text": out.text,
            "stop": format!("{:?}", out.stop),
            "prefill_s": prefill_s,
            "prefill_tokens_per_s": (prompt.len() - cached) as f64 / prefill_s.max(1e-9),
            "prefill_chunked": m.chunked_prefill_refusal().is_none() && prompt.len() > 1,
            "prefill_chunk": a.prefill_chunk,
            "ttft_s": prefill_s,
            "tpot_ms_p50": tpot.as_ref().map(|t| t.0),
            "tpot_ms_p99": tpot.as_ref().map(|t| t.1),
            "decode_s": decode_s,
            "tokens_per_s": generated.len() as f64 / decode_s.max(1e-9),
            "dispatches_per_token": m.dispatches_per_step(),
            "dispatches_per_layer": m.dispatches_per_step() as f64 / f64::from(c.block_count),
            "kv_pages_in_use": used,
            "kv_bytes_in_use": bytes,
            "expert_cache": m.expert_cache().map(expert_cache_json),
            "flexgen": m.kv.flexgen.as_ref().map(|(fg, _)| &fg.stats),
            "recall": m.kv.recall.as_ref().map(|t| serde_json::json!({
                "pages": t.cfg.pages, "host_memory": t.host_memory, "host_bytes": t.host_bytes(), "gpu_bytes": t.gpu_bytes(),
                "digest_bytes": t.digest_bytes(),
            })),
            "transfers": m.transfer_totals(),
            "expert_reuse": m.expert_reuse().map(|r| serde_json::json!({
                "references": r.references(),
                "cold": r.cold,
                "lru_hits_by_slots": (1..=r.by_rank.len() as u32).map(|s| r.hits(s)).collect::<Vec<_>>(),
            })),
            "kv_store": kv_store.as_ref().map(|s| &s.report),
            "gpu_mem": gpu_mem,
            "adapter": rt.info.name,
        });
        println!("{line}");
    }
    if a.profile {
        let stages = tm.llama_mut().stage_times();
        println!("{}", serde_json::json!({ "measure": "gpu_stages", "prefill": stages["prefill"], "decode": stages["decode"] }));
    }
    if a.time_steps > 0 {
        let token = generated.last().copied().unwrap_or(prompt[prompt.len() - 1]);
        let r = pollster::block_on(tm.llama_mut().time_steps(&rt, token, a.time_steps))?;
        println!("{r}");
    }
    // FlexGen's pages in the page store are this run's only: removed as it ends.
    if let Some((fg, _)) = tm.llama_mut().kv.flexgen.as_mut() {
        fg.release_spilled();
    }
    Ok(())
}

/// The expert tiers' sizes and traffic, as `run --json` reports them.
fn expert_cache_json(c: &ExpertCache) -> serde_json::Value {
    let t = c.total;
    serde_json::json!({
        "slots_per_layer": c.cfg.slots,
        "policy": c.cfg.policy.name(),
        "prefetch": c.cfg.prefetch.name(),
        "prefetched": t.prefetched,
        "prefetch_used": t.prefetch_used,
        "gpu_bytes": c.gpu_bytes(),
        "host_bytes": c.host_bytes(),
        "hits": t.hits,
        "misses": t.misses,
        "hit_rate": t.hit_rate(),
        "bytes_moved": t.bytes,
    })
}
