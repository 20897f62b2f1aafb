//! `expertkv eval`: a real model's quality under each scheduler and budget, against its full
//! cache: perplexity over a text (teacher forcing), the share of positions whose greedy token
//! equals the full cache's, and retrieval checks (facts planted in filler text and asked for
//! later: at several depths, several in one context, and asked only in a second turn;
//! `retrieval.rs`). Writes a table, JSON lines and, with --plot, a PNG.

mod retrieval;

use anyhow::{Context, Result, bail};
use clap::Args;
use expertkv_core::config::{Codec, ShardMap};
use expertkv_core::evict::config::{Budget, SchedulerConfig, Threshold};
use expertkv_core::evict::recall::{DigestAudit, RecallConfig};
use expertkv_core::route::config::RouterConfig;
use expertkv_core::runtime::Runtime;
use expertkv_model::Moefication;
use expertkv_model::experts::ExpertCacheConfig;
use expertkv_model::forward::{GpuLlama, MODEL_PAGE_SIZE, ModelOptions, argmax};
use expertkv_model::gguf::Gguf;
use expertkv_model::labels::{KvRouting, LabelSource};
use expertkv_model::tokenizer::Tokenizer;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::{GpuArgs, fmt_bytes};

/// The text the project ships for perplexity (written for expertkv; no license attached).
const SHIPPED_TEXT: &str = include_str!("../../data/eval.txt");

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
    /// Parameters follow each method's paper unless given: H2O's recent window is half the
    /// budget.
    #[arg(long, default_value = "h2o:sinks=4,streaming-llm:sinks=4")]
    schedulers: String,
    /// PyramidKV over every scheduler: the first layer's budget over the last's [default: off].
    #[arg(long)]
    pyramid: Option<f32>,
    /// Every scheduler's utility threshold: fixed:TAU, adaptive:TARGET or adaptive:TARGET,STEP [default: fixed:0].
    #[arg(long)]
    threshold: Option<String>,
    /// Budgets: tokens per (layer, KV head), or shares of the evaluated context (`25%` of
    /// --tokens), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64,32")]
    budgets: Vec<String>,
    /// Hold the K/V bytes equal instead of the token count: shares of the full cache's pages
    /// (`25%`), comma-separated; each configuration's budget is the most tokens whose pages fit
    /// that share with its shards (every shard ring keeps a partly filled page). Replaces
    /// --budgets.
    #[arg(long, value_delimiter = ',', conflicts_with = "budgets")]
    bytes: Vec<String>,
    /// Filler tokens (from the text) the retrieval checks plant their facts in; 0 skips them.
    #[arg(long, default_value_t = 64)]
    needle_filler: u32,
    /// Where a single fact sits, one check each: shares of the filler placed before it
    /// (`20%`: a fifth of the filler, then the fact, then the rest and the question),
    /// comma-separated.
    #[arg(long, default_value = "10%,50%,90%")]
    needle_depth: String,
    /// Facts planted in one context at evenly spread depths and asked one after another, each
    /// question after the model's last answer (2 to 5; 0 or 1 skips this check).
    #[arg(long, default_value_t = 3)]
    needles: u32,
    /// The two-turn check: the context ends a first turn that the model answers, and only then
    /// is the fact (at the middle depth) asked for (`--two-turns false` skips it).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    two_turns: bool,
    /// The recall tier under every evicting scheduler, crossed: pages of each list's best
    /// evicted tokens attended at every layer (what the scheduler evicts kept in host memory
    /// where the device reads it in place), comma-separated; 0: no tier [default: 0].
    #[arg(long, value_delimiter = ',', default_value = "0")]
    recall: Vec<u32>,
    /// Of the recall tier's 32 candidate pages, how many the tier pages' key bounds nominate (an
    /// i8 minimum and maximum a key dimension a page, in device memory and counted in --bytes),
    /// the digests the rest [default: 0, the digests all].
    #[arg(long, default_value_t = 0, value_name = "N")]
    recall_bounds: u32,
    /// Page codecs to add, at the full cache and under every evicting scheduler: int8, int4
    /// (with :group=G), fastv-dims (with :keep=D), low-rank or lora (with :rank=R; the basis is
    /// fitted on the text's first 64 tokens, which stay raw until then), comma-separated; with
    /// --bytes a codec's budget counts its compressed pages' bytes [default: none].
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
    /// Dense FFNs whose tokens a MoEfication's router labels (E:K or E:K:fitted specs,
    /// comma-separated; see `run --labels`) [default: none].
    #[arg(long, value_delimiter = ',')]
    labels: Vec<String>,
    /// The route stage's routers, crossed with every source that routes (a MoE file, --moe,
    /// --labels): hash, topk, load-balance, entropy, cache-aware, adaptive, hierarchical
    /// (comma-separated) [default: topk].
    #[arg(long)]
    kv_routers: Option<String>,
    /// Shards per (layer, sequence) when the tokens are routed, a power of two.
    #[arg(long, default_value_t = 1)]
    shards: u32,
    /// Shard maps, crossed: pikv, expert, token-block (comma-separated) [default: expert].
    #[arg(long, value_delimiter = ',')]
    shard_maps: Vec<String>,
    /// Allocators, crossed with the evicting schedulers when the tokens are routed: none, ekva
    /// or ekva:floor=F,alpha=A,decay=D (`;`-free specs, comma-separated) [default: none].
    #[arg(long)]
    allocators: Option<String>,
    /// The model [default: models/SmolLM2-135M-Instruct.Q4_1.gguf].
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// Also draw perplexity against K/V bytes into this folder.
    #[arg(long, value_name = "DIR")]
    plot: Option<std::path::PathBuf>,
    /// With a MoE file: its experts in a GPU cache, as `run`'s; every row but those whose
    /// experts a pipeline router chooses (a cache fetches the plain top k) reports the cache's
    /// hits and bytes moved a token, the scores the all-resident run's, bit for bit.
    #[command(flatten)]
    experts: crate::experts_args::ExpertArgs,
    /// One JSON object per configuration instead of a table.
    #[arg(long)]
    json: bool,
    /// Write the scored text's token ids and every retrieval case (each turn's ids fed, tokens
    /// generated, the number expected) to this file as JSON, then stop before any GPU work: the
    /// same inputs for another implementation (bench/digest_reference.py).
    #[arg(long, value_name = "FILE")]
    write_cases: Option<std::path::PathBuf>,
}

#[derive(Serialize)]
struct Row {
    /// `dense`, `E8 k2` (MoEfied) or `own E8 k2` (a MoE file's experts), then the pipeline's
    /// router when one chooses the experts; `dense, labels E8 k2` when a MoEfication's router
    /// labels a dense FFN's tokens.
    ffn: String,
    /// The route stage: its router, shards and map, allocator (`-`: the tokens are not routed).
    routing: String,
    /// Where the routing labels come from.
    label_source: Option<String>,
    /// With --bytes: the share of the full cache's pages the budget was chosen for.
    bytes_share: Option<String>,
    /// The page codec (`none`: f16 pages).
    codec: String,
    scheduler: String,
    /// Pages of the recall tier each list attends at every layer (`None`: no tier).
    recall: Option<u32>,
    /// Bytes of host memory the recall tier held at the end of the text (0: none, or in device
    /// memory).
    recall_host_bytes: u64,
    /// With recall, over every scoring step, layer and list: the share of the pages the true
    /// q.k would recall (among every tier page) that the recall chose (the digests nominating,
    /// the nominees' true scores choosing).
    digest_recall: Option<f64>,
    /// ... and the share of recalls that chose the truly best page.
    digest_top_recall: Option<f64>,
    /// Tokens kept per (layer, KV head).
    budget: Option<u32>,
    /// The budget as given: tokens, or a share of the context (`25%`).
    budget_spec: Option<String>,
    tokens: usize,
    perplexity: f64,
    /// Share of positions whose greedy (argmax) token equals the full cache's.
    greedy_agreement: f64,
    /// K/V bytes of the pool's pages in use at the end of the text, and of the recall tier's
    /// key digests (device memory).
    kv_bytes: u64,
    /// Whether every retrieval check found its facts (`None`: no checks).
    needle_found: Option<bool>,
    /// The first check's first answer.
    needle_answer: Option<String>,
    /// Every retrieval check: its case, whether it found its facts, its answers.
    needles: Vec<retrieval::Found>,
    /// MoEfied: the share of a layer's routing slots its busiest expert took, averaged over the
    /// layers (an even spread is 1 / E).
    busiest_expert: Option<f64>,
    /// With the route stage and an evicting scheduler: the mean over (layer, expert) of the
    /// share of the expert's labelled tokens no longer resident.
    label_miss_rate: Option<f64>,
    /// With the route stage and a sparse FFN: the share of (token, layer) pairs whose first
    /// (pre-gated) label is the FFN's own first expert.
    label_agreement: Option<f64>,
    /// With --expert-slots: the expert cache's hit rate.
    expert_hit_rate: Option<f64>,
    /// With --expert-slots: expert weight bytes moved host-to-GPU a token, in MB.
    expert_mb_per_token: Option<f64>,
}

fn nll(logits: &[f32], target: u32) -> f64 {
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = f64::from(m) + logits.iter().map(|x| f64::from(x - m).exp()).sum::<f64>().ln();
    lse - f64::from(logits[target as usize])
}

struct Outcome {
    perplexity: f64,
    /// Host bytes the recall tier holds.
    recall_host_bytes: u64,
    /// The recall tier's digest audit over the text.
    digest: Option<DigestAudit>,
    greedy: Vec<u32>,
    kv_bytes: u64,
    busiest_expert: Option<f64>,
    label_miss_rate: Option<f64>,
    label_agreement: Option<f64>,
    /// The expert cache's hit rate and MB moved a token.
    experts: Option<(f64, f64)>,
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
    /// With --bytes: the share of the full cache's pages `sched`'s budget was chosen for.
    bytes_share: Option<Budget>,
    codec: Codec,
    /// A MoEfication whose router labels the dense FFN's tokens.
    labels: Option<std::sync::Arc<Moefication>>,
    /// The route stage.
    routing: Option<KvRouting>,
    /// PyramidKV's ratio and the utility threshold, with `sched`.
    pyramid: Option<f32>,
    threshold: Threshold,
    /// A MoE file's experts in a GPU cache (not with `router`).
    experts: Option<ExpertCacheConfig>,
    /// The recall tier's pages attended a list and layer, under an evicting `sched`.
    recall: Option<u32>,
    /// Of its candidates, those the key bounds nominate.
    recall_bounds: u32,
}

impl Config {
    fn ffn(&self) -> String {
        let router = self.router.as_ref().map_or(String::new(), |r| format!(" {}", r.name()));
        match (&self.moe, self.own) {
            (Some(m), _) => format!("E{} k{}{}{router}", m.config.experts, m.config.top_k, if m.fitted.is_some() { " fitted" } else { "" }),
            (None, Some((e, k))) => format!("own E{e} k{k}{router}"),
            (None, None) => match &self.labels {
                Some(m) => {
                    format!("dense, labels E{} k{}{}", m.config.experts, m.config.top_k, if m.fitted.is_some() { " fitted" } else { "" })
                }
                None => "dense".into(),
            },
        }
    }

    /// Where the route stage's labels come from, when the tokens are routed.
    fn label_source(&self) -> Option<LabelSource> {
        self.routing.as_ref()?;
        Some(if self.labels.is_some() {
            LabelSource::LabelsOnly
        } else if self.moe.is_some() {
            LabelSource::Moefied
        } else {
            LabelSource::MoeFile
        })
    }

    fn routing(&self) -> String {
        self.routing.as_ref().map_or("-".into(), |r| {
            let shards = if r.n_shards > 1 { format!(", {} shards by {}", r.n_shards, r.shard_map.name()) } else { String::new() };
            let alloc = if r.allocator.is_some() { ", ekva" } else { "" };
            format!("{}{shards}{alloc}", r.router.name())
        })
    }

    fn load(&self, rt: &Runtime, g: &Gguf<'_>, context: u32) -> Result<GpuLlama> {
        let mut m = pollster::block_on(GpuLlama::load(
            rt,
            g,
            ModelOptions::new(1, context)
                .scheduler(self.sched.clone())
                .codec(self.codec)
                .routing(self.routing.clone())
                .pyramid(self.sched.as_ref().and(self.pyramid))
                .threshold(if self.sched.is_some() { self.threshold } else { Threshold::default() })
                .expert_cache(self.experts.filter(|_| self.router.is_none()))
                .recall(self.recall)
                .recall_bounds(self.recall_bounds),
        ))?;
        if let Some(moe) = &self.moe {
            m.set_moe(rt, g, moe)?;
        }
        if let Some(moe) = &self.labels {
            m.set_labels(rt, moe)?;
        }
        if let Some(r) = &self.router {
            pollster::block_on(m.set_moe_router(rt, r.clone()))?;
        }
        Ok(m)
    }
}

/// The cache policies of a run: the full cache, every scheduler at every budget (tokens or a
/// share of the context; with --bytes, a share of the full cache's pages), every codec.
struct Policies {
    /// The schedulers' specs (parsed per budget: some parameters follow it).
    scheds: Vec<String>,
    budgets: Vec<Budget>,
    /// --bytes: shares of the full cache's pages.
    bytes: Vec<f64>,
    codecs: Vec<Codec>,
    /// The recall tier's pages (`None`: without), crossed with the evicting schedulers.
    recalls: Vec<Option<u32>>,
}

impl Policies {
    fn parse(a: &EvalArgs, tokens: u32) -> Result<Policies> {
        let scheds: Vec<String> = split_specs(&a.schedulers).into_iter().filter(|s| s.as_str() != "none").collect();
        let budgets = a.budgets.iter().map(|b| Budget::parse(b)).collect::<Result<Vec<_>, _>>()?;
        let mut bytes = Vec::new();
        for spec in a.bytes.iter().filter(|s| !s.trim().is_empty()) {
            match Budget::parse(spec)? {
                Budget::Share(f) => bytes.push(f),
                Budget::Tokens(_) => bail!("--bytes: give shares of the full cache's K/V bytes such as 25%, not `{spec}`"),
            }
        }
        for sc in &scheds {
            for b in &budgets {
                SchedulerConfig::parse_for_budget(sc, b.tokens(tokens))?.validate(b.tokens(tokens))?;
            }
        }
        let codecs =
            split_specs(&a.codecs).iter().filter(|s| s.as_str() != "none").map(|s| Codec::parse(s)).collect::<Result<Vec<_>, _>>()?;
        let mut recalls: Vec<Option<u32>> = a.recall.iter().map(|&r| (r > 0).then_some(r)).collect();
        recalls.dedup();
        if a.recall_bounds > 0 && recalls.iter().all(Option::is_none) {
            bail!("--recall-bounds shares out the recall tier's candidates: give --recall PAGES too");
        }
        if recalls.is_empty() {
            recalls.push(None);
        }
        Ok(Policies { scheds, budgets, bytes, codecs, recalls })
    }

    /// `src` under every policy; where it routes, every route variant under every scheduler
    /// (an allocator only under an evicting one), the first variant for the full cache and the
    /// codecs (placement alone changes no attention over the whole cache).
    fn cross(&self, src: &Config, routings: Option<Vec<KvRouting>>, tokens: u32, head_dim: u32) -> Result<Vec<Config>> {
        let first = routings.as_ref().and_then(|r| r.first()).map(|r| KvRouting { allocator: None, ..r.clone() });
        let mut out = vec![Config { routing: first.clone(), ..src.clone() }];
        for &codec in std::iter::once(&Codec::None).chain(&self.codecs) {
            for spec in &self.scheds {
                let evicting = SchedulerConfig::parse(spec)?.uses_evict_kernels();
                if codec != Codec::None && !evicting {
                    // QUEST bounds pages from their raw keys: no codec under it (said once, below).
                    continue;
                }
                let variants: Vec<Option<KvRouting>> = match &routings {
                    None => vec![None],
                    Some(v) => v.iter().filter(|r| r.allocator.is_none() || evicting).cloned().map(Some).collect(),
                };
                let recalls: Vec<Option<u32>> = if evicting { self.recalls.clone() } else { vec![None] };
                for (routing, recall) in variants.iter().flat_map(|v| recalls.iter().map(move |r| (v.clone(), *r))) {
                    if self.bytes.is_empty() {
                        for &budget in &self.budgets {
                            let b = budget.tokens(tokens);
                            let sc = SchedulerConfig::parse_for_budget(spec, b)?;
                            out.push(Config {
                                sched: Some((sc, b)),
                                budget: Some(budget),
                                routing: routing.clone(),
                                codec,
                                recall,
                                ..src.clone()
                            });
                        }
                    }
                    for &share in &self.bytes {
                        let shards = routing.as_ref().map_or(1, |r| r.n_shards);
                        // The recall tier's key digests live in device memory: their bytes come
                        // out of the budget (a tier of the whole context, as `load` sizes it).
                        // (Its pages' key bounds too, when they nominate.)
                        let side = recall.map_or(0.0, |pages| {
                            let rc = RecallConfig::new(pages, tokens + 1).with_bound_candidates(src.recall_bounds);
                            rc.digest_bytes_per_list(MODEL_PAGE_SIZE, head_dim) as f64 / f64::from(4 * MODEL_PAGE_SIZE * head_dim)
                        });
                        let b = budget_for_bytes(share, tokens, shards, codec_page_ratio(codec, head_dim), side)?;
                        let sc = SchedulerConfig::parse_for_budget(spec, b)?;
                        sc.validate(b)?;
                        let (budget, bytes_share) = (Some(Budget::Tokens(b)), Some(Budget::Share(share)));
                        out.push(Config {
                            sched: Some((sc, b)),
                            budget,
                            bytes_share,
                            routing: routing.clone(),
                            codec,
                            recall,
                            ..src.clone()
                        });
                    }
                }
            }
            if codec != Codec::None {
                out.push(Config { codec, routing: first.clone(), ..src.clone() });
            }
        }
        Ok(out)
    }
}

/// A compressed page's bytes over a raw f16 page's (1 without a codec).
fn codec_page_ratio(codec: Codec, head_dim: u32) -> f64 {
    if codec == Codec::None {
        return 1.0;
    }
    let page = MODEL_PAGE_SIZE;
    f64::from(codec.page_words(page, head_dim)) / f64::from(page * head_dim)
}

/// The most tokens per (layer, KV head) whose pages fit `share` percent of the full cache's
/// K/V bytes of a `tokens`-token context, when the list is spread over `shards` rings, a
/// compressed page takes `ratio` of a raw page's bytes and `side` raw pages' worth of device
/// bytes a list go to the recall tier's digests. Every ring keeps its newest page raw (and
/// partly filled), so a budget of b tokens holds at most `shards` raw pages and
/// `ceil(b / P) - 1` others: (target - shards) x (1 / ratio) + 1 pages of the budget (without a
/// codec: target - (shards - 1)).
fn budget_for_bytes(share: f64, tokens: u32, shards: u32, ratio: f64, side: f64) -> Result<u32> {
    let page = MODEL_PAGE_SIZE;
    let target = (f64::from(tokens.div_ceil(page)) * share / 100.0 - side).floor().max(0.0) as u32;
    if target < shards {
        bail!(
            "--bytes {share}%: {target} of the full cache's {} pages per (layer, KV head) leave none for tokens with {shards} shards (each keeps a partly filled page): raise --bytes or --tokens, or lower --shards",
            tokens.div_ceil(page)
        );
    }
    let pages = (f64::from(target - shards) / ratio).floor() as u32 + 1;
    Ok(pages * page)
}

/// The route stage's variants to cross: routers x shard maps x allocators.
struct RouteVariants {
    routers: Vec<RouterConfig>,
    maps: Vec<ShardMap>,
    allocators: Vec<Option<expertkv_core::evict::config::EkvaConfig>>,
    shards: u32,
    /// Whether any route-stage option was given.
    given: bool,
}

impl RouteVariants {
    fn parse(a: &EvalArgs) -> Result<RouteVariants> {
        let routers = match &a.kv_routers {
            Some(list) => split_specs(list).iter().map(|s| RouterConfig::parse(s)).collect::<Result<Vec<_>, _>>()?,
            None => vec![RouterConfig::Topk],
        };
        let mut maps = a
            .shard_maps
            .iter()
            .map(|s| s.trim())
            .filter(|s| !s.is_empty())
            .map(|m| ShardMap::parse(m, a.shards))
            .collect::<Result<Vec<_>, _>>()?;
        if maps.is_empty() {
            maps.push(ShardMap::ByExpert);
        }
        let allocators = match &a.allocators {
            Some(list) => {
                split_specs(list).iter().map(|s| expertkv_core::evict::config::EkvaConfig::parse(s)).collect::<Result<Vec<_>, _>>()?
            }
            None => vec![None],
        };
        if routers.is_empty() || allocators.is_empty() {
            bail!("--kv-routers and --allocators need at least one entry each");
        }
        let given = a.kv_routers.is_some() || !a.shard_maps.is_empty() || a.allocators.is_some() || a.shards != 1;
        Ok(RouteVariants { routers, maps, allocators, shards: a.shards, given })
    }

    /// Every variant for a source of `shape` (E, k).
    fn routings(&self, (e, k): (u32, u32)) -> Vec<KvRouting> {
        let mut out = Vec::new();
        for r in &self.routers {
            for &shard_map in &self.maps {
                for al in &self.allocators {
                    out.push(KvRouting { router: r.clone(), n_shards: self.shards, shard_map, allocator: *al, ..KvRouting::new(e, k) });
                }
            }
        }
        out
    }
}

fn score(rt: &Runtime, g: &Gguf<'_>, ids: &[u32], c: &Config, bar: &ProgressBar) -> Result<Outcome> {
    let mut m = c.load(rt, g, ids.len() as u32 + 1)?;
    // The digest audit finds the pages the true scores would recall too (reading every tier
    // key): the answers stay the digest's.
    if let Some(t) = m.kv.recall.as_mut() {
        t.set_audit(rt, true);
    }
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
    let digest = match &m.kv.recall {
        Some(t) => Some(pollster::block_on(t.read_audit(rt))?),
        None => None,
    };
    let kv_bytes = pollster::block_on(m.kv_bytes_in_use(rt))? + m.kv.recall.as_ref().map_or(0, |t| t.digest_bytes());
    let busiest_expert = m.moe_shape().map(|(e, _)| {
        let shares: Vec<f64> = m
            .expert_counts()
            .chunks(e as usize)
            .map(|c| *c.iter().max().unwrap_or(&0) as f64 / c.iter().sum::<u64>().max(1) as f64)
            .collect();
        shares.iter().sum::<f64>() / shares.len().max(1) as f64
    });
    let stats = pollster::block_on(m.label_stats(rt))?;
    let label_miss_rate =
        (m.kv.scheduler.is_some() && !stats.is_empty()).then(|| stats.iter().map(|s| f64::from(s.miss)).sum::<f64>() / stats.len() as f64);
    let (same, of) = m.label_agreement();
    let label_agreement = (of > 0).then(|| same as f64 / of as f64);
    let experts = m.expert_cache().map(|c| (c.total.hit_rate(), c.total.bytes as f64 / 1e6 / ids.len().max(1) as f64));
    Ok(Outcome {
        recall_host_bytes: m.kv.recall.as_ref().map_or(0, |t| t.host_bytes()),
        digest,
        perplexity: (total / (ids.len() - 1) as f64).exp(),
        greedy,
        kv_bytes,
        busiest_expert,
        label_miss_rate,
        label_agreement,
        experts,
    })
}

/// A retrieval case on a fresh model of configuration `c`, fed token by token: each turn's tokens,
/// then its answer generated greedily (fed back as it is written).
fn retrieve(
    rt: &Runtime,
    g: &Gguf<'_>,
    case: &retrieval::Case,
    tok: &Tokenizer,
    c: &Config,
    bar: &ProgressBar,
) -> Result<retrieval::Found> {
    let mut m = c.load(rt, g, case.tokens() + 1)?;
    let mut logits = Vec::new();
    let mut answers = Vec::new();
    for (ti, turn) in case.turns.iter().enumerate() {
        for &t in &turn.feed {
            logits = pollster::block_on(m.forward(rt, &[t]))?;
            bar.inc(1);
        }
        let mut out = Vec::new();
        for i in 0..turn.generate {
            let next = argmax(&logits);
            out.push(next);
            // The answer's last token is fed too when another turn follows it.
            if i + 1 < turn.generate || ti + 1 < case.turns.len() {
                logits = pollster::block_on(m.forward(rt, &[next]))?;
            }
        }
        answers.push(String::from_utf8_lossy(&tok.decode_bytes(&out)?).into_owned());
    }
    Ok(retrieval::judge(case, answers))
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
    let base = Config {
        moe: None,
        own,
        router: None,
        sched: None,
        budget: None,
        bytes_share: None,
        codec: Codec::None,
        labels: None,
        routing: None,
        pyramid: a.pyramid,
        threshold: a.threshold.as_deref().map_or(Ok(Threshold::default()), crate::demo::parse_threshold)?,
        experts: a.experts.config(&lc)?,
        recall: None,
        recall_bounds: a.recall_bounds,
    };
    let policies = Policies::parse(a, ids.len() as u32)?;
    if !policies.codecs.is_empty() && policies.scheds.iter().any(|s| SchedulerConfig::parse(s).is_ok_and(|s| !s.uses_evict_kernels())) {
        // Said, not silently dropped.
        eprintln!("note: QUEST bounds pages from their raw keys, so --codecs is crossed with the evicting schedulers only");
    }
    let variants = RouteVariants::parse(a)?;
    let mut moes = Vec::new();
    for spec in &a.moe {
        if let Some(mc) = crate::moe_spec::parse_moe(spec)? {
            moes.push(mc);
        }
    }
    let mut labels = Vec::new();
    for spec in a.labels.iter().filter(|s| !s.trim().is_empty()) {
        match crate::moe_spec::parse_moe(spec)? {
            Some(mc) => labels.push(mc),
            None => bail!("--labels: give E:K or E:K:fitted specs (the MoEfications whose routers label the tokens)"),
        }
    }
    if let Some((e, _)) = own {
        if !moes.is_empty() || !labels.is_empty() {
            bail!(
                "--moe and --labels MoEfy a dense model's FFNs; {} is a MoE file with {e} experts per layer and its own router",
                path.display()
            );
        }
    } else if moes.is_empty() && a.moe_routers.iter().any(|s| !s.trim().is_empty()) {
        bail!("--moe-routers choose experts: give --moe E:K too (or a MoE file)");
    }
    if own.is_none() && moes.is_empty() && labels.is_empty() && variants.given {
        bail!(
            "--kv-routers, --shard-maps, --allocators and --shards route the tokens: give a routing source (a MoE file, --moe or --labels)"
        );
    }
    // The sources, each crossed with the policies (and, where it routes, the route stage's
    // variants); the full cache of the first source is the reference.
    let mut sources = vec![base.clone()];
    {
        // The f32 weights and the calibration are dropped before the GPU runs.
        let mut moefier = crate::moe_spec::Moefier::new(&g, &bytes, &path);
        for (spec, as_labels) in moes.iter().map(|s| (s, false)).chain(labels.iter().map(|s| (s, true))) {
            let crate::moe_spec::Moefied { moe: m, how } = moefier.moefy(spec)?;
            if !a.json {
                println!("moefied E={} k={}: {how}", spec.config.experts, spec.config.top_k);
            }
            let m = std::sync::Arc::new(m);
            sources.push(if as_labels { Config { labels: Some(m), ..base.clone() } } else { Config { moe: Some(m), ..base.clone() } });
        }
    }
    let mut configs = Vec::new();
    for src in &sources {
        let shape = src.own.or_else(|| src.moe.as_ref().or(src.labels.as_ref()).map(|m| (m.config.experts as u32, m.config.top_k as u32)));
        configs.extend(policies.cross(src, shape.map(|s| variants.routings(s)), ids.len() as u32, lc.head_dim)?);
        // The pipeline's routers choosing the FFN's experts, full cache.
        if src.moe.is_some() || (src.own.is_some() && src.labels.is_none()) {
            for spec in a.moe_routers.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
                let routing = shape.and_then(|s| variants.routings(s).into_iter().next()).map(|r| KvRouting { allocator: None, ..r });
                configs.push(Config { router: Some(RouterConfig::parse(spec)?), routing, ..src.clone() });
            }
        }
    }
    // Budgets a layer cannot keep (PyramidKV's shallow or deep end below one page) are refused
    // before any GPU work.
    for c in &configs {
        if let Some((s, b)) = &c.sched {
            s.layer_budgets(*b, lc.block_count, c.pyramid, MODEL_PAGE_SIZE)?;
        }
    }
    let depths = retrieval::parse_depths(&a.needle_depth)?;
    if a.needle_filler as usize > all.len() {
        bail!("--needle-filler {}: the text has {} tokens of filler", a.needle_filler, all.len());
    }
    let checks = if a.needle_filler > 0 {
        retrieval::cases(&all[..a.needle_filler as usize], &depths, a.needles, a.two_turns, &|s| tok.encode(s))?
    } else {
        Vec::new()
    };
    if let Some(out) = &a.write_cases {
        let doc = serde_json::json!({ "model": path.display().to_string(), "text_ids": ids, "cases": checks });
        std::fs::write(out, serde_json::to_string(&doc)?).with_context(|| format!("--write-cases: cannot write {}", out.display()))?;
        println!("wrote {} ({} text tokens, {} retrieval cases)", out.display(), ids.len(), checks.len());
        return Ok(());
    }
    let rt = gpu.runtime()?;
    if !a.json {
        println!(
            "adapter: {} ({:?}); model {}; {} text tokens; retrieval in {} filler tokens: {}",
            rt.info.name,
            rt.info.backend,
            path.display(),
            ids.len(),
            a.needle_filler,
            if checks.is_empty() { "none".to_string() } else { checks.iter().map(|c| c.name.as_str()).collect::<Vec<_>>().join(", ") }
        );
    }
    let fed: usize = checks.iter().flat_map(|c| &c.turns).map(|t| t.feed.len()).sum();
    let total = configs.len() as u64 * (ids.len() + fed) as u64;
    let bar = if a.json { ProgressBar::hidden() } else { ProgressBar::new(total) };
    bar.set_style(ProgressStyle::with_template("eval {bar:40} {pos}/{len} tokens {msg}").unwrap_or_else(|_| ProgressStyle::default_bar()));
    let mut rows = Vec::new();
    let mut reference: Option<Vec<u32>> = None;
    for c in &configs {
        let name = format!(
            "{}, {}, routing {}",
            c.ffn(),
            c.sched.as_ref().map_or("none (full cache)".to_string(), |(s, b)| format!("{} @ {b}", s.name())),
            c.routing()
        );
        bar.set_message(name.clone());
        let o = score(&rt, &g, &ids, c, &bar).with_context(|| format!("scoring {name}"))?;
        let reference_greedy = reference.get_or_insert_with(|| o.greedy.clone());
        let agree = o.greedy.iter().zip(reference_greedy.iter()).filter(|(x, y)| x == y).count() as f64 / o.greedy.len() as f64;
        let needles = checks
            .iter()
            .map(|case| retrieve(&rt, &g, case, &tok, c, &bar).with_context(|| format!("retrieval check {} of {name}", case.name)))
            .collect::<Result<Vec<_>>>()?;
        let row = Row {
            ffn: c.ffn(),
            routing: c.routing(),
            label_source: c.label_source().map(|s| s.name().to_string()),
            bytes_share: c.bytes_share.map(|b| b.to_string()),
            label_miss_rate: o.label_miss_rate,
            label_agreement: o.label_agreement,
            codec: c.codec.spec(),
            scheduler: c.sched.as_ref().map_or("none".into(), |(s, _)| s.name().to_string()),
            recall: c.recall,
            recall_host_bytes: o.recall_host_bytes,
            digest_recall: o.digest.map(|d| d.recall()),
            digest_top_recall: o.digest.map(|d| d.top_recall()),
            budget: c.sched.as_ref().map(|(_, b)| *b),
            budget_spec: c.budget.map(|b| b.to_string()),
            tokens: ids.len(),
            perplexity: o.perplexity,
            greedy_agreement: agree,
            kv_bytes: o.kv_bytes,
            needle_found: (!needles.is_empty()).then(|| needles.iter().all(|n| n.found)),
            needle_answer: needles.first().and_then(|n| n.answers.first()).cloned(),
            needles,
            busiest_expert: o.busiest_expert,
            expert_hit_rate: o.experts.map(|e| e.0),
            expert_mb_per_token: o.experts.map(|e| e.1),
        };
        if a.json {
            println!("{}", serde_json::to_string(&row)?);
        }
        rows.push(row);
    }
    bar.finish_and_clear();
    if !a.json {
        println!(
            "| FFN | routing | codec | scheduler | budget | perplexity | greedy agreement | K/V in use | needle | busiest expert | label misses | expert cache hits, MB a token |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
        for r in &rows {
            println!(
                "| {} | {} | {} | {} | {} | {:.2} | {:.1}% | {} | {} | {} | {} | {} |",
                r.ffn,
                r.routing,
                r.codec,
                match r.recall {
                    Some(p) => format!(
                        "{}, recall {p} (digest {:.0}% of the best pages, {:.0}% of the best page)",
                        r.scheduler,
                        100.0 * r.digest_recall.unwrap_or(1.0),
                        100.0 * r.digest_top_recall.unwrap_or(1.0)
                    ),
                    None => r.scheduler.clone(),
                },
                match (r.budget, &r.budget_spec, &r.bytes_share) {
                    (Some(b), _, Some(share)) => format!("{b} ({share} of the bytes)"),
                    (Some(b), Some(spec), _) if *spec != b.to_string() => format!("{spec} ({b})"),
                    (Some(b), _, _) => b.to_string(),
                    (None, _, _) => "all".into(),
                },
                r.perplexity,
                100.0 * r.greedy_agreement,
                fmt_bytes(r.kv_bytes),
                needles_cell(&r.needles),
                r.busiest_expert.map_or("-".into(), |b| format!("{:.0}%", 100.0 * b)),
                r.label_miss_rate.map_or("-".into(), |m| format!("{:.1}%", 100.0 * m)),
                match (r.expert_hit_rate, r.expert_mb_per_token) {
                    (Some(h), Some(mb)) => format!("{:.0}%, {mb:.2}", 100.0 * h),
                    _ => "-".into(),
                }
            );
        }
    }
    if let Some(dir) = &a.plot {
        let points: Vec<crate::plot::Point> = rows
            .iter()
            .map(|r| crate::plot::Point {
                label: format!("{} {}", r.scheduler, r.budget.map_or("all".into(), |b| b.to_string())),
                series: {
                    // What sets the row apart from the reference: FFN, routing, codec, scheduler.
                    let mut parts = Vec::new();
                    if r.ffn != configs[0].ffn() {
                        parts.push(r.ffn.clone());
                    }
                    if r.routing != "-" {
                        parts.push(r.routing.clone());
                    }
                    if r.codec != "none" {
                        parts.push(format!("codec {}", r.codec));
                    }
                    if r.scheduler != "none" || parts.is_empty() {
                        parts.push(r.scheduler.clone());
                    }
                    parts.join(" / ")
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

/// The table's retrieval cell: `5/5 found`, or the count and what each missed check answered.
fn needles_cell(needles: &[retrieval::Found]) -> String {
    if needles.is_empty() {
        return "-".into();
    }
    let found = needles.iter().filter(|n| n.found).count();
    let missed: Vec<String> = needles.iter().filter(|n| !n.found).map(|n| format!("{}: {:?}", n.case, n.answers)).collect();
    if missed.is_empty() {
        format!("{found}/{} found", needles.len())
    } else {
        format!("{found}/{} found; missed {}", needles.len(), missed.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::split_specs;

    #[test]
    fn moe_specs_parse_or_say_why_not() {
        use crate::moe_spec::parse_moe;
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
