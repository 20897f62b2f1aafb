//! `expertkv view` and `expertkv demo --view`: the viewer (`expertkv-viewer`) in an eframe window
//! (wgpu renderer) beside a pipeline run on a worker thread, live on the synthetic workload or
//! re-running a recorded trace and comparing every step with the recording.
//!
//! The worker owns its own [`Runtime`] and [`Pipeline`]; the window only exchanges plain messages
//! with it (viewer [`Event`]s one way, [`Cmd`]s the other), so a slow prefill never blocks the
//! window and pausing, stepping and rebuilding with a new configuration are requests the worker
//! acts on between steps.

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};

use anyhow::{Context, Result, anyhow, bail};
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, FromArgMatches};
use eframe::egui;
use expertkv_core::Runtime;
use expertkv_core::pipeline::{DemoConfig, Pipeline};
use expertkv_core::trace::{Trace, read_trace};
use expertkv_viewer::state::Source;
use expertkv_viewer::{Event, Request, Viewer, capture};

use crate::{GpuArgs, demo};

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

#[derive(Args, Clone, Debug, Default)]
pub struct ViewArgs {
    #[command(flatten)]
    pub run: RunFlags,
    /// Replay a trace written by `expertkv record` (its configuration replaces the flags above):
    /// every step is re-run and compared with the recording.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Open paused (Step and Run in the window).
    #[arg(long)]
    pub paused: bool,
    #[command(flatten)]
    pub model: crate::view_model::ModelFlags,
}

/// `expertkv demo`'s arguments plus `--view`; keeps the parsed matches so that `--view` can read
/// the demo flags it honours without reaching into `demo`.
#[derive(Clone)]
pub struct DemoCmd {
    pub args: demo::DemoArgs,
    pub view: bool,
    matches: ArgMatches,
}

impl FromArgMatches for DemoCmd {
    fn from_arg_matches(m: &ArgMatches) -> std::result::Result<Self, clap::Error> {
        Self::from_arg_matches_mut(&mut m.clone())
    }

    fn from_arg_matches_mut(m: &mut ArgMatches) -> std::result::Result<Self, clap::Error> {
        let matches = m.clone();
        let view = m.get_flag("view");
        Ok(DemoCmd { args: demo::DemoArgs::from_arg_matches_mut(m)?, view, matches })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> std::result::Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

impl Args for DemoCmd {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        demo::DemoArgs::augment_args(cmd).arg(Self::view_arg())
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        demo::DemoArgs::augment_args_for_update(cmd).arg(Self::view_arg())
    }
}

impl DemoCmd {
    fn view_arg() -> clap::Arg {
        clap::Arg::new("view")
            .long("view")
            .action(clap::ArgAction::SetTrue)
            .help("Watch the run in the viewer window instead of printing a table (the flags `expertkv view` takes)")
    }
}

/// `expertkv demo --view`.
pub fn demo(gpu: &GpuArgs, d: &DemoCmd) -> Result<()> {
    let run = RunFlags::from_demo_matches(&d.matches)?;
    open(gpu, &ViewArgs { run, trace: None, paused: false, model: Default::default() })
}

/// `expertkv view`.
pub fn run(gpu: &GpuArgs, a: &ViewArgs) -> Result<()> {
    open(gpu, a)
}

/// What the window asks of the worker.
enum Cmd {
    SetRunning(bool),
    Step,
    Restart,
    Rebuild(Box<DemoConfig>),
}

/// Whether a window can open here: on Linux and the BSDs, an X11 or Wayland display.
fn check_display() -> Result<()> {
    if cfg!(all(unix, not(target_os = "macos"), not(target_os = "android"))) {
        let set = |v: &str| std::env::var_os(v).is_some_and(|x| !x.is_empty());
        if !set("DISPLAY") && !set("WAYLAND_DISPLAY") {
            bail!(
                "expertkv view needs a display and neither DISPLAY nor WAYLAND_DISPLAY is set: run it in a desktop session, over \
                 `ssh -X`, or under Xvfb (`xvfb-run -s '-screen 0 1400x900x24' expertkv view`). Headless renders of the viewer come \
                 from its snapshot tests (`cargo test -p expertkv-viewer`)"
            );
        }
    }
    Ok(())
}

fn open(gpu: &GpuArgs, a: &ViewArgs) -> Result<()> {
    if a.model.model.is_some() {
        if a.trace.is_some() {
            bail!("--model decodes a model and --trace replays a synthetic run: give one");
        }
        let driver = crate::view_model::ModelDriver::prepare(&a.model, &a.run)?;
        let cfg = driver.config().clone();
        return window(gpu, cfg, !a.paused, Box::new(driver));
    }
    let (cfg, trace) = match &a.trace {
        Some(path) => {
            let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
            let t = read_trace(std::io::BufReader::new(f)).with_context(|| format!("reading {}", path.display()))?;
            (t.header.config.clone(), Some((path.display().to_string(), t)))
        }
        None => (a.run.build_config()?, None),
    };
    if a.trace.is_some() && a.run != RunFlags::default() {
        eprintln!("note: --trace replays the trace's own configuration; the run flags are ignored");
    }
    let driver = PipelineDriver { cfg: cfg.clone(), trace, p: None };
    window(gpu, cfg, !a.paused, Box::new(driver))
}

/// The viewer window over `driver`, which runs on a worker thread.
fn window(gpu: &GpuArgs, cfg: DemoConfig, running: bool, driver: Box<dyn Driver>) -> Result<()> {
    let opts = gpu.options()?;
    check_display()?;
    let viewer = Viewer::new(&cfg, running);
    let native = eframe::NativeOptions {
        viewport: egui::ViewportBuilder::default().with_title("expertkv viewer").with_inner_size([1320.0, 900.0]),
        renderer: eframe::Renderer::Wgpu,
        ..Default::default()
    };
    eframe::run_native(
        "expertkv viewer",
        native,
        Box::new(move |cc| {
            let (cmd_tx, cmd_rx) = channel();
            let (ev_tx, ev_rx) = channel();
            let ctx = cc.egui_ctx.clone();
            std::thread::Builder::new()
                .name("expertkv pipeline".into())
                .spawn(move || worker(opts, driver, running, &cmd_rx, &ev_tx, &ctx))
                .map_err(|e| anyhow!("starting the pipeline thread: {e}"))?;
            Ok(Box::new(ViewApp { viewer, events: ev_rx, cmds: cmd_tx }))
        }),
    )
    .map_err(|e| {
        anyhow!(
            "could not open the viewer window: {e} (DISPLAY={:?}, WAYLAND_DISPLAY={:?}; under Xvfb set DISPLAY to its screen)",
            std::env::var("DISPLAY").unwrap_or_default(),
            std::env::var("WAYLAND_DISPLAY").unwrap_or_default()
        )
    })
}

struct ViewApp {
    viewer: Viewer,
    events: Receiver<Event>,
    cmds: Sender<Cmd>,
}

impl eframe::App for ViewApp {
    fn ui(&mut self, ui: &mut egui::Ui, _frame: &mut eframe::Frame) {
        while let Ok(ev) = self.events.try_recv() {
            self.viewer.apply(ev);
        }
        for r in self.viewer.ui(ui) {
            let cmd = match r {
                Request::SetRunning(b) => Cmd::SetRunning(b),
                Request::Step => Cmd::Step,
                Request::Restart => Cmd::Restart,
                Request::Rebuild(cfg) => Cmd::Rebuild(cfg),
            };
            // The worker only goes away with the process; a failed send means it panicked, which
            // its last event already reported.
            let _ = self.cmds.send(cmd);
        }
    }
}

/// What the worker thread drives: the synthetic pipeline (live or replaying a trace) or a model.
pub(crate) trait Driver: Send {
    /// Decode steps of a run.
    fn steps(&self) -> u32;
    /// (Re)build and prefill, sending `Started`, `Prefill` progress and `Ready`.
    fn build(&mut self, rt: &Runtime, send: &dyn Fn(Event)) -> Result<()>;
    /// Decode step `step`.
    fn step(&mut self, rt: &Runtime, step: u32) -> Result<expertkv_viewer::Snapshot>;
    /// Take a configuration edited in the window; `false` where the run's configuration is fixed.
    fn reconfigure(&mut self, cfg: DemoConfig) -> bool;
}

/// The worker thread: build, prefill, step while running; rebuild on request.
fn worker(
    opts: expertkv_core::RuntimeOptions,
    mut driver: Box<dyn Driver>,
    mut running: bool,
    cmds: &Receiver<Cmd>,
    events: &Sender<Event>,
    ctx: &egui::Context,
) {
    let send = |ev: Event| {
        let _ = events.send(ev);
        ctx.request_repaint();
    };
    let rt = match pollster::block_on(Runtime::new(opts)) {
        Ok(rt) => rt,
        Err(e) => {
            send(Event::Error(format!("opening the GPU: {e}")));
            return;
        }
    };
    'build: loop {
        let mut built = match driver.build(&rt, &send) {
            Ok(()) => true,
            Err(e) => {
                send(Event::Error(format!("{e:#}")));
                false
            }
        };
        let mut step = 0u32;
        loop {
            let active = built && step < driver.steps();
            let cmd = if running && active {
                match cmds.try_recv() {
                    Ok(c) => Some(c),
                    Err(TryRecvError::Empty) => None,
                    Err(TryRecvError::Disconnected) => return,
                }
            } else {
                match cmds.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                }
            };
            let mut one = false;
            match cmd {
                Some(Cmd::SetRunning(b)) => running = b,
                Some(Cmd::Step) => one = true,
                Some(Cmd::Restart) => continue 'build,
                Some(Cmd::Rebuild(c)) if driver.reconfigure((*c).clone()) => continue 'build,
                Some(Cmd::Rebuild(_)) => {}
                None => {}
            }
            if !(running || one) || step >= driver.steps() || !built {
                continue;
            }
            match driver.step(&rt, step) {
                Ok(snap) => {
                    step += 1;
                    send(Event::Step(Box::new(snap)));
                    if step == driver.steps() {
                        send(Event::Finished);
                    }
                }
                Err(e) => {
                    send(Event::Error(format!("step {step}: {e:#}")));
                    built = false;
                }
            }
        }
    }
}

/// The synthetic pipeline, live or re-running a recorded trace.
struct PipelineDriver {
    cfg: DemoConfig,
    trace: Option<(String, Trace)>,
    p: Option<Pipeline>,
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::{Cli, Command};

    #[test]
    fn demo_view_reads_the_demo_flags_it_honours() {
        let cli = Cli::try_parse_from(["expertkv", "demo", "--view", "--steps", "3", "--router", "topk", "--budget", "10%", "--no-verify"])
            .expect("parses");
        let Command::Demo(d) = &cli.cmd else { panic!("demo") };
        assert!(d.view);
        let cfg = super::RunFlags::from_demo_matches(&d.matches).expect("flags").build_config().expect("config");
        assert_eq!(cfg.steps, 3);
        assert_eq!(cfg.router, expertkv_core::route::config::RouterConfig::Topk);
        assert_eq!(cfg.budget, "10%");
        assert!(!cfg.verify);
        for (flag, value) in [("--json", None), ("--metrics", Some("m.csv")), ("--trace", Some("t.jsonl")), ("--dtype", Some("f32"))] {
            let mut args = vec!["expertkv", "demo", "--view", flag];
            args.extend(value);
            let cli = Cli::try_parse_from(args).expect("parses");
            let Command::Demo(d) = &cli.cmd else { panic!("demo") };
            let err = super::RunFlags::from_demo_matches(&d.matches).expect_err("not a viewer flag");
            assert!(err.to_string().contains(flag), "{err}");
        }
        let cli = Cli::try_parse_from(["expertkv", "demo", "--steps", "2"]).expect("parses");
        let Command::Demo(d) = &cli.cmd else { panic!("demo") };
        assert!(!d.view);
    }

    #[test]
    fn view_takes_the_demo_config_flags_and_a_trace() {
        let cli = Cli::try_parse_from([
            "expertkv",
            "view",
            "--scheduler",
            "streaming-llm:sinks=8",
            "--codec",
            "none",
            "--seqs",
            "2",
            "--layers",
            "3",
            "--prompt",
            "256",
            "--allocator",
            "ekva",
        ])
        .expect("parses");
        let Command::View(v) = &cli.cmd else { panic!("view") };
        let cfg = v.run.build_config().expect("config");
        assert_eq!((cfg.workload.n_seqs, cfg.workload.layers, cfg.workload.prompt_len), (2, 3, 256));
        assert!(cfg.allocator.is_some());
        let cli = Cli::try_parse_from(["expertkv", "view", "--trace", "t.jsonl", "--paused"]).expect("parses");
        let Command::View(v) = &cli.cmd else { panic!("view") };
        assert_eq!(v.trace.as_deref(), Some(std::path::Path::new("t.jsonl")));
        assert!(v.paused);
    }

    #[test]
    fn no_display_is_named() {
        if std::env::var_os("DISPLAY").is_some() || std::env::var_os("WAYLAND_DISPLAY").is_some() {
            return;
        }
        let err = super::check_display().expect_err("no display here");
        let msg = err.to_string();
        assert!(msg.contains("DISPLAY") && msg.contains("WAYLAND_DISPLAY"), "{msg}");
    }
}
