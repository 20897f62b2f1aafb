//! What the viewer's worker thread drives ([`Driver`]): the synthetic pipeline, live or
//! re-running a recorded trace ([`PipelineDriver`]), or a model (`model.rs`); and the run's flags
//! both take ([`RunFlags`]).

use std::path::PathBuf;

use anyhow::{Context, Result, anyhow, bail};
use clap::parser::ValueSource;
use clap::{ArgMatches, Args};
use expertkv_core::Runtime;
use expertkv_core::pipeline::{DemoConfig, Pipeline};
use expertkv_core::trace::Trace;
use expertkv_viewer::state::Source;
use expertkv_viewer::{Event, capture};

use crate::demo;

/// The demo flags the viewer honours (the same names, meanings and defaults as `expertkv demo`).
#[derive(Args, Clone, Debug, Default, PartialEq)]
pub struct RunFlags {
    /// TOML file with any fields of the run (see README); flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Decode steps to run after the prompt [default: 16].
    #[arg(long)]
    pub steps: Option<u32>,
    /// Sequences decoded together [default: 4].
    #[arg(long)]
    pub seqs: Option<u32>,
    /// [default: 2]
    #[arg(long)]
    pub layers: Option<u32>,
    /// Prompt tokens per sequence [default: 1024].
    #[arg(long)]
    pub prompt: Option<u32>,
    /// [default: 4]
    #[arg(long)]
    pub kv_heads: Option<u32>,
    /// Query heads per KV head [default: 4].
    #[arg(long)]
    pub group: Option<u32>,
    /// [default: 64]
    #[arg(long)]
    pub head_dim: Option<u32>,
    /// [default: 16]
    #[arg(long)]
    pub experts: Option<u32>,
    /// [default: 2]
    #[arg(long)]
    pub top_k: Option<u32>,
    /// Router: name or name:key=value,... (as `demo --router`) [default: cache-aware].
    #[arg(long)]
    pub router: Option<String>,
    /// Scheduler: name or name:key=value,..., or none (as `demo --scheduler`) [default: h2o].
    #[arg(long)]
    pub scheduler: Option<String>,
    /// Tokens each (layer, sequence, KV head) keeps: a number or a share such as 25% [default: 25%].
    #[arg(long)]
    pub budget: Option<String>,
    /// PyramidKV: the first layer's budget over the last's [default: off].
    #[arg(long)]
    pub pyramid: Option<f32>,
    /// Budget allocator: none or ekva[:floor=F,alpha=A,decay=D] [default: none].
    #[arg(long)]
    pub allocator: Option<String>,
    /// Page codec: none, int8, int4, fastv-dims, low-rank, lora; under an evicting scheduler too [default: none].
    #[arg(long)]
    pub codec: Option<String>,
    /// Slots per page [default: 16].
    #[arg(long)]
    pub page_size: Option<u32>,
    /// Shards per (layer, sequence), a power of two [default: 4].
    #[arg(long)]
    pub shards: Option<u32>,
    /// [default: 42]
    #[arg(long)]
    pub seed: Option<u64>,
    /// Skip the CPU reference kept in lockstep.
    #[arg(long)]
    pub no_verify: bool,
    /// With a scheduler, skip the full-cache pool kept to measure the attention error.
    #[arg(long)]
    pub no_reference: bool,
}

impl RunFlags {
    /// The flags of a parsed `demo` command line (ids are the field names of `demo::DemoArgs`).
    pub fn from_demo_matches(m: &ArgMatches) -> Result<RunFlags> {
        // Any demo flag given that the viewer does not honour is refused rather than ignored
        // (this includes flags added to `demo` later).
        let honoured = RunFlags::augment_args(clap::Command::new("view"));
        let demo = demo::DemoArgs::augment_args(clap::Command::new("demo"));
        let is = |c: &clap::Command, id: &str| c.get_arguments().any(|a| a.get_id() == id);
        for id in m.ids().map(|id| id.as_str()) {
            // `ids` also lists argument groups (clap's derive names one after each struct).
            if is(&demo, id) && !is(&honoured, id) && m.value_source(id) == Some(ValueSource::CommandLine) {
                let hint = if id == "trace" { " (`expertkv view --trace FILE` replays a recorded trace)" } else { "" };
                bail!("demo --view does not take --{}{hint}", id.replace('_', "-"));
            }
        }
        fn one<T: Clone + Send + Sync + 'static>(m: &ArgMatches, id: &str) -> Result<Option<T>> {
            m.try_get_one::<T>(id).map(|v| v.cloned()).map_err(|e| anyhow!("demo --view: flag `{id}`: {e}"))
        }
        let flag = |id: &str| -> Result<bool> { Ok(one::<bool>(m, id)?.unwrap_or(false)) };
        Ok(RunFlags {
            config: one(m, "config")?,
            steps: one(m, "steps")?,
            seqs: one(m, "seqs")?,
            layers: one(m, "layers")?,
            prompt: one(m, "prompt")?,
            kv_heads: one(m, "kv_heads")?,
            group: one(m, "group")?,
            head_dim: one(m, "head_dim")?,
            experts: one(m, "experts")?,
            top_k: one(m, "top_k")?,
            router: one(m, "router")?,
            scheduler: one(m, "scheduler")?,
            budget: one(m, "budget")?,
            pyramid: one(m, "pyramid")?,
            allocator: one(m, "allocator")?,
            codec: one(m, "codec")?,
            page_size: one(m, "page_size")?,
            shards: one(m, "shards")?,
            seed: one(m, "seed")?,
            no_verify: flag("no_verify")?,
            no_reference: flag("no_reference")?,
        })
    }

    /// The run these flags describe, over `--config` or the defaults, checked as `demo` checks it.
    pub fn build_config(&self) -> Result<DemoConfig> {
        demo::Overrides {
            config: self.config.as_deref(),
            steps: self.steps,
            seqs: self.seqs,
            layers: self.layers,
            prompt: self.prompt,
            kv_heads: self.kv_heads,
            group: self.group,
            head_dim: self.head_dim,
            experts: self.experts,
            top_k: self.top_k,
            seed: self.seed,
            page_size: self.page_size,
            shards: self.shards,
            router: self.router.as_deref(),
            scheduler: self.scheduler.as_deref(),
            budget: self.budget.as_deref(),
            pyramid: self.pyramid,
            allocator: self.allocator.as_deref(),
            codec: self.codec.as_deref(),
            no_verify: self.no_verify,
            no_reference: self.no_reference,
            ..Default::default()
        }
        .build()
    }
}

/// What the worker thread drives: the synthetic pipeline (live or replaying a trace) or a model.
pub(super) trait Driver: Send {
    /// Decode steps of a run.
    fn steps(&self) -> u32;
    /// (Re)build and prefill, sending `Started`, `Prefill` progress and `Ready`.
    fn build(&mut self, rt: &Runtime, send: &dyn Fn(Event)) -> Result<()>;
    /// Decode step `step`.
    fn step(&mut self, rt: &Runtime, step: u32) -> Result<expertkv_viewer::Snapshot>;
    /// Take a configuration edited in the window; `false` where the run's configuration is fixed.
    fn reconfigure(&mut self, cfg: DemoConfig) -> bool;
}

/// The synthetic pipeline, live or re-running a recorded trace.
pub(super) struct PipelineDriver {
    pub(super) cfg: DemoConfig,
    pub(super) trace: Option<(String, Trace)>,
    pub(super) p: Option<Pipeline>,
}

impl Driver for PipelineDriver {
    fn steps(&self) -> u32 {
        self.cfg.steps
    }

    fn build(&mut self, rt: &Runtime, send: &dyn Fn(Event)) -> Result<()> {
        self.p = None;
        let source = self.trace.as_ref().map_or(Source::Live, |(path, _)| Source::Trace(path.clone()));
        let mut p = pollster::block_on(Pipeline::new(rt, self.cfg.clone())).context("building the pipeline")?;
        send(Event::Started(Box::new(capture::run_info(rt, &p, source))));
        let mut last = 0u64;
        pollster::block_on(p.prefill(rt, &mut |done, total| {
            // A few dozen updates are enough for a progress bar.
            if done == total || done >= last + total / 40 {
                last = done;
                send(Event::Prefill { done, total });
            }
        }))
        .context("prefill")?;
        send(Event::Ready);
        self.p = Some(p);
        Ok(())
    }

    fn step(&mut self, rt: &Runtime, step: u32) -> Result<expertkv_viewer::Snapshot> {
        let p = self.p.as_mut().ok_or_else(|| anyhow!("no pipeline"))?;
        let report = pollster::block_on(p.step(rt)).context("decode step")?;
        let mut snap = pollster::block_on(capture::capture(rt, p, report)).context("reading the pipeline's state")?;
        if let Some((_, t)) = &self.trace {
            snap.trace = Some(pollster::block_on(capture::trace_step(rt, p, t, step)).context("comparing with the trace")?);
        }
        Ok(snap)
    }

    fn reconfigure(&mut self, cfg: DemoConfig) -> bool {
        self.cfg = cfg;
        true
    }
}
