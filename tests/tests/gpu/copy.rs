//! The roofline copy kernel copies every byte.

use expertkv_core::bench::CopyKernel;

use crate::common::{POISON_U32, rt, seeds};

#[test]
fn copy_moves_every_word() {
    let rt = rt();
    for seed in seeds("copy", 2) {
        let bytes = 16 * (1 + (seed % 100_000));
        let k = pollster::block_on(CopyKernel::new(rt, bytes, seed)).expect("copy kernel");
        rt.fill_u32(&k.dst, POISON_U32);
        let mut enc = rt.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            k.encode(&mut pass);
        }
        rt.queue.submit([enc.finish()]);
        let dst: Vec<u32> = pollster::block_on(rt.read_all(&k.dst)).expect("read");
        let src: Vec<u32> = pollster::block_on(rt.read_all(k.src())).expect("read");
        assert!(!src.iter().all(|w| *w == 0), "seed {seed}: source must not be zeros");
        assert!(dst == src, "seed {seed}: copy of {bytes} bytes differs");
    }
}

#[test]
fn fma_roofline_kernel_computes_its_recurrence() {
    use expertkv_core::bench::{FmaKernel, fma_reference};
    let rt = rt();
    for seed in seeds("fma", 2) {
        let iters = 1 + (seed % 300) as u32;
        let k = pollster::block_on(FmaKernel::new(rt, 1000 + (seed % 5000) as u32, iters)).expect("fma kernel");
        rt.fill_u32(&k.out, POISON_U32);
        let mut enc = rt.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            k.encode(&mut pass);
        }
        rt.queue.submit([enc.finish()]);
        let out: Vec<f32> = pollster::block_on(rt.read_all(&k.out)).expect("read");
        assert_eq!(out.len(), k.invocations as usize * 4);
        for i in (0..k.invocations).step_by(97) {
            let want = fma_reference(i, iters);
            for lane in 0..4 {
                let g = f64::from(out[i as usize * 4 + lane]);
                assert!(
                    (g - want[lane]).abs() <= 1e-4 * want[lane].abs(),
                    "seed {seed}: invocation {i} lane {lane}: {g} vs {}",
                    want[lane]
                );
            }
        }
        assert!(k.flops() == u64::from(k.invocations) * u64::from(iters) * 64);
    }
}
