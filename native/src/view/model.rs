//! `expertkv view --model FILE`: the viewer attached to a GGUF model decoding a prompt. The
//! model's route stage labels every layer's tokens with experts (a MoE file's router, a MoEfied
//! FFN's, or by default a MoEfication's router over the dense FFN), so the panels show the
//! model's real routing as expert heat, its shards, evictions and budget split, step by step
//! (one generated token a step), beside the generated text.

use std::path::PathBuf;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use expertkv_core::Runtime;
use expertkv_core::pipeline::DemoConfig;
use expertkv_model::forward::{GpuLlama, ModelOptions, argmax};
use expertkv_model::gguf::Gguf;
use expertkv_model::labels::{KvRouting, LabelSource};
use expertkv_model::tokenizer::Tokenizer;
use expertkv_model::{LlamaConfig, Moefication};
use expertkv_viewer::state::{ExpertResidency, RunInfo, Source};
use expertkv_viewer::{Event, Snapshot, capture};

use super::driver::{Driver, RunFlags};
use crate::moe_spec::{MoeSpec, Moefied, Moefier, parse_moe};
use expertkv_model::moe::MoeConfig;

/// The flags `view` takes for a model (the policies come from the run flags: --router is the
/// route stage's router, --scheduler, --budget, --pyramid, --allocator, --codec, --shards).
#[derive(Args, Clone, Debug, Default, PartialEq)]
pub struct ModelFlags {
    /// Watch this GGUF model decode instead of the synthetic workload.
    #[arg(long, value_name = "FILE")]
    pub model: Option<PathBuf>,
    /// With --model: the text to continue.
    #[arg(long, default_value = "The capital of France is Paris. The capital of Germany is")]
    pub text: String,
    /// With --model: tokens to generate (one decode step each).
    #[arg(long, default_value_t = 32)]
    pub tokens: u32,
    /// With --model: MoEfy a dense model's FFN (E:K or E:K:fitted); its router labels the tokens.
    #[arg(long, value_name = "E:K[:fitted]")]
    pub moe: Option<String>,
    /// With --model: label a dense model's tokens with a MoEfication's router, the FFN dense
    /// [default: 8:2 for a dense model without --moe].
    #[arg(long, value_name = "E:K[:fitted]")]
    pub labels: Option<String>,
    /// With --model: how tokens map onto the shards (pikv, expert, token-block) [default: expert].
    #[arg(long)]
    pub shard_map: Option<String>,
    /// With a MoE file: its experts in a GPU cache, as `run`'s; the residency panel shows them.
    #[command(flatten)]
    pub experts: crate::experts_args::ExpertArgs,
}

/// A model run for the viewer: everything parsed and the MoEfication made before the window
/// opens, the GPU work on the worker thread.
pub struct ModelDriver {
    path: PathBuf,
    bytes: Vec<u8>,
    prompt: Vec<u32>,
    tokens: u32,
    opts: ModelOptions,
    moe: Option<(Moefication, LabelSource)>,
    source: LabelSource,
    cfg: DemoConfig,
    m: Option<GpuLlama>,
    tok: Tokenizer,
    /// The tokens generated so far (the text is decoded whole: a character may span tokens).
    generated: Vec<u32>,
    last: Vec<f32>,
}

impl ModelDriver {
    /// Check the flags and prepare the run (reads the file, tokenizes, MoEfies).
    pub fn prepare(f: &ModelFlags, run: &RunFlags) -> Result<ModelDriver> {
        let synthetic = [
            ("--config", run.config.is_some()),
            ("--steps", run.steps.is_some()),
            ("--seqs", run.seqs.is_some()),
            ("--layers", run.layers.is_some()),
            ("--prompt", run.prompt.is_some()),
            ("--kv-heads", run.kv_heads.is_some()),
            ("--group", run.group.is_some()),
            ("--head-dim", run.head_dim.is_some()),
            ("--experts", run.experts.is_some()),
            ("--top-k", run.top_k.is_some()),
            ("--page-size", run.page_size.is_some()),
            ("--seed", run.seed.is_some()),
            ("--no-verify", run.no_verify),
            ("--no-reference", run.no_reference),
        ];
        if let Some((flag, _)) = synthetic.iter().find(|(_, given)| *given) {
            bail!("{flag} shapes the synthetic workload; with --model the model sets it (use --text and --tokens for the run)");
        }
        let path = f.model.clone().ok_or_else(|| anyhow!("--model is missing"))?;
        let (path, bytes) = crate::run::read_model(Some(&path))?;
        let g = Gguf::parse(&bytes).with_context(|| format!("{} is not a readable GGUF file", path.display()))?;
        let tok = Tokenizer::from_gguf(&g).context("the model's tokenizer")?;
        if let Some((at, c)) = tok.unencodable(&f.text) {
            bail!("--text: character {c:?} at byte {at} has no token in this model's vocabulary");
        }
        let mut prompt: Vec<u32> = tok.bos().filter(|_| tok.add_bos()).into_iter().collect();
        prompt.extend(tok.encode(&f.text));
        if prompt.is_empty() || f.tokens == 0 {
            bail!("--text and --tokens: the model needs a prompt and at least one token to generate");
        }
        let lc = LlamaConfig::from_gguf(&g)?;
        let experts = f.experts.config(&lc)?;
        let (moe, labels) =
            (f.moe.as_deref().map(parse_moe).transpose()?.flatten(), f.labels.as_deref().map(parse_moe).transpose()?.flatten());
        if lc.expert_count > 0 && (moe.is_some() || labels.is_some()) {
            bail!("--moe and --labels MoEfy a dense FFN; {} is a MoE file with its own router", path.display());
        }
        if moe.is_some() && labels.is_some() {
            bail!("--moe's router labels the tokens; --labels is for a dense FFN (give one)");
        }
        // A dense model without --moe is labelled by an 8-expert MoEfication's router.
        let labels = if lc.expert_count == 0 && moe.is_none() {
            labels.or(Some(MoeSpec { config: MoeConfig::new(8, 2), fitted: false }))
        } else {
            labels
        };
        let spec = moe.as_ref().map(|s| (s, LabelSource::Moefied)).or(labels.as_ref().map(|s| (s, LabelSource::LabelsOnly)));
        let (moefied, shape, source) = match spec {
            Some((s, src)) => {
                let Moefied { moe: m, how } = Moefier::new(&g, &bytes, &path).moefy(s)?;
                println!("moefied E={} k={}: {how}", s.config.experts, s.config.top_k);
                let shape = (s.config.experts as u32, s.config.top_k as u32);
                (Some((m, src)), shape, src)
            }
            None => (None, (lc.expert_count, lc.expert_used_count), LabelSource::MoeFile),
        };
        let context = prompt.len() as u32 + f.tokens;
        // The synthetic run's vocabulary describes the model's run to the viewer (and checks
        // the policy flags as `demo` does).
        let cfg = crate::demo::Overrides {
            steps: Some(f.tokens),
            seqs: Some(1),
            layers: Some(lc.block_count),
            prompt: Some(prompt.len() as u32),
            kv_heads: Some(lc.head_count_kv),
            group: Some(lc.head_count / lc.head_count_kv.max(1)),
            head_dim: Some(lc.head_dim),
            experts: Some(shape.0),
            top_k: Some(shape.1),
            page_size: Some(expertkv_model::forward::MODEL_PAGE_SIZE),
            shards: Some(run.shards.unwrap_or(1)),
            router: Some(run.router.as_deref().unwrap_or("topk")),
            scheduler: run.scheduler.as_deref(),
            budget: run.budget.as_deref(),
            pyramid: run.pyramid,
            allocator: run.allocator.as_deref(),
            codec: run.codec.as_deref(),
            shard_map: Some(f.shard_map.as_deref().unwrap_or("expert")),
            no_verify: true,
            no_reference: true,
            ..Default::default()
        }
        .build()?;
        let budget = cfg.budget_tokens()?;
        let scheduler = match (&cfg.scheduler, budget) {
            (Some(s), Some(b)) => {
                let spec = run.scheduler.as_deref().unwrap_or(s.name());
                Some((expertkv_core::evict::config::SchedulerConfig::parse_for_budget(spec, b)?, b))
            }
            _ => None,
        };
        let routing = KvRouting {
            router: cfg.router.clone(),
            n_shards: cfg.n_shards,
            shard_map: cfg.shard_map,
            allocator: cfg.allocator,
            ..KvRouting::new(shape.0, shape.1)
        };
        let opts = ModelOptions::new(1, context)
            .scheduler(scheduler)
            .codec(cfg.codec)
            .routing(Some(routing))
            .pyramid(cfg.pyramid)
            .threshold(cfg.threshold)
            .expert_cache(experts);
        Ok(ModelDriver {
            path,
            bytes,
            prompt,
            tokens: f.tokens,
            opts,
            moe: moefied,
            source,
            cfg,
            m: None,
            tok,
            generated: Vec::new(),
            last: Vec::new(),
        })
    }

    /// The run in the synthetic run's vocabulary (what the viewer's header and panels read).
    pub fn config(&self) -> &DemoConfig {
        &self.cfg
    }
}

impl Driver for ModelDriver {
    fn steps(&self) -> u32 {
        self.tokens
    }

    fn build(&mut self, rt: &Runtime, send: &dyn Fn(Event)) -> Result<()> {
        self.m = None;
        let g = Gguf::parse(&self.bytes)?;
        let mut m = pollster::block_on(GpuLlama::load(rt, &g, self.opts.clone())).context("loading the model onto the GPU")?;
        match &self.moe {
            Some((moe, LabelSource::Moefied)) => m.set_moe(rt, &g, moe)?,
            Some((moe, _)) => m.set_labels(rt, moe)?,
            None => {}
        }
        let info = RunInfo {
            config: self.cfg.clone(),
            pool: m.kv.pool.cfg.clone(),
            budget_tokens: self.opts.scheduler.as_ref().map(|(_, b)| *b),
            adapter: format!("{} ({:?})", rt.info.name, rt.info.backend),
            source: Source::Model { path: self.path.display().to_string(), labels: self.source.name().to_string() },
        };
        send(Event::Started(Box::new(info)));
        let total = self.prompt.len() as u64;
        for (i, &t) in self.prompt.iter().enumerate() {
            self.last = pollster::block_on(m.forward(rt, &[t])).context("prefill")?;
            send(Event::Prefill { done: i as u64 + 1, total });
        }
        send(Event::Ready);
        self.generated.clear();
        self.m = Some(m);
        Ok(())
    }

    fn step(&mut self, rt: &Runtime, _step: u32) -> Result<Snapshot> {
        let m = self.m.as_mut().ok_or_else(|| anyhow!("no model loaded"))?;
        let next = argmax(&self.last);
        let counts = m.expert_counts().to_vec();
        self.last = pollster::block_on(m.forward(rt, &[next])).context("decode step")?;
        let chosen: Vec<bool> = m.expert_counts().iter().zip(&counts).map(|(a, b)| a > b).collect();
        self.generated.push(next);
        let ids: Vec<u32> = self.prompt.iter().chain(&self.generated).copied().collect();
        let text = String::from_utf8_lossy(&self.tok.decode_bytes(&ids)?).into_owned();
        let report = pollster::block_on(m.step_report(rt))?;
        let stats = pollster::block_on(m.label_stats(rt))?;
        let experts = m.label_router().map_or(0, |_| self.cfg.workload.n_experts as usize);
        let mut snap = pollster::block_on(capture::capture_pool(rt, &m.kv.pool, (&stats, experts), 0, report))?;
        snap.text = Some(text);
        snap.residency = m.expert_cache().map(|c| {
            let resident = c.resident();
            let experts = m.cfg.expert_count as usize;
            let mut on_gpu = vec![false; resident.len() * experts];
            for (l, slots) in resident.iter().enumerate() {
                for &e in slots.iter().flatten() {
                    on_gpu[l * experts + e as usize] = true;
                }
            }
            let t = |x: expertkv_model::experts::ExpertTraffic| [x.hits, x.misses, x.bytes];
            ExpertResidency {
                layers: resident.len(),
                experts,
                slots: c.cfg.slots,
                resident: on_gpu,
                chosen: chosen.clone(),
                step: t(c.last),
                total: t(c.total),
                bytes: [c.gpu_bytes(), c.host_bytes()],
                prefetch: [c.last.prefetched, c.last.prefetch_used, c.total.prefetched, c.total.prefetch_used],
                reuse: m
                    .expert_reuse()
                    .filter(|u| u.references() > 0)
                    .map(|u| {
                        let least = expertkv_model::experts::min_slots(self.opts.n_seqs, m.moe_shape().map_or(1, |s| s.1), experts as u32);
                        (least..=experts as u32).map(|s| (s, u.hits(s) as f32 / u.references() as f32)).collect()
                    })
                    .unwrap_or_default(),
            }
        });
        Ok(snap)
    }

    fn reconfigure(&mut self, _cfg: DemoConfig) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The model driver without a window, on a synthetic dense file: the run described in the
    /// viewer's terms, prefill progress to the end, and every step a snapshot with the text so
    /// far, the route stage's expert heat (labels from the default MoEfication) and the pool.
    #[test]
    fn the_model_driver_feeds_the_viewer() {
        let dir = std::env::temp_dir().join(format!("expertkv-view-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("dense.gguf");
        std::fs::write(&path, expertkv_model::SyntheticModel::dense(4).gguf()).expect("write");
        let flags = ModelFlags { model: Some(path), text: "Hello there, general Kenobi".into(), tokens: 3, ..Default::default() };
        // H2O over int4 pages: the model's evictions thaw the compressed pages they touch.
        let run = RunFlags {
            scheduler: Some("h2o".into()),
            budget: Some("16".into()),
            shards: Some(2),
            codec: Some("int4".into()),
            ..Default::default()
        };
        let mut d = ModelDriver::prepare(&flags, &run).expect("prepare");
        assert_eq!((d.config().workload.n_experts, d.config().workload.top_k, d.config().steps), (8, 2, 3));
        let rt = pollster::block_on(Runtime::new(expertkv_core::RuntimeOptions::from_env().expect("options"))).expect("runtime");
        let events = std::sync::Mutex::new(Vec::new());
        d.build(&rt, &|e| events.lock().expect("lock").push(e)).expect("build");
        let events = events.into_inner().expect("events");
        assert!(
            matches!(&events[0], Event::Started(i) if matches!(&i.source, Source::Model { labels, .. } if labels.contains("labels only")))
        );
        assert!(matches!(events.last(), Some(Event::Ready)));
        for step in 0..3 {
            let snap = d.step(&rt, step).expect("step");
            assert!(snap.text.as_deref().is_some_and(|t| t.starts_with("Hello there")), "{:?}", snap.text);
            assert_eq!((snap.experts.layers, snap.experts.experts), (2, 8));
            assert!(snap.experts.appended.iter().sum::<u32>() > 0, "labels counted");
            assert_eq!(snap.ring_pages.len(), 2 * 2, "two layers x one KV head x two shards");
            assert_eq!(snap.report.context, d.prompt.len() as u32 + step + 1);
        }
        // A MoE file with its experts in 2 slots per layer: the residency follows the choices.
        let path = dir.join("moe.gguf");
        std::fs::write(&path, expertkv_model::SyntheticModel::moe(4, 8, 2).gguf()).expect("write");
        let moe_flags = ModelFlags {
            model: Some(path),
            text: "Hello".into(),
            tokens: 3,
            experts: crate::experts_args::ExpertArgs { expert_slots: Some("2".into()), ..Default::default() },
            ..Default::default()
        };
        let mut d = ModelDriver::prepare(&moe_flags, &RunFlags { budget: Some("16".into()), ..Default::default() }).expect("prepare");
        d.build(&rt, &|_| {}).expect("build");
        for step in 0..3 {
            let snap = d.step(&rt, step).expect("step");
            let r = snap.residency.expect("residency");
            assert_eq!((r.layers, r.experts, r.slots), (2, 8, 2));
            for l in 0..2 {
                let row = l * 8..(l + 1) * 8;
                assert_eq!(r.resident[row.clone()].iter().filter(|&&x| x).count(), 2, "step {step}, layer {l}: {r:?}");
                assert_eq!(r.chosen[row.clone()].iter().filter(|&&x| x).count(), 2, "step {step}, layer {l}: top-2");
                assert!(row.clone().all(|i| !r.chosen[i] || r.resident[i]), "step {step}, layer {l}: a chosen expert is on the GPU");
            }
            assert_eq!(r.step[0] + r.step[1], 4, "step {step}: two choices in each of two layers: {r:?}");
        }
        // Synthetic-only flags are refused with --model, by name.
        let err = ModelDriver::prepare(&flags, &RunFlags { seqs: Some(2), ..Default::default() }).err().expect("refused");
        assert!(err.to_string().contains("--seqs"), "{err}");
    }
}
