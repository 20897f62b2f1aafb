//! The paged pool and its attention as the KV cache of someone else's forward pass: each decode
//! step appends one token's K/V per layer (with the experts it was routed to, which place it in
//! a shard), attends one query, and lets StreamingLLM evict down to a budget; statistics come
//! from the pool and the scheduler.
//!
//! ```sh
//! cargo run --release -p expertkv-examples --bin kv_cache -- --steps 64 --budget 32
//! ```

use expertkv_core::append::format::encode_values;
use expertkv_core::attend::{AttendOptions, Attention};
use expertkv_core::evict::Scheduler;
use expertkv_core::evict::config::{SchedulerConfig, Threshold};
use expertkv_core::{KvPool, NewToken, PoolConfig, Runtime, RuntimeOptions, ShardMap};
use expertkv_examples::number;

fn main() -> std::process::ExitCode {
    expertkv_examples::exit(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let (steps, budget) = (number("--steps", 64)?, number("--budget", 32)?);
    let rt = pollster::block_on(Runtime::new(RuntimeOptions::from_env()?))?;
    let (layers, kv_heads, head_dim, group) = (2u32, 2u32, 64u32, 4u32);
    let cfg = PoolConfig {
        layers,
        kv_heads,
        head_dim,
        n_pages: 256,
        max_seqs: 1,
        n_shards: 2,
        shard_map: ShardMap::Pikv { n_tok: 2, n_exp: 2 },
        ..Default::default()
    };
    let mut pool = pollster::block_on(KvPool::new(&rt, cfg.clone()))?;
    let attn = pollster::block_on(Attention::new(&rt, &pool, AttendOptions { group, n_seqs: 1, ..Default::default() }))?;
    let evict =
        pollster::block_on(Scheduler::new(&rt, &pool, SchedulerConfig::parse("streaming-llm:sinks=4")?, budget, Threshold::default()))?;

    let mut words = Vec::new();
    for pos in 0..steps {
        // Your model computes these; here, a smooth stand-in.
        let tokens: Vec<NewToken> = (0..layers)
            .map(|layer| NewToken { layer, seq: 0, position: pos, experts: vec![pos % 4, 4 + pos % 3], gates: vec![0.6, 0.4] })
            .collect();
        let kv: Vec<f32> = (0..layers * 2 * kv_heads * head_dim).map(|i| ((i * 7 + pos * 13) % 97) as f32 / 48.0 - 1.0).collect();
        words.clear();
        encode_values(&kv, cfg.dtype, &mut words);
        pool.append(&rt, &tokens, &words, pos)?;
        pool.gather(&rt)?;
        // Each layer's attention for this step's query.
        let queries: Vec<f32> = (0..attn.q_heads() * head_dim).map(|i| ((i * 11 + pos) % 31) as f32 / 15.0 - 1.0).collect();
        attn.set_queries(&rt, &queries)?;
        let mut first = 0.0;
        for layer in 0..layers {
            attn.run(&rt, layer, pos)?;
            let out = pollster::block_on(attn.read_output(&rt))?;
            if layer == 0 {
                first = out[0];
            }
        }
        // Evict down to the budget (sinks + recent window), then report.
        evict.run(&rt, pos, &[pos + 1])?;
        if (pos + 1) % 16 == 0 {
            let lists = pollster::block_on(evict.read_lists(&rt))?;
            let kept: u32 = lists.iter().map(|l| l.tokens).sum();
            let evicted: u32 = lists.iter().map(|l| l.evicted_total).sum();
            let ctl = pollster::block_on(pool.read_ctl(&rt))?;
            println!(
                "step {:>3}: {kept} token K/V kept over {} (layer, head) lists, {evicted} evicted, {} of {} pages in use; out[0] {first:+.4}",
                pos + 1,
                lists.len(),
                cfg.n_pages - ctl.free_top,
                cfg.n_pages
            );
        }
    }
    Ok(())
}
