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
