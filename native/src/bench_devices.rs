//! `expertkv bench devices`: decode attention with the pool's shards on several devices
//! (`expertkv_core::devices`) against the same pool on one device: the scaling ratio, and what
//! the cross-device merge costs per call (each device's output and statistics read back, the host merge).

use anyhow::{Context, Result, bail};
use expertkv_core::attend::{AttendOptions, Attention};
use expertkv_core::bench::{AttendShape, fill_random, random_tokens};
use expertkv_core::config::{Codec, KvDtype};
use expertkv_core::devices::ShardedPool;
use expertkv_core::rng::Rng;
use expertkv_core::runtime::Runtime;
use expertkv_core::runtime::timer::median;
use serde_json::json;

use crate::GpuArgs;

/// What `bench devices` takes from `bench`'s flags.
pub struct DevicesBench {
    pub devices: u32,
    pub shapes: Vec<(u32, u32)>,
    pub q_heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub dtype: KvDtype,
    pub page_size: u32,
    pub chunk_pages: u32,
    pub warmup: u32,
    pub reps: u32,
    pub json: bool,
}

pub fn run(gpu: &GpuArgs, b: &DevicesBench) -> Result<()> {
    if b.devices < 2 {
        bail!("bench devices: --devices {} (give 2 or more; `bench attend` is the one-device figure)", b.devices);
    }
    let rts = pollster::block_on(Runtime::open_many(gpu.options()?, b.devices)).context("opening the devices")?;
    let refs: Vec<&Runtime> = rts.iter().collect();
    for (i, rt) in rts.iter().enumerate() {
        println!("device {i}: {} ({:?})", rt.info.name, rt.info.backend);
    }
    for &(batch, tokens) in &b.shapes {
        let shape = AttendShape {
            batch,
            q_heads: b.q_heads,
            kv_heads: b.kv_heads,
            head_dim: b.head_dim,
            tokens,
            dtype: b.dtype,
            page_size: b.page_size,
            codec: Codec::None,
            interleave: 0,
        };
        let cfg = shape.pool_config();
        let opts =
            AttendOptions { group: b.q_heads / b.kv_heads, n_seqs: batch, chunk_pages: b.chunk_pages, mass: false, ..Default::default() };
        // The same tokens on one device and spread over all.
        let rt = &rts[0];
        let mut one = pollster::block_on(expertkv_core::append::KvPool::new(rt, cfg.clone()))?;
        fill_random(rt, &mut one, batch, tokens, 7, 0, &mut |_, _| {})?;
        one.gather(rt)?;
        let attn = pollster::block_on(Attention::new(rt, &one, opts.clone()))?;
        let mut sharded = pollster::block_on(ShardedPool::new(&refs, cfg.clone(), opts))?;
        let max_batch = sharded.parts[0].pool.max_append_tokens(rt) as usize;
        let mut append = |t: &[expertkv_core::append::format::NewToken], kv: &[u32], step: u32| sharded.append(&refs, t, kv, step);
        random_tokens(&cfg, (batch, tokens), 7, 0, max_batch, &mut append, &mut |_, _| {})?;
        let mut rng = Rng::new(11);
        let q: Vec<f32> = (0..batch * attn.q_heads() * b.head_dim).map(|_| rng.normal() as f32).collect();
        attn.set_queries(rt, &q)?;
        let (mut single, mut split, mut whole, mut merge) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut worst = 0f64;
        for i in 0..b.warmup + b.reps {
            let t = std::time::Instant::now();
            attn.run(rt, 0, 0)?;
            let want = pollster::block_on(attn.read_output(rt))?;
            let single_s = t.elapsed().as_secs_f64();
            let t = std::time::Instant::now();
            let got = pollster::block_on(sharded.attend(&refs, 0, 0, &q))?;
            let whole_s = t.elapsed().as_secs_f64();
            for (g, w) in got.out.iter().zip(&want) {
                worst = worst.max((f64::from(*g) - f64::from(*w)).abs() / (1e-3 + f64::from(w.abs())));
            }
            if i >= b.warmup {
                single.push(single_s * 1e3);
                whole.push(whole_s * 1e3);
                split.push(got.attend_and_read_s * 1e3);
                merge.push(got.merge_s * 1e3);
            }
        }
        let (s, w, sp, m) = (median(&single), median(&whole), median(&split), median(&merge));
        let held: Vec<u64> = sharded.parts.iter().map(|p| p.tokens).collect();
        if b.json {
            println!(
                "{}",
                json!({"measure": "attend_devices", "shape": shape.label(), "devices": b.devices, "adapter": rts[0].info.name,
                       "one_device_ms": s, "devices_ms": w, "attend_and_readback_ms": sp, "merge_ms": m, "scaling": s / w,
                       "tokens_per_device": held, "worst_relative_difference": worst, "reps": b.reps})
            );
        } else {
            println!(
                "{}: one device {s:.3} ms (attention and its output read back); {} devices {w:.3} ms ({sp:.3} ms attention on all and outputs read back, {m:.3} ms host merge): {:.2}x; tokens per device {held:?}; outputs agree within {worst:.1e} (relative)",
                shape.label(),
                b.devices,
                s / w
            );
        }
    }
    Ok(())
}
