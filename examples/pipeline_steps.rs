//! The synthetic MoE decode pipeline (routing, sharded appends, eviction, attention) and its
//! step reports.
//!
//! ```sh
//! cargo run --release -p expertkv-examples --bin pipeline_steps -- --steps 8
//! ```

use expertkv_core::pipeline::{DemoConfig, Pipeline};
use expertkv_core::{Runtime, RuntimeOptions};
use expertkv_examples::number;

fn main() -> std::process::ExitCode {
    expertkv_examples::exit(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let rt = pollster::block_on(Runtime::new(RuntimeOptions::from_env()?))?;
    // The demo's defaults (H2O at 25% of the context, the cache-aware router), smaller, and
    // without the CPU lockstep.
    let mut cfg = DemoConfig { verify: false, ..Default::default() };
    cfg.workload.n_seqs = 2;
    cfg.workload.layers = 2;
    cfg.workload.prompt_len = 256;
    cfg.steps = number("--steps", 8)?;
    let mut p = pollster::block_on(Pipeline::new(&rt, cfg.clone()))?;
    pollster::block_on(p.prefill(&rt, &mut |done, total| {
        if done == total {
            println!("prefill: {total} token K/V appended");
        }
    }))?;
    for _ in 0..cfg.steps {
        let r = pollster::block_on(p.step(&rt))?;
        println!(
            "step {:>2}: context {:>4}, {:>3} of {} pages in use ({} bytes), {:>4} tokens evicted, miss rate {:.3}, routing entropy {:.2} nats",
            r.step, r.context, r.pages_in_use, r.pages_total, r.kv_bytes_resident, r.evicted, r.miss_rate, r.routing_entropy
        );
    }
    Ok(())
}
