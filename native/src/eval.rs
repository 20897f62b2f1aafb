//! `expertkv eval`: a real model's quality under each scheduler and budget, against its full
//! cache: perplexity over a text (teacher forcing), the share of positions whose greedy token
//! equals the full cache's, and a needle-retrieval check (a fact planted before filler text,
//! asked for after it). Writes a table, JSON lines and, with --plot, a PNG.

use anyhow::{Context, Result, bail};
use clap::Args;
use expertkv_core::config::Codec;
use expertkv_core::evict::config::{Budget, SchedulerConfig};
use expertkv_core::route::config::RouterConfig;
use expertkv_core::runtime::Runtime;
use expertkv_model::Moefication;
use expertkv_model::forward::{GpuLlama, ModelOptions, argmax};
use expertkv_model::gguf::Gguf;
use expertkv_model::tokenizer::Tokenizer;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::{GpuArgs, fmt_bytes};

/// The text the project ships for perplexity (written for expertkv; no license attached).
const SHIPPED_TEXT: &str = include_str!("../data/eval.txt");
const NEEDLE: &str = "The secret number is 7291.";
const NEEDLE_QUESTION: &str = " The secret number is";
const NEEDLE_ANSWER: &str = "7291";

#[derive(Args)]
pub struct EvalArgs {
    /// A UTF-8 text file to measure perplexity on [default: the text the project ships].
    #[arg(long)]
    text: Option<std::path::PathBuf>,
    /// Tokens of the text to use (from its start).
    #[arg(long, default_value_t = 128)]
    tokens: u32,
    /// Schedulers: comma-separated names or name:key=value,... specs (a `key=value` after a comma
    /// belongs to the spec before it); the full cache always runs first as the reference.
    #[arg(long, default_value = "h2o:sinks=4,window=16,streaming-llm:sinks=4")]
    schedulers: String,
    /// Budgets: tokens per (layer, KV head), or shares of the evaluated context (`25%` of
    /// --tokens), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64,32")]
    budgets: Vec<String>,
    /// Filler tokens (from the text) between the planted fact and the question; 0 skips the
    /// needle check.
    #[arg(long, default_value_t = 64)]
    needle_filler: u32,
    /// Page codecs to add, full cache each: int8, int4 (with :group=G), fastv-dims (with
    /// :keep=D), low-rank or lora (with :rank=R; the basis is fitted on the text's first 64
    /// tokens, which stay raw until then), comma-separated [default: none].
    #[arg(long, default_value = "")]
    codecs: String,
    /// MoEfied models to add, full cache each: E:K or E:K:fitted specs, comma-separated (for
    /// example 8:2,8:2:fitted,16:4; see `run --moe`) [default: none].
    #[arg(long, value_delimiter = ',')]
    moe: Vec<String>,
    /// With --moe, or a MoE file: also score each MoEfied model (or the file's own experts) with
    /// these of the pipeline's routers choosing its experts (hash, topk, load-balance, entropy,
    /// adaptive, hierarchical; comma-separated) [default: the router scores' plain top k only].
    #[arg(long, value_delimiter = ',')]
    moe_routers: Vec<String>,
    /// The model [default: models/SmolLM2-135M-Instruct.Q4_1.gguf].
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// Also draw perplexity against K/V bytes into this folder.
    #[arg(long, value_name = "DIR")]
    plot: Option<std::path::PathBuf>,
    /// One JSON object per configuration instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Row {
    /// `dense`, `E8 k2` (MoEfied) or `own E8 k2` (a MoE file's experts), then the pipeline's
    /// router when one chooses the experts.
    ffn: String,
    /// The page codec (`none`: f16 pages).
    codec: String,
    scheduler: String,
    /// Tokens kept per (layer, KV head).
    budget: Option<u32>,
    /// The budget as given: tokens, or a share of the context (`25%`).
    budget_spec: Option<String>,
    tokens: usize,
    perplexity: f64,
    /// Share of positions whose greedy (argmax) token equals the full cache's.
    greedy_agreement: f64,
    /// K/V bytes of the pool's pages in use at the end of the text.
    kv_bytes: u64,
    needle_found: Option<bool>,
    needle_answer: Option<String>,
    /// MoEfied: the share of a layer's routing slots its busiest expert took, averaged over the
    /// layers (an even spread is 1 / E).
    busiest_expert: Option<f64>,
}

fn nll(logits: &[f32], target: u32) -> f64 {
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = f64::from(m) + logits.iter().map(|x| f64::from(x - m).exp()).sum::<f64>().ln();
    lse - f64::from(logits[target as usize])
}

struct Outcome {
    perplexity: f64,
    greedy: Vec<u32>,
    kv_bytes: u64,
    busiest_expert: Option<f64>,
}

/// One evaluated configuration: the FFN (dense, MoEfied, or a MoE file's own experts) and the
/// cache policy.
#[derive(Clone)]
struct Config {
    moe: Option<std::sync::Arc<Moefication>>,
    /// A MoE file's own experts, `(E, k)`.
    own: Option<(u32, u32)>,
    /// With `moe` or `own`: the pipeline's router choosing the experts (none: the plain top k).
    router: Option<RouterConfig>,
    sched: Option<(SchedulerConfig, u32)>,
    /// The budget as given (`64`, `25%`), with `sched`.
    budget: Option<Budget>,
    codec: Codec,
}

impl Config {
    fn ffn(&self) -> String {
        let router = self.router.as_ref().map_or(String::new(), |r| format!(" {}", r.name()));
        match (&self.moe, self.own) {
            (Some(m), _) => format!("E{} k{}{}{router}", m.config.experts, m.config.top_k, if m.fitted.is_some() { " fitted" } else { "" }),
            (None, Some((e, k))) => format!("own E{e} k{k}{router}"),
            (None, None) => "dense".into(),
        }
    }

    fn load(&self, rt: &Runtime, g: &Gguf<'_>, context: u32) -> Result<GpuLlama> {
        let mut m =
            pollster::block_on(GpuLlama::load(rt, g, ModelOptions::new(1, context).scheduler(self.sched.clone()).codec(self.codec)))?;
        if let Some(moe) = &self.moe {
            m.set_moe(rt, g, moe)?;
        }
        if let Some(r) = &self.router {
            pollster::block_on(m.set_moe_router(rt, r.clone()))?;
        }
        Ok(m)
    }
}

fn score(rt: &Runtime, g: &Gguf<'_>, ids: &[u32], c: &Config, bar: &ProgressBar) -> Result<Outcome> {
    let mut m = c.load(rt, g, ids.len() as u32 + 1)?;
    let mut total = 0.0;
    let mut greedy = Vec::new();
    for (i, &t) in ids.iter().enumerate() {
        let logits = pollster::block_on(m.forward(rt, &[t]))?;
        greedy.push(argmax(&logits));
        if let Some(&next) = ids.get(i + 1) {
            total += nll(&logits, next);
        }
        bar.inc(1);
    }
    let kv_bytes = pollster::block_on(m.kv_bytes_in_use(rt))?;
    let busiest_expert = m.moe_shape().map(|(e, _)| {
        let shares: Vec<f64> = m
            .expert_counts()
            .chunks(e as usize)
            .map(|c| *c.iter().max().unwrap_or(&0) as f64 / c.iter().sum::<u64>().max(1) as f64)
            .collect();
        shares.iter().sum::<f64>() / shares.len().max(1) as f64
    });
    Ok(Outcome { perplexity: (total / (ids.len() - 1) as f64).exp(), greedy, kv_bytes, busiest_expert })
}

fn needle(rt: &Runtime, g: &Gguf<'_>, prompt: &[u32], tok: &Tokenizer, c: &Config, bar: &ProgressBar) -> Result<String> {
    let mut m = c.load(rt, g, prompt.len() as u32 + 8)?;
    let mut logits = Vec::new();
    for &t in prompt {
        logits = pollster::block_on(m.forward(rt, &[t]))?;
        bar.inc(1);
    }
    // SmolLM2 writes digits one token each: room for a space and the four digits and a bit.
    let mut out = Vec::new();
    for i in 0..6 {
        let next = argmax(&logits);
        out.push(next);
        if i < 5 {
            logits = pollster::block_on(m.forward(rt, &[next]))?;
        }
    }
    Ok(String::from_utf8_lossy(&tok.decode_bytes(&out)?).into_owned())
}

/// Split `a:k=1,v=2,b,c:x=3` into `a:k=1,v=2`, `b`, `c:x=3`.
pub fn split_specs(list: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match out.last_mut() {
            Some(last) if part.contains('=') && !part.contains(':') && last.contains(':') => {
                last.push(',');
                last.push_str(part);
            }
            _ => out.push(part.to_string()),
        }
    }
    out
}

pub fn run(gpu: &GpuArgs, a: &EvalArgs) -> Result<()> {
    let (path, bytes) = crate::run::read_model(a.model.as_deref())?;
    let g = Gguf::parse(&bytes).with_context(|| format!("{} is not a readable GGUF file", path.display()))?;
    let tok = Tokenizer::from_gguf(&g).context("the model's tokenizer")?;
    let text = match &a.text {
        Some(p) => std::fs::read_to_string(p).with_context(|| format!("--text: cannot read {} as UTF-8", p.display()))?,
        None => SHIPPED_TEXT.to_string(),
    };
    if let Some((at, c)) = tok.unencodable(&text) {
        bail!("--text: character {c:?} at byte {at} has no token in this model's vocabulary");
    }
    let all = tok.encode(&text);
    if all.len() < 2 || a.tokens < 2 {
        bail!("the text needs at least 2 tokens (it has {}, --tokens {})", all.len(), a.tokens);
    }
    let ids: Vec<u32> = all.iter().copied().take(a.tokens as usize).collect();
    if (a.tokens as usize) > all.len() && !a.json {
        println!("note: the text has {} tokens, fewer than --tokens {}", all.len(), a.tokens);
    }
    let lc = expertkv_model::LlamaConfig::from_gguf(&g)?;
    let own = (lc.expert_count > 0).then_some((lc.expert_count, lc.expert_used_count));
    let base = Config { moe: None, own, router: None, sched: None, budget: None, codec: Codec::None };
    let mut configs = vec![base.clone()];
    for s in split_specs(&a.schedulers).iter().filter(|s| s.as_str() != "none") {
        let sc = SchedulerConfig::parse(s)?;
        for spec in &a.budgets {
            let budget = Budget::parse(spec)?;
            let b = budget.tokens(ids.len() as u32);
            sc.validate(b)?;
            configs.push(Config { sched: Some((sc.clone(), b)), budget: Some(budget), ..base.clone() });
        }
    }
    for spec in split_specs(&a.codecs).iter().filter(|s| s.as_str() != "none") {
        let codec = Codec::parse(spec)?;
        configs.push(Config { codec, ..base.clone() });
    }
    let mut moes = Vec::new();
    for spec in &a.moe {
        if let Some(mc) = crate::run::parse_moe(spec)? {
            moes.push(mc);
        }
    }
    if let Some((e, _)) = own {
        if !moes.is_empty() {
            bail!("--moe MoEfies a dense model's FFNs; {} is a MoE file with {e} experts per layer and its own router", path.display());
        }
        for spec in a.moe_routers.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
            configs.push(Config { router: Some(RouterConfig::parse(spec)?), ..base.clone() });
        }
    } else if moes.is_empty() && a.moe_routers.iter().any(|s| !s.trim().is_empty()) {
        bail!("--moe-routers choose experts: give --moe E:K too (or a MoE file)");
    }
    {
        // The f32 weights and the calibration are dropped before the GPU runs.
        let mut moefier = crate::run::Moefier::new(&g, &bytes, &path);
        for spec in &moes {
            let crate::run::Moefied { moe: m, how } = moefier.moefy(spec)?;
            if !a.json {
                println!("moefied E={} k={}: {how}", spec.config.experts, spec.config.top_k);
            }
            let m = std::sync::Arc::new(m);
            configs.push(Config { moe: Some(m.clone()), ..base.clone() });
            for spec in a.moe_routers.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
                configs.push(Config { moe: Some(m.clone()), router: Some(RouterConfig::parse(spec)?), ..base.clone() });
            }
        }
    }
    let needle_prompt: Vec<u32> = if a.needle_filler > 0 {
        let mut p = tok.encode(NEEDLE);
        p.extend(all.iter().copied().take(a.needle_filler as usize));
        p.extend(tok.encode(NEEDLE_QUESTION));
        p
    } else {
        Vec::new()
    };
    let rt = gpu.runtime()?;
    if !a.json {
        println!(
            "adapter: {} ({:?}); model {}; {} text tokens, needle after {} filler tokens",
            rt.info.name,
            rt.info.backend,
            path.display(),
            ids.len(),
            a.needle_filler
        );
    }
    let total = configs.len() as u64 * (ids.len() + needle_prompt.len()) as u64;
    let bar = if a.json { ProgressBar::hidden() } else { ProgressBar::new(total) };
    bar.set_style(ProgressStyle::with_template("eval {bar:40} {pos}/{len} tokens {msg}").unwrap_or_else(|_| ProgressStyle::default_bar()));
    let mut rows = Vec::new();
    let mut reference: Option<Vec<u32>> = None;
    for c in &configs {
        let name =
            format!("{}, {}", c.ffn(), c.sched.as_ref().map_or("none (full cache)".to_string(), |(s, b)| format!("{} @ {b}", s.name())));
        bar.set_message(name.clone());
        let o = score(&rt, &g, &ids, c, &bar).with_context(|| format!("scoring {name}"))?;
        let reference_greedy = reference.get_or_insert_with(|| o.greedy.clone());
        let agree = o.greedy.iter().zip(reference_greedy.iter()).filter(|(x, y)| x == y).count() as f64 / o.greedy.len() as f64;
        let answer = if needle_prompt.is_empty() {
            None
        } else {
            Some(needle(&rt, &g, &needle_prompt, &tok, c, &bar).with_context(|| format!("needle of {name}"))?)
        };
        let row = Row {
            ffn: c.ffn(),
            codec: c.codec.spec(),
            scheduler: c.sched.as_ref().map_or("none".into(), |(s, _)| s.name().to_string()),
            budget: c.sched.as_ref().map(|(_, b)| *b),
            budget_spec: c.budget.map(|b| b.to_string()),
            tokens: ids.len(),
            perplexity: o.perplexity,
            greedy_agreement: agree,
            kv_bytes: o.kv_bytes,
            needle_found: answer.as_ref().map(|s| s.contains(NEEDLE_ANSWER)),
            needle_answer: answer,
            busiest_expert: o.busiest_expert,
        };
        if a.json {
            println!("{}", serde_json::to_string(&row)?);
        }
        rows.push(row);
    }
    bar.finish_and_clear();
    if !a.json {
        println!("| FFN | codec | scheduler | budget | perplexity | greedy agreement | K/V in use | needle | busiest expert |");
        println!("|---|---|---|---|---|---|---|---|---|");
        for r in &rows {
            println!(
                "| {} | {} | {} | {} | {:.2} | {:.1}% | {} | {} | {} |",
                r.ffn,
                r.codec,
                r.scheduler,
                match (r.budget, &r.budget_spec) {
                    (Some(b), Some(spec)) if *spec != b.to_string() => format!("{spec} ({b})"),
                    (Some(b), _) => b.to_string(),
                    (None, _) => "all".into(),
                },
                r.perplexity,
                100.0 * r.greedy_agreement,
                fmt_bytes(r.kv_bytes),
                match (&r.needle_found, &r.needle_answer) {
                    (Some(f), Some(s)) => format!("{} ({s:?})", if *f { "found" } else { "missed" }),
                    _ => "-".into(),
                },
                r.busiest_expert.map_or("-".into(), |b| format!("{:.0}%", 100.0 * b))
            );
        }
    }
    if let Some(dir) = &a.plot {
        let points: Vec<crate::plot::Point> = rows
            .iter()
            .map(|r| crate::plot::Point {
                label: format!("{} {}", r.scheduler, r.budget.map_or("all".into(), |b| b.to_string())),
                series: if r.ffn != configs[0].ffn() {
                    r.ffn.clone()
                } else if r.codec != "none" {
                    format!("codec {}", r.codec)
                } else {
                    r.scheduler.clone()
                },
                kv_bytes: r.kv_bytes as f64,
                gpu_ms: 0.0,
                error: r.perplexity,
            })
            .collect();
        let title = format!("{} tokens of text, {}", ids.len(), path.file_name().and_then(|f| f.to_str()).unwrap_or("model"));
        for p in crate::plot::write_perplexity(dir, &title, &points)? {
            if !a.json {
                println!("plot: {}", p.display());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::split_specs;

    #[test]
    fn moe_specs_parse_or_say_why_not() {
        use crate::run::parse_moe;
        let s = parse_moe("8:2").unwrap().unwrap();
        assert_eq!((s.config.experts, s.config.top_k, s.fitted), (8, 2, false));
        assert!(parse_moe(" 16:4:fitted ").unwrap().unwrap().fitted);
        assert_eq!(parse_moe("dense").unwrap(), None);
        for bad in ["8", "2:3", "8:2:fit", "8:2:fitted:x", "a:b", "0:0"] {
            assert!(parse_moe(bad).unwrap_err().to_string().contains("--moe"), "{bad}");
        }
    }

    #[test]
    fn specs_split_at_names_not_at_parameters() {
        assert_eq!(split_specs("h2o:sinks=4,window=16,streaming-llm:sinks=4"), ["h2o:sinks=4,window=16", "streaming-llm:sinks=4"]);
        assert_eq!(split_specs("none, h2o ,lru"), ["none", "h2o", "lru"]);
        assert_eq!(split_specs(""), Vec::<String>::new());
    }
}
