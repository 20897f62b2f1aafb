//! Injected faults. The device lost mid-run (`wgpu::Device::destroy`, which is how a driver
//! reset or a removed GPU reaches wgpu): the pipeline's next step and the pool's next append
//! report the lost device as errors, never a panic or a hang, and what the host already holds
//! (the steps reported before) stays as it was.

use expertkv_core::pipeline::{DemoConfig, Pipeline};
use expertkv_core::runtime::{Runtime, RuntimeOptions};
use expertkv_core::workload::WorkloadConfig;

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
    let mut p = pollster::block_on(Pipeline::new(&rt, cfg)).expect("pipeline");
    pollster::block_on(p.prefill(&rt, &mut |_, _| {})).expect("prefill");
    let before = pollster::block_on(p.step(&rt)).expect("a step before the fault");
    let kept = format!("{before:?}");
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
    assert_eq!(format!("{before:?}"), kept, "the report taken before the fault is intact");
}
