//! `expertkv soak`: the pool, attention, an evicting scheduler and a page codec (either or both)
//! decoding for many steps with continuous churn: every sequence finishes at a random length and frees its
//! pages, and a new one takes its slot at position 0. Every `--check-every` steps the pool is
//! read back and its invariants checked (`PoolSnapshot::check_invariants`: every page free or in
//! one ring, free + used = total, no token lost or duplicated, fills consistent); host RSS, the
//! GPU memory the device reports (where the backend reports it) and steps per second are
//! recorded per window, so leaks and slowdowns show as trends.

use std::collections::HashSet;

use anyhow::{Result, bail};
use clap::Args;
use expertkv_core::append::KvPool;
use expertkv_core::append::format::{NewToken, encode_values};
use expertkv_core::append::invariants::TokenId;
use expertkv_core::attend::{AttendOptions, Attention};
use expertkv_core::config::{Codec, KvDtype, PoolConfig, ShardMap};
use expertkv_core::evict::Scheduler;
use expertkv_core::evict::config::{SchedulerConfig, Threshold};
use expertkv_core::rng::Rng;
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
pub(crate) struct Window {
    pub(crate) step: u32,
    /// Tokens (x KV heads) cached now, and pages in use.
    pub(crate) cached: usize,
    pub(crate) pages_in_use: u32,
    /// Sequences finished so far.
    pub(crate) finished: u64,
    pub(crate) steps_per_s: f64,
    pub(crate) host_rss_mib: f64,
    /// GPU memory the device reports allocated, where the backend reports it.
    pub(crate) gpu_allocated_mib: Option<f64>,
}

impl Window {
    /// The window as a row of the soak's table.
    pub(crate) fn row(&self) -> String {
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

pub(crate) fn rss_mib() -> f64 {
    // Resident pages are the second field of /proc/self/statm.
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|p| p.parse::<f64>().ok()))
        .map_or(f64::NAN, |pages| pages * 4096.0 / (1024.0 * 1024.0))
}

pub fn run(gpu: &GpuArgs, a: &SoakArgs) -> Result<()> {
    let (min_len, max_len) = match a.lengths.split_once(':').map(|(x, y)| (x.trim().parse::<u32>(), y.trim().parse::<u32>())) {
        Some((Ok(x), Ok(y))) if 1 <= x && x <= y => (x, y),
        _ => bail!("--lengths: expected MIN:MAX with 1 <= MIN <= MAX, got `{}`", a.lengths),
    };
    if a.steps == 0 || a.check_every == 0 || a.seqs == 0 || a.layers == 0 || a.kv_heads == 0 {
        bail!("--steps, --check-every, --seqs, --layers and --kv-heads must be at least 1");
    }
    if let Some(model) = &a.model {
        if max_len < 4 {
            bail!("--lengths: a model soak needs sequences of at least 4 tokens");
        }
        return crate::soak_model::run(gpu, a, model, (min_len, max_len));
    }
    let sched = match a.scheduler.as_str() {
        "none" => None,
        s => Some(SchedulerConfig::parse_for_budget(s, a.budget)?),
    };
    let codec = a.codec.as_deref().map_or(Ok(Codec::None), Codec::parse)?;
    if let Some(s) = &sched {
        if !s.uses_evict_kernels() {
            bail!("--scheduler {}: the soak runs the evicting schedulers (h2o, streaming-llm, lru, lru-plus, adakv, duo)", s.name());
        }
        s.validate(a.budget)?;
    }
    if codec.is_low_rank() {
        bail!("--codec {}: the low-rank codecs need a calibration the soak does not run; use int8, int4 or fastv-dims", codec.name());
    }
    let page = 16;
    let ring = max_len.div_ceil(page) + 2;
    let lists = a.layers * a.seqs * a.kv_heads;
    let mut cfg = PoolConfig {
        layers: a.layers,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        page_size: page,
        dtype: KvDtype::F16,
        n_pages: lists * ring,
        max_seqs: a.seqs,
        n_shards: 1,
        ring_capacity: ring + 1,
        top_k: 1,
        shard_map: ShardMap::ByExpert,
        max_buffer_bytes: None,
        codec: Codec::None,
        codec_pages: 0,
    };
    if codec != Codec::None {
        // Raw pages for each list's newest page, one to spare, and (under eviction) the pages
        // an eviction thaws.
        let thaw = if sched.is_some() { 3 } else { 0 };
        (cfg.codec, cfg.codec_pages, cfg.n_pages) = (codec, lists * ring, lists * (3 + thaw));
    }
    cfg.validate()?;
    let rt = gpu.runtime()?;
    let mut pool = pollster::block_on(KvPool::new(&rt, cfg.clone()))?;
    let group = 2;
    let attn = pollster::block_on(Attention::new(
        &rt,
        &pool,
        AttendOptions { group, n_seqs: a.seqs, chunk_pages: 8, mass: sched.is_some(), ..Default::default() },
    ))?;
    let scheduler = match &sched {
        Some(s) => Some(pollster::block_on(Scheduler::new(&rt, &pool, s.clone(), a.budget, Threshold::default()))?),
        None => None,
    };
    if !a.json {
        println!(
            "adapter: {} ({:?}); soak: {} steps, {} sequences of {min_len}..={max_len} tokens, {} layers x {} KV heads x {}, {}; pool {} pages ({} MiB)",
            rt.info.name,
            rt.info.backend,
            a.steps,
            a.seqs,
            a.layers,
            a.kv_heads,
            a.head_dim,
            match (&sched, codec) {
                (Some(s), Codec::None) => format!("{} keeping {} tokens", s.name(), a.budget),
                (Some(s), c) => format!("{} keeping {} tokens in {} pages", s.name(), a.budget, c.spec()),
                (None, Codec::None) => "full cache".into(),
                (None, c) => format!("codec {}", c.spec()),
            },
            cfg.n_ids(),
            pool.kv_bytes_allocated() / (1 << 20)
        );
        println!("| step | cached | pages in use | finished | steps/s | host RSS | GPU allocated |");
        println!("|---|---|---|---|---|---|---|");
    }
    let mut rng = Rng::new(a.seed);
    let draw = |rng: &mut Rng| min_len + rng.below(max_len - min_len + 1);
    let mut positions = vec![0u32; a.seqs as usize];
    let mut targets: Vec<u32> = (0..a.seqs).map(|_| draw(&mut rng)).collect();
    let mut appended: HashSet<TokenId> = HashSet::new();
    // Evictions compact rings (their order is not checked); every ring under a scheduler.
    let compacted: HashSet<usize> = if sched.is_some() { (0..cfg.n_keys() as usize).collect() } else { HashSet::new() };
    let q_len = (a.seqs * a.kv_heads * group * a.head_dim) as usize;
    let (mut finished, mut window_start, mut t0) = (0u64, 0u32, std::time::Instant::now());
    let mut windows = Vec::new();
    for step in 0..a.steps {
        let mut tokens = Vec::new();
        for layer in 0..a.layers {
            for seq in 0..a.seqs {
                tokens.push(NewToken { layer, seq, position: positions[seq as usize], experts: vec![rng.below(8)], gates: vec![1.0] });
            }
        }
        let values: Vec<f32> = (0..tokens.len() * (2 * a.kv_heads * a.head_dim) as usize).map(|_| rng.normal() as f32).collect();
        let mut kv = Vec::new();
        encode_values(&values, cfg.dtype, &mut kv);
        pool.append(&rt, &tokens, &kv, step)?;
        for t in &tokens {
            for h in 0..a.kv_heads {
                appended.insert((t.layer, t.seq, h, t.position));
            }
        }
        pool.compress(&rt)?;
        pool.gather(&rt)?;
        for layer in 0..a.layers {
            let q: Vec<f32> = (0..q_len).map(|_| rng.normal() as f32).collect();
            attn.set_queries(&rt, &q)?;
            attn.run(&rt, layer, step)?;
        }
        let lens: Vec<u32> = positions.iter().map(|p| p + 1).collect();
        if let Some(s) = &scheduler {
            s.run(&rt, step, &lens)?;
        }
        for seq in 0..a.seqs as usize {
            positions[seq] += 1;
            if positions[seq] >= targets[seq] {
                pool.release_sequence(&rt, seq as u32)?;
                appended.retain(|id| id.1 != seq as u32);
                (positions[seq], targets[seq]) = (0, draw(&mut rng));
                finished += 1;
            }
        }
        if (step + 1) % a.check_every == 0 || step + 1 == a.steps {
            let ctl = pollster::block_on(pool.check_errors(&rt, tokens.len() as u32))?;
            let snap = pollster::block_on(pool.snapshot(&rt))?;
            let cached = snap
                .check_invariants(&cfg, &|id| appended.contains(&id), &compacted)
                .map_err(|e| anyhow::anyhow!("step {step}: the pool's invariants broke: {e}"))?;
            let secs = t0.elapsed().as_secs_f64();
            let w = Window {
                step: step + 1,
                cached,
                pages_in_use: cfg.pages_in_use(&ctl),
                finished,
                steps_per_s: f64::from(step + 1 - window_start) / secs.max(1e-9),
                host_rss_mib: rss_mib(),
                gpu_allocated_mib: rt.device.generate_allocator_report().map(|r| r.total_allocated_bytes as f64 / (1024.0 * 1024.0)),
            };
            if a.json {
                println!("{}", serde_json::to_string(&w)?);
            } else {
                println!("{}", w.row());
            }
            windows.push(w);
            (window_start, t0) = (step + 1, std::time::Instant::now());
        }
    }
    let (first, last) = (&windows[0], &windows[windows.len() - 1]);
    let summary = format!(
        "soak: {} steps, {} checks, the invariants held at every check; {finished} sequences finished; host RSS {:.1} -> {:.1} MiB; steps/s {:.1} -> {:.1}",
        a.steps,
        windows.len(),
        first.host_rss_mib,
        last.host_rss_mib,
        first.steps_per_s,
        last.steps_per_s
    );
    if a.json {
        println!("{}", serde_json::json!({ "summary": summary }));
    } else {
        println!("{summary}");
    }
    Ok(())
}
