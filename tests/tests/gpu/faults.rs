//! Injected faults. The device lost mid-run (`wgpu::Device::destroy`, which is how a driver
//! reset or a removed GPU reaches wgpu): the pipeline's next step and the pool's next append
//! report the lost device as errors, never a panic or a hang, and what the host already holds
//! (the steps reported before) stays as it was. Two pipelines on one device decide as each
//! alone.

use expertkv_core::pipeline::{DemoConfig, Pipeline};
use expertkv_core::runtime::{Runtime, RuntimeOptions};
use expertkv_core::workload::WorkloadConfig;

use crate::common::{rt, seeds};

#[test]
fn a_device_lost_mid_run_is_an_error_not_a_panic() {
    // A runtime of its own: the shared one must outlive this test.
    let rt = pollster::block_on(Runtime::new(RuntimeOptions::from_env().expect("options"))).expect("runtime");
    let cfg = DemoConfig {
        workload: WorkloadConfig { seed: 5, n_seqs: 2, layers: 2, prompt_len: 64, ..Default::default() },
        steps: 4,
        budget: "32".into(),
        verify: false,
        ..Default::default()
    };
    // The same run on the shared device, which nothing destroys: what the first step should
    // report (its decisions, counts and masses; the times differ from run to run).
    let decided = |r: &expertkv_core::pipeline::StepReport| {
        let mut r = r.clone();
        (r.gpu, r.host_ms) = (None, 0.0);
        format!("{r:?}")
    };
    let want = {
        let mut q = pollster::block_on(Pipeline::new(crate::common::rt(), cfg.clone())).expect("pipeline");
        pollster::block_on(q.prefill(crate::common::rt(), &mut |_, _| {})).expect("prefill");
        decided(&pollster::block_on(q.step(crate::common::rt())).expect("a step on a healthy device"))
    };
    let mut p = pollster::block_on(Pipeline::new(&rt, cfg)).expect("pipeline");
    pollster::block_on(p.prefill(&rt, &mut |_, _| {})).expect("prefill");
    let before = pollster::block_on(p.step(&rt)).expect("a step before the fault");
    rt.device.destroy();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| pollster::block_on(p.step(&rt))));
    match outcome {
        Ok(Err(e)) => {
            let msg = e.to_string();
            println!("the step after the device was destroyed: {msg}");
            assert!(
                msg.to_lowercase().contains("lost") || msg.to_lowercase().contains("destroy"),
                "the error names the lost device: {msg}"
            );
        }
        Ok(Ok(r)) => panic!("a step on a destroyed device reported success: {r:?}"),
        Err(_) => panic!("a step on a destroyed device panicked"),
    }
    assert!(rt.is_lost(), "the runtime knows its device is lost");
    let again = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| pollster::block_on(p.step(&rt))));
    assert!(matches!(again, Ok(Err(_))), "every later step is refused too");
    // The step before the fault reported what the same step reports where no fault comes.
    assert_eq!(decided(&before), want, "the report taken before the fault is the healthy run's");
}

/// Two pipelines sharing one device, their steps interleaved (one H2O over int4 pages, one
/// plain with another router and seed), each decide exactly as when run alone: the same
/// decision checksum step for step. Nothing in a pool, scheduler or the runtime's pipeline cache
/// leaks from one to the other.
#[test]
fn two_pipelines_on_one_device_decide_as_each_alone() {
    use expertkv_core::config::Codec;
    use expertkv_core::digest::DecisionDigest;
    use expertkv_core::evict::config::SchedulerConfig;
    use expertkv_core::route::config::RouterConfig;
    let rt = rt();
    let seed = seeds("two_pipelines", 1)[0];
    let configs = [
        DemoConfig {
            workload: WorkloadConfig { seed, n_seqs: 2, layers: 2, prompt_len: 128, n_experts: 8, ..Default::default() },
            steps: 4,
            scheduler: Some(SchedulerConfig::H2o { sinks: 2, window: 8 }),
            budget: "40%".into(),
            codec: Codec::Int4 { group: 32 },
            verify: false,
            reference_attention: false,
            ..Default::default()
        },
        DemoConfig {
            workload: WorkloadConfig { seed: seed ^ 1, n_seqs: 3, layers: 1, prompt_len: 96, n_experts: 16, ..Default::default() },
            steps: 4,
            router: RouterConfig::default_for("cache-aware").expect("router"),
            scheduler: None,
            verify: false,
            reference_attention: false,
            ..Default::default()
        },
    ];
    let start = |cfg: &DemoConfig| {
        let mut p = pollster::block_on(Pipeline::new(rt, cfg.clone())).expect("pipeline");
        pollster::block_on(p.prefill(rt, &mut |_, _| {})).expect("prefill");
        p
    };
    let alone: Vec<Vec<u64>> = configs
        .iter()
        .map(|cfg| {
            let mut p = start(cfg);
            let mut d = DecisionDigest::new();
            (0..4)
                .map(|_| {
                    pollster::block_on(p.step(rt)).expect("step");
                    pollster::block_on(d.absorb_step(rt, &p)).expect("digest");
                    d.value()
                })
                .collect()
        })
        .collect();
    let mut both: Vec<(Pipeline, DecisionDigest)> = configs.iter().map(|c| (start(c), DecisionDigest::new())).collect();
    let mut together = vec![Vec::new(), Vec::new()];
    for _ in 0..4 {
        for (i, (p, d)) in both.iter_mut().enumerate() {
            pollster::block_on(p.step(rt)).expect("step");
            pollster::block_on(d.absorb_step(rt, p)).expect("digest");
            together[i].push(d.value());
        }
    }
    assert_eq!(together, alone, "seed {seed}: interleaved on one device, the pipelines decided differently");
    assert_ne!(alone[0], alone[1], "seed {seed}: two different runs");
}
