//! `expertkv mix`: one GPU budget split between K/V pages and expert slots, request by request,
//! over a mix of short and long requests: the joint controller against fixed splits (see
//! `expertkv_model::budget`) at equal total memory.
//!
//! The model is loaded once. Every request (a random prompt fed token by token, then `--tokens`
//! more) gets its policy's split and the model is re-balanced for it
//! ([`GpuLlama::reconfigure`]: the pool rebuilt, the expert slots too when their count changes),
//! the weights kept. The online split is told only the prompt: when the context fills its pool,
//! the model is re-balanced mid-request ([`GpuLlama::reconfigure_live`], the K/V carried
//! across) and the wait counts in that step's time. The bytes the pool and the slots allocate
//! are measured for every request (and every growth) and must be within the total. The policies
//! run interleaved, request by request (after a run with every expert resident), each from empty
//! slots, so drift in the machine's speed falls on every policy alike; `--repeat` runs the
//! requests again.
//!
//! Quality is measured against a reference pass with the whole context and every expert in a
//! slot: each policy's decode steps are fed the reference's greedy tokens (teacher forcing), and
//! every step's logits are compared with the reference's (KL divergence, same top token). Speed
//! is the decode steps' (time per output token, p50 and p99), the prompt's (time to first token)
//! and the expert traffic, with the host-to-GPU copy bandwidth measured at the start: the
//! zero-hit bound (every routed expert copied every token) is that bandwidth over the routed
//! expert bytes per token.

use anyhow::{Context, Result, bail};
use clap::Args;
use expertkv_core::bench::{UploadPath, upload_bandwidth};
use expertkv_core::evict::config::SchedulerConfig;
use expertkv_core::rng::Rng;
use expertkv_model::LlamaConfig;
use expertkv_model::budget::{Split, SplitInputs, SplitPolicy};
use expertkv_model::experts::{ExpertBytes, ExpertCacheConfig, ExpertPolicy, ExpertTraffic, min_slots};
use expertkv_model::forward::{GpuLlama, ModelOptions, argmax};
use expertkv_model::gguf::Gguf;
use serde_json::json;

use crate::{GpuArgs, fmt_bytes};

/// `expertkv mix` (see the module docs).
#[derive(Args, Clone, Debug)]
pub struct MixArgs {
    /// A MoE GGUF file (`expertkv synth --experts 8` writes one).
    #[arg(long)]
    model: std::path::PathBuf,
    /// The GPU memory for the K/V pool and the expert slots together: bytes, or with K, M, G.
    #[arg(long)]
    gpu_mem: String,
    /// The requests: COUNTxPROMPT_TOKENS, comma-separated, served in a shuffled order.
    #[arg(long, default_value = "3x128,2x1024")]
    requests: String,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 32)]
    tokens: u32,
    /// Split policies, comma-separated: joint, online (joint told only the prompt, growing the
    /// pool as the context does), E/K shares (50/50, 0.75/0.15),
    /// experts-first:TOKENS, cell:SLOTS:PERCENT (H2O keeping PERCENT of each context).
    #[arg(long, default_value = "joint,online,50/50,0.75/0.15,experts-first:256")]
    policies: String,
    /// Which resident expert a miss replaces: lru, lfu or score.
    #[arg(long, default_value = "lru")]
    expert_policy: String,
    /// Rounds over the requests (each round runs every policy on every request).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    repeat: u32,
    /// Seed of the prompts and of the order they come in.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// One JSON line per policy (and one for the reference) after the text.
    #[arg(long)]
    json: bool,
}

/// What one request under one policy measured.
#[derive(Clone, Debug, Default, serde::Serialize)]
struct Served {
    prompt: u32,
    /// The split the request ran under (the last one, where the online split grew).
    split: Option<Split>,
    /// The online split's split at admission, where it grew or was refused mid-request.
    admitted: Option<Split>,
    /// Why the policy could not serve it within the total.
    refused: Option<String>,
    allocated: u64,
    /// Seconds re-balancing the model for this request (`GpuLlama::reconfigure`).
    rebalance_s: f64,
    /// Times the online split grew the pool mid-request, and the seconds it took
    /// (`GpuLlama::reconfigure_live`, inside the TTFT or the step that waited).
    grown: u32,
    grow_s: f64,
    ttft_s: f64,
    /// Seconds of every decode step.
    steps_s: Vec<f64>,
    /// The decode steps' expert traffic.
    traffic: ExpertTraffic,
    /// Decode steps whose logits were compared with the reference's, their KL divergence
    /// summed, and how many had the same top token.
    compared: u32,
    kl_sum: f64,
    same_top: u32,
}

/// The reference pass's greedy tokens and log-probabilities, per request.
struct Reference {
    ids: Vec<u32>,
    log_probs: Vec<Vec<f64>>,
}

fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
    let sum: f64 = logits.iter().map(|&x| (f64::from(x) - max).exp()).sum();
    let ln = sum.ln() + max;
    logits.iter().map(|&x| f64::from(x) - ln).collect()
}

/// KL(p || q) of two log-probability vectors.
fn kl(p: &[f64], q: &[f64]) -> f64 {
    p.iter().zip(q).map(|(&a, &b)| if a.is_finite() { a.exp() * (a - b) } else { 0.0 }).sum::<f64>().max(0.0)
}

fn parse_requests(spec: &str) -> Result<Vec<u32>> {
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (n, len) = part.split_once('x').with_context(|| format!("--requests {spec}: `{part}` is not COUNTxTOKENS"))?;
        let n: u32 = n.parse().with_context(|| format!("--requests: `{n}` is not a count"))?;
        let len: u32 = len.parse().with_context(|| format!("--requests: `{len}` is not a token count"))?;
        if n == 0 || len == 0 || n > 1000 {
            bail!("--requests {spec}: `{part}` needs 1 to 1000 requests of at least one token");
        }
        out.extend(std::iter::repeat_n(len, n as usize));
    }
    if out.is_empty() {
        bail!("--requests: give at least one COUNTxTOKENS");
    }
    Ok(out)
}

fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * q).round() as usize]
}

/// How [`serve`] grows the pool when a request's context fills it (the online split): the
/// split for a live context of this many tokens and the options that make it, within `total`.
struct Grow<'a> {
    split: &'a dyn Fn(u32) -> anyhow::Result<(Split, ModelOptions)>,
    total: u64,
}

/// The bytes `m`'s pool and slots allocate, which must be `split`'s and within `total`.
fn allocated_as_planned(m: &GpuLlama, split: &Split, total: u64, what: &str) -> Result<u64> {
    let allocated = m.kv_bytes_allocated() + m.expert_bytes_allocated();
    if allocated > total || allocated != split.bytes() {
        bail!("{what} allocated {allocated} bytes where {} were planned within {total}", split.bytes());
    }
    Ok(allocated)
}

/// Feed `prompt` token by token, then decode `tokens` steps: greedy, or fed the reference's
/// tokens and compared with its logits. With `grow`, a context that fills the pool re-balances
/// the model there (`GpuLlama::reconfigure_live`, its seconds counted in the step that waited);
/// a growth the total cannot hold ends the request as refused. The model comes back either way.
fn serve(
    rt: &expertkv_core::Runtime,
    mut m: GpuLlama,
    prompt: &[u32],
    tokens: u32,
    reference: Option<&Reference>,
    grow: Option<Grow<'_>>,
) -> Result<(GpuLlama, Served, Option<Reference>)> {
    let cache = |m: &GpuLlama| m.expert_cache().map(|c| c.total).unwrap_or_default();
    let mut s = Served { prompt: prompt.len() as u32, ..Default::default() };
    // Before each token: room for it in the pool, made by growing it when there is a `grow`.
    let room = |m: GpuLlama, s: &mut Served| -> Result<(GpuLlama, bool)> {
        let (Some(grow), true) = (&grow, m.positions[0] >= m.max_context()) else { return Ok((m, true)) };
        // Only the total refuses a growth; options the model cannot take are a bug, not a refusal.
        let (split, opts) = match (grow.split)(m.positions[0] + 1) {
            Ok(p) => p,
            Err(why) => {
                s.refused = Some(format!("at token {}: {why}", m.positions[0]));
                return Ok((m, false));
            }
        };
        m.check_reconfigure_live(&opts)?;
        let t = std::time::Instant::now();
        let m = pollster::block_on(m.reconfigure_live(rt, opts))?;
        rt.wait()?;
        s.grow_s += t.elapsed().as_secs_f64();
        s.grown += 1;
        s.split = Some(split);
        let allocated = allocated_as_planned(&m, &split, grow.total, &format!("growing to {} tokens", split.pool_tokens))?;
        s.allocated = s.allocated.max(allocated);
        Ok((m, true))
    };
    let t0 = std::time::Instant::now();
    let mut logits = Vec::new();
    for &t in prompt {
        let ok;
        (m, ok) = room(m, &mut s)?;
        if !ok {
            return Ok((m, s, None));
        }
        logits = pollster::block_on(m.forward(rt, &[t]))?;
    }
    s.ttft_s = t0.elapsed().as_secs_f64();
    let before = cache(&m);
    let mut own = Reference { ids: Vec::new(), log_probs: Vec::new() };
    for i in 0..tokens as usize {
        let lp = log_softmax(&logits);
        let next = match reference {
            Some(r) => {
                s.compared += 1;
                s.kl_sum += kl(&r.log_probs[i], &lp);
                // The reference decoded greedily: its token is its top token.
                s.same_top += u32::from(argmax(&logits) == r.ids[i]);
                r.ids[i]
            }
            None => {
                let t = argmax(&logits);
                own.ids.push(t);
                own.log_probs.push(lp);
                t
            }
        };
        if i + 1 == tokens as usize {
            break;
        }
        let t = std::time::Instant::now();
        let ok;
        (m, ok) = room(m, &mut s)?;
        if !ok {
            return Ok((m, s, None));
        }
        logits = pollster::block_on(m.forward(rt, &[next]))?;
        s.steps_s.push(t.elapsed().as_secs_f64());
    }
    let after = cache(&m);
    s.traffic = ExpertTraffic {
        hits: after.hits - before.hits,
        misses: after.misses - before.misses,
        bytes: after.bytes - before.bytes,
        prefetched: after.prefetched - before.prefetched,
        prefetch_used: after.prefetch_used - before.prefetch_used,
    };
    Ok((m, s, reference.is_none().then_some(own)))
}

/// A policy's requests summed: decode tokens/s, p50/p99 time per output token, mean time to
/// first token, hit rate, MB moved per decode token, KL and top-token agreement.
fn summary(served: &[&Served]) -> serde_json::Value {
    let ok: Vec<&&Served> = served.iter().filter(|s| s.refused.is_none()).collect();
    let steps: Vec<f64> = ok.iter().flat_map(|s| s.steps_s.iter().copied()).collect();
    let time: f64 = steps.iter().sum();
    let t = ok.iter().fold(ExpertTraffic::default(), |mut t, s| {
        t.add(&s.traffic);
        t
    });
    let compared: u32 = ok.iter().map(|s| s.compared).sum();
    json!({
        "served": ok.len(),
        "refused": served.len() - ok.len(),
        "tokens_per_s": steps.len() as f64 / time.max(1e-12),
        "tpot_p50_ms": percentile(&steps, 0.5) * 1e3,
        "tpot_p99_ms": percentile(&steps, 0.99) * 1e3,
        "ttft_mean_s": ok.iter().map(|s| s.ttft_s).sum::<f64>() / ok.len().max(1) as f64,
        "hit_rate": t.hit_rate(),
        "mb_per_token": t.bytes as f64 / 1e6 / steps.len().max(1) as f64,
        "mean_kl": if compared > 0 { ok.iter().map(|s| s.kl_sum).sum::<f64>() / f64::from(compared) } else { 0.0 },
        "same_top": if compared > 0 { f64::from(ok.iter().map(|s| s.same_top).sum::<u32>()) / f64::from(compared) } else { 1.0 },
        "peak_allocated": ok.iter().map(|s| s.allocated).max().unwrap_or(0),
        "rebalance_mean_ms": ok.iter().map(|s| s.rebalance_s).sum::<f64>() * 1e3 / ok.len().max(1) as f64,
        "grown": ok.iter().map(|s| s.grown).sum::<u32>(),
        "grow_mean_ms": ok.iter().map(|s| s.grow_s).sum::<f64>() * 1e3 / f64::from(ok.iter().map(|s| s.grown).sum::<u32>().max(1)),
    })
}

pub fn run(gpu: &GpuArgs, a: &MixArgs) -> Result<()> {
    let total = crate::store::parse_bytes(&a.gpu_mem).with_context(|| format!("--gpu-mem {}", a.gpu_mem))?;
    let policies: Vec<SplitPolicy> = a.policies.split(',').map(|p| SplitPolicy::parse(p.trim())).collect::<Result<_, _>>()?;
    let lens = parse_requests(&a.requests)?;
    if a.tokens == 0 {
        bail!("--tokens: generate at least one token a request");
    }
    let policy = ExpertPolicy::from_name(&a.expert_policy)?;
    let bytes = std::fs::read(&a.model).with_context(|| format!("cannot read {}", a.model.display()))?;
    let g = Gguf::parse(&bytes).with_context(|| format!("{} is not a GGUF file", a.model.display()))?;
    let c = LlamaConfig::from_gguf(&g)?;
    let Some(eb) = ExpertBytes::of(&g, &c)? else {
        bail!(
            "mix splits the budget between K/V and expert slots: {} has a dense FFN (expertkv synth --experts 8 writes a MoE file)",
            a.model.display()
        );
    };
    let longest = lens.iter().max().copied().unwrap_or(0) + a.tokens;
    if longest > c.context_length {
        bail!("--requests/--tokens: a request of {longest} tokens is past the model's context of {}", c.context_length);
    }
    let (e, k) = (c.expert_count, c.expert_used_count);
    let rt = gpu.runtime()?;
    println!("adapter: {} ({:?})", rt.info.name, rt.info.backend);
    // The prompts and their order.
    let mut rng = Rng::new(a.seed);
    let mut prompts: Vec<Vec<u32>> = lens.iter().map(|&l| (0..l).map(|_| rng.below(c.vocab_size)).collect()).collect();
    for i in (1..prompts.len()).rev() {
        prompts.swap(i, rng.below(i as u32 + 1) as usize);
    }
    let probe = (64u64 << 20).min(rt.max_binding_bytes() / 2);
    let bw = pollster::block_on(upload_bandwidth(&rt, UploadPath::HostCopy, probe, 1, 5))?;
    let bw = probe as f64 / (bw.median_ms / 1e3);
    let routed = u64::from(k) * eb.per_slot;
    let zero_hit = bw / routed as f64;
    println!(
        "model: {} ({} layers, {e} experts of {} a slot across the layers, top {k}); host-to-GPU copies {:.1} GB/s, so {:.1} tokens/s if every routed expert ({}) were copied every token",
        a.model.display(),
        c.block_count,
        fmt_bytes(eb.per_slot),
        bw / 1e9,
        zero_hit,
        fmt_bytes(routed)
    );
    let h2o = SchedulerConfig::default_for("h2o")?;
    let max_binding = rt.max_binding_bytes();
    let kv_bytes = |tokens: u32, budget: Option<u32>| {
        ModelOptions::new(1, tokens.max(1)).scheduler(budget.map(|b| (h2o.clone(), b))).kv_bytes(&c, max_binding)
    };
    let inputs =
        SplitInputs { total, experts: eb, n_experts: e, least: min_slots(1, k, e), max_context: c.context_length, kv_bytes: &kv_bytes };
    let options = |s: &Split| {
        ModelOptions::new(1, s.pool_tokens)
            .scheduler(s.h2o_budget.map(|b| (h2o.clone(), b)))
            .expert_cache(Some(ExpertCacheConfig::on_demand(s.slots, policy)))
    };
    // The reference: whole contexts, every expert in a slot (outside the budget).
    let all = Split { slots: e, pool_tokens: longest, h2o_budget: None, kv_bytes: 0, expert_bytes: eb.with_slots(e) };
    let t = std::time::Instant::now();
    let mut m = pollster::block_on(GpuLlama::load(&rt, &g, options(&all))).context("loading the model onto the GPU")?;
    println!(
        "loaded in {:.2} s; {} requests ({}), {} tokens generated each, budget {}",
        t.elapsed().as_secs_f64(),
        lens.len(),
        a.requests,
        a.tokens,
        fmt_bytes(total)
    );
    let mut references = Vec::new();
    let mut reference_served = Vec::new();
    for p in &prompts {
        m = pollster::block_on(m.reconfigure(&rt, options(&all)))?;
        let (back, s, r) = serve(&rt, m, p, a.tokens, None, None)?;
        m = back;
        references.push(r.context("the reference pass keeps its tokens")?);
        reference_served.push(s);
    }
    let refs: Vec<&Served> = reference_served.iter().collect();
    let reference_row = summary(&refs);
    println!(
        "reference (whole contexts, every expert in a slot, outside the budget): {:.1} tokens/s, TTFT {:.3} s",
        reference_row["tokens_per_s"].as_f64().unwrap_or(0.0),
        reference_row["ttft_mean_s"].as_f64().unwrap_or(0.0)
    );
    // Policies interleaved request by request (the all-resident run first), every run from
    // empty slots, so drift in the machine's speed falls on every policy alike.
    let mut served: Vec<Vec<Served>> = vec![Vec::new(); policies.len()];
    let mut resident = Vec::new();
    for round in 0..a.repeat {
        for (i, p) in prompts.iter().enumerate() {
            m = pollster::block_on(m.reconfigure(&rt, options(&all)))?;
            m.empty_expert_slots(&rt);
            let (back, s, _) = serve(&rt, m, p, a.tokens, Some(&references[i]), None)?;
            m = back;
            resident.push(s);
            for (pol, out) in policies.iter().zip(&mut served) {
                // Online is told the prompt and its first token; the others the whole request.
                let context = if *pol == SplitPolicy::Online { p.len() as u32 + 1 } else { p.len() as u32 + a.tokens };
                // A split the policy cannot make, or the model cannot take, is that request refused.
                let planned = pol.split(&inputs, context).and_then(|s| m.check_reconfigure(&options(&s)).map(|()| s));
                let split = match planned {
                    Ok(s) => s,
                    Err(why) => {
                        println!("  {:<18} round {round} request {i} ({:>5} tokens): refused: {why}", pol.spec(), p.len());
                        out.push(Served { prompt: p.len() as u32, refused: Some(why.to_string()), ..Default::default() });
                        continue;
                    }
                };
                let t = std::time::Instant::now();
                m = pollster::block_on(m.reconfigure(&rt, options(&split)))?;
                m.empty_expert_slots(&rt);
                rt.wait()?;
                let rebalance_s = t.elapsed().as_secs_f64();
                let allocated = allocated_as_planned(&m, &split, total, &format!("{}: request {i}", pol.spec()))?;
                let grow = |context: u32| -> Result<(Split, ModelOptions)> {
                    let s = pol.grow(&inputs, context)?;
                    Ok((s, options(&s)))
                };
                let online = (*pol == SplitPolicy::Online && split.h2o_budget.is_none()).then_some(Grow { split: &grow, total });
                let (back, mut s, _) = serve(&rt, m, p, a.tokens, Some(&references[i]), online)?;
                m = back;
                s.admitted = (s.grown > 0 || s.refused.is_some()).then_some(split);
                if let Some(why) = &s.refused {
                    println!("  {:<18} round {round} request {i} ({:>5} tokens): refused {why}", pol.spec(), p.len());
                    out.push(s);
                    continue;
                }
                s.split = s.split.or(Some(split));
                s.allocated = s.allocated.max(allocated);
                s.rebalance_s = rebalance_s;
                let split = s.split.unwrap_or(split);
                let kv = split.h2o_budget.map_or("whole".to_string(), |b| format!("h2o {b}"));
                let grew = if s.grown > 0 {
                    format!(
                        " (grown {} times to {} tokens, {:.1} ms each)",
                        s.grown,
                        split.pool_tokens,
                        s.grow_s * 1e3 / f64::from(s.grown)
                    )
                } else {
                    String::new()
                };
                let tps = s.steps_s.len() as f64 / s.steps_s.iter().sum::<f64>().max(1e-12);
                println!(
                    "  {:<18} round {round} request {i} ({:>5} tokens): {} slots, K/V {kv:<10} {} + {} = {}{grew}; {tps:.1} tokens/s, TTFT {:.3} s, hits {:.0}%, KL {:.2e}",
                    pol.spec(),
                    p.len(),
                    split.slots,
                    fmt_bytes(split.kv_bytes),
                    fmt_bytes(split.expert_bytes),
                    fmt_bytes(split.bytes()),
                    s.ttft_s,
                    100.0 * s.traffic.hit_rate(),
                    s.kl_sum / f64::from(s.compared.max(1))
                );
                out.push(s);
            }
        }
    }
    let resident_row = summary(&resident.iter().collect::<Vec<_>>());
    let resident_tps = resident_row["tokens_per_s"].as_f64().unwrap_or(f64::NAN);
    println!(
        "{:<18} {resident_tps:.1} tokens/s ({:.2}x the zero-hit bound), TPOT p50 {:.2} ms p99 {:.2} ms, TTFT {:.3} s (whole contexts, every expert in a slot: outside the budget)",
        "all resident",
        resident_tps / zero_hit,
        resident_row["tpot_p50_ms"].as_f64().unwrap_or(0.0),
        resident_row["tpot_p99_ms"].as_f64().unwrap_or(0.0),
        resident_row["ttft_mean_s"].as_f64().unwrap_or(0.0),
    );
    let mut rows = Vec::new();
    for (pol, served) in policies.iter().zip(served) {
        let all_rows: Vec<&Served> = served.iter().collect();
        let short_len = lens.iter().min().copied().unwrap_or(0);
        let (short, long): (Vec<&Served>, Vec<&Served>) = served.iter().partition(|s| s.prompt == short_len);
        let row = json!({
            "policy": pol.spec(),
            "all": summary(&all_rows),
            "short": summary(&short),
            "long": summary(&long),
            "requests": served,
        });
        let s = &row["all"];
        let tps = s["tokens_per_s"].as_f64().unwrap_or(0.0);
        if s["served"].as_u64() == Some(0) {
            println!("{:<18} every request refused within {}", pol.spec(), fmt_bytes(total));
            rows.push(row);
            continue;
        }
        println!(
            "{:<18} {:.1} tokens/s ({:.2}x the zero-hit bound, {:.2}x all resident), TPOT p50 {:.2} ms p99 {:.2} ms, TTFT {:.3} s, hits {:.0}%, {:.1} MB/token, KL {:.2e}, same top token {:.1}%, peak {} of {}, re-balanced in {:.1} ms; {} refused",
            pol.spec(),
            tps,
            tps / zero_hit,
            tps / resident_tps,
            s["tpot_p50_ms"].as_f64().unwrap_or(0.0),
            s["tpot_p99_ms"].as_f64().unwrap_or(0.0),
            s["ttft_mean_s"].as_f64().unwrap_or(0.0),
            100.0 * s["hit_rate"].as_f64().unwrap_or(0.0),
            s["mb_per_token"].as_f64().unwrap_or(0.0),
            s["mean_kl"].as_f64().unwrap_or(0.0),
            100.0 * s["same_top"].as_f64().unwrap_or(0.0),
            fmt_bytes(s["peak_allocated"].as_u64().unwrap_or(0)),
            fmt_bytes(total),
            s["rebalance_mean_ms"].as_f64().unwrap_or(0.0),
            s["refused"]
        );
        rows.push(row);
    }
    if a.json {
        let meta = json!({"measure": "mix", "model": a.model.display().to_string(), "adapter": rt.info.name, "gpu_mem": total, "requests": a.requests,
            "tokens": a.tokens, "seed": a.seed, "host_copy_bytes_per_s": bw, "zero_hit_tokens_per_s": zero_hit, "slot_bytes": eb.per_slot,
            "experts": e, "top_k": k, "repeat": a.repeat, "reference": reference_row, "all_resident": resident_row});
        println!("{meta}");
        for r in rows {
            println!("{}", json!({"measure": "mix_policy", "zero_hit_tokens_per_s": zero_hit, "row": r}));
        }
    }
    Ok(())
}
