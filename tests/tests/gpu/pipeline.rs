//! The demo pipeline end to end on a small workload: the GPU pool equals the CPU reference
//! after prefill and decode, and attention matches the f64 reference.

use expertkv_core::pipeline::{DemoConfig, Pipeline};
use expertkv_core::router_config::RouterConfig;
use expertkv_core::workload::WorkloadConfig;

use crate::common::{rt, seeds};

#[test]
fn demo_pipeline_matches_reference() {
    let rt = rt();
    let routers = [RouterConfig::Topk, RouterConfig::default_for("adaptive").expect("router")];
    for (seed, router) in seeds("demo_pipeline", 2).into_iter().zip(routers) {
        let cfg = DemoConfig {
            workload: WorkloadConfig { seed, n_seqs: 3, layers: 2, prompt_len: 150, ..Default::default() },
            steps: 5,
            router,
            ..Default::default()
        };
        let mut p = pollster::block_on(Pipeline::new(rt, cfg)).expect("pipeline");
        pollster::block_on(p.prefill(rt, &mut |_, _| {})).expect("prefill");
        let mut last = None;
        for _ in 0..5 {
            last = Some(pollster::block_on(p.step(rt)).expect("step"));
        }
        let r = last.expect("steps ran");
        assert_eq!(r.context, 155);
        assert!(r.pages_in_use > 0 && r.kv_bytes_resident >= r.kv_bytes_tokens, "seed {seed}: {r:?}");
        assert_eq!(r.shard_pages.iter().sum::<u32>(), r.pages_in_use, "seed {seed}");
        let v = pollster::block_on(p.verify(rt)).expect("verify").expect("verification enabled");
        assert!(v.placement_identical);
        assert!(v.attention_max_abs_err <= v.attention_tolerance, "seed {seed}: {v:?}");
        // Routing ran on the GPU for every prompt and decode token of every layer.
        let stats = pollster::block_on(p.router.read_stats(rt)).expect("stats");
        let appended: u32 = stats.iter().map(|s| s.appended).sum();
        assert_eq!(appended, 155 * 3 * 2 * 2, "seed {seed}: routing slots counted (tokens x layers x top_k)");
        assert!(r.routing_entropy > 0.0, "seed {seed}");
    }
}
