//! `expertkv view` and `expertkv demo --view`: the viewer (`expertkv-viewer`) in an eframe window
//! (wgpu renderer) beside a pipeline run on a worker thread, live on the synthetic workload or
//! re-running a recorded trace and comparing every step with the recording.
//!
//! The worker owns its own [`Runtime`] and [`Pipeline`](expertkv_core::pipeline::Pipeline); the window only exchanges plain messages
//! with it (viewer [`Event`]s one way, [`Cmd`]s the other), so a slow prefill never blocks the
//! window and pausing, stepping and rebuilding with a new configuration are requests the worker
//! acts on between steps.

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};

use anyhow::{Context, Result, anyhow, bail};
use clap::{ArgMatches, Args, FromArgMatches};
use eframe::egui;
use expertkv_core::Runtime;
use expertkv_core::pipeline::DemoConfig;
use expertkv_core::trace::read_trace;
use expertkv_viewer::{Event, Request, Viewer};

use crate::{GpuArgs, demo};

mod driver;
mod model;

pub use driver::RunFlags;
use driver::{Driver, PipelineDriver};

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
    pub model: model::ModelFlags,
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
        let driver = model::ModelDriver::prepare(&a.model, &a.run)?;
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
