//! `expertkv`: inspect the GPU, run the decode pipeline on the built-in workload, benchmark kernels.

use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};

mod batch;
mod bench;
mod bench_devices;
mod compare;
mod demo;
mod eval;
mod experts_args;
mod gpu_mem;
mod info;
mod mix;
mod moe_spec;
mod moefy;
mod plan;
mod plot;
mod replay;
mod routing;
mod run;
mod soak;
mod store;
mod suite;
mod sweep;
mod synth;
mod view;

#[derive(Parser)]
#[command(name = "expertkv", version, about = "Expert-aware KV cache management for MoE decoding, on wgpu")]
struct Cli {
    #[command(flatten)]
    gpu: GpuArgs,
    #[command(subcommand)]
    cmd: Command,
}

/// Adapter selection, shared by every subcommand.
#[derive(Args, Clone, Debug)]
pub struct GpuArgs {
    /// Backends to consider: vulkan, metal, dx12, gl (comma-separated). Env: EXPERTKV_BACKEND.
    #[arg(long, global = true)]
    backend: Option<String>,
    /// Use the adapter whose name contains this text; with several devices (`bench devices`), a
    /// comma-separated list, one name per device. Env: EXPERTKV_ADAPTER.
    #[arg(long, global = true)]
    adapter: Option<String>,
    /// Keep wgpu's shader bounds checks on every kernel (default: off for kernels the tests
    /// cover). Env: EXPERTKV_SHADER_CHECKS=checked.
    #[arg(long, global = true)]
    checked: bool,
}

impl GpuArgs {
    pub fn options(&self) -> Result<expertkv_core::RuntimeOptions> {
        let mut o = expertkv_core::RuntimeOptions::from_env()?;
        if let Some(b) = &self.backend {
            o.backends = expertkv_core::runtime::parse_backends(b)?;
        }
        if let Some(a) = &self.adapter {
            o.adapter = Some(a.clone());
        }
        if self.checked {
            o.checks = expertkv_core::ShaderChecks::Checked;
        }
        Ok(o)
    }

    pub fn runtime(&self) -> Result<expertkv_core::Runtime> {
        let opts = self.options()?;
        pollster::block_on(expertkv_core::Runtime::new(opts)).context("opening the GPU")
    }
}

#[derive(Subcommand)]
enum Command {
    /// Adapters, backend, limits, features and the capability tier.
    Info(info::InfoArgs),
    /// Run the decode pipeline on the built-in synthetic workload.
    Demo(view::DemoCmd),
    /// Benchmark a kernel against the copy roofline measured in the same run.
    Bench(bench::BenchArgs),
    /// Run the pipeline over routers x schedulers x budgets and print a table.
    Sweep(sweep::SweepArgs),
    /// Measure the rooflines, predict each configuration's step time, pick one for a target.
    Plan(plan::PlanArgs),
    /// Run the demo and record its decode trace (`demo --trace FILE`).
    Record(replay::RecordArgs),
    /// Read a decode trace back: re-run it and check every step and layer, or summarise it.
    Replay(replay::ReplayArgs),
    /// Greedy decoding of a real model (GGUF; SmolLM2-135M by default) with its K/V in the pool.
    Run(run::RunArgs),
    /// A real model's quality per scheduler and budget: perplexity, greedy agreement with the
    /// full cache, needle retrieval; a table and a plot.
    Eval(eval::EvalArgs),
    /// One GPU budget split between K/V pages and expert slots request by request over a mix of
    /// short and long requests: the joint controller against fixed splits.
    Mix(mix::MixArgs),
    /// Two model traces (`run --trace`) side by side: where their routing, expert residency and
    /// K/V page counts first part, and each one's traffic.
    Compare(compare::CompareArgs),
    /// Write a random Llama GGUF, dense or with experts in llama.cpp's MoE layout, to try `run`
    /// and `eval` on shapes no shipped model has.
    Synth(synth::SynthArgs),
    /// MoEfy a dense model (its FFN neurons clustered into experts, routers optionally fitted)
    /// and write it as a MoE file, so the expert cache and the joint budget run on its routing.
    Moefy(moefy::MoefyArgs),
    /// Decode for many steps with sequences finishing and joining, checking the pool's
    /// invariants every few hundred steps and recording host RSS and steps per second.
    Soak(soak::SoakArgs),
    /// The KV page store that `run --kv-store` shares across processes: stats, clear, bench.
    Store(store::StoreArgs),
    /// Watch the pipeline in a window (cache heat, shards, evictions, budget split, step time), live or replaying a trace.
    View(view::ViewArgs),
}

fn main() -> ExitCode {
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        // Mesa complains on every start without it; a private folder silences it.
        let dir = std::env::temp_dir().join(format!("expertkv-xdg-{}", std::process::id()));
        if std::fs::create_dir_all(&dir).is_ok() {
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
            }
            // SAFETY: single-threaded at this point; nothing else reads the environment yet.
            unsafe { std::env::set_var("XDG_RUNTIME_DIR", &dir) };
        }
    }
    let cli = Cli::parse();
    let r = match &cli.cmd {
        Command::Info(a) => info::run(&cli.gpu, a),
        Command::Demo(a) if a.view => view::demo(&cli.gpu, a),
        Command::Demo(a) => demo::run(&cli.gpu, &a.args),
        Command::Bench(a) => bench::run(&cli.gpu, a),
        Command::Sweep(a) => sweep::run(&cli.gpu, a),
        Command::Plan(a) => plan::run(&cli.gpu, a),
        Command::Record(a) => replay::record(&cli.gpu, a),
        Command::Replay(a) => replay::run(&cli.gpu, a),
        Command::Run(a) => run::run(&cli.gpu, a),
        Command::Eval(a) => eval::run(&cli.gpu, a),
        Command::Mix(a) => mix::run(&cli.gpu, a),
        Command::Synth(a) => synth::run(a),
        Command::Moefy(a) => moefy::run(a),
        Command::Compare(a) => compare::run(a),
        Command::Soak(a) => soak::run(&cli.gpu, a),
        Command::Store(a) => store::run(a),
        Command::View(a) => view::run(&cli.gpu, a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Human-readable bytes.
pub fn fmt_bytes(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 { format!("{b} B") } else { format!("{v:.1} {}", U[i]) }
}

pub fn check_positive(name: &str, v: u32) -> Result<()> {
    if v == 0 {
        bail!("--{name} must be at least 1");
    }
    Ok(())
}
