//! A runtime on a device the application made (`Runtime::from_device`): its capabilities are
//! the device's, not the adapter's, the kernels it then picks match their CPU references, and
//! its error checks see the device's errors.

use expertkv_core::append::KvPool;
use expertkv_core::attend::{AttendOptions, Attention};
use expertkv_core::config::{Codec, KvDtype, PoolConfig, ShardMap};
use expertkv_core::reference::attend::{ATTENTION_ATOL, ATTENTION_RTOL};
use expertkv_core::reference::{PoolModel, attend_decode};
use expertkv_core::rng::Rng;
use expertkv_core::runtime::{Runtime, ShaderChecks, Tier};

use crate::append::{assert_same_state, random_batch, random_kv};
use crate::common::{POISON_F32, rt, seeds};

/// A device as an application might ask for it: subgroups if the adapter has them, nothing else
/// (no shader-f16, no timestamps), the default limits raised to the adapter's.
fn app_runtime() -> Runtime {
    let shared = rt();
    let adapter = shared.adapter.clone();
    let features = adapter.features() & wgpu::Features::SUBGROUP;
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("the application's device"),
        required_features: features,
        required_limits: adapter.limits(),
        ..Default::default()
    }))
    .expect("the application's device");
    Runtime::from_device(shared.instance.clone(), adapter, device, queue, ShaderChecks::Checked).expect("runtime on it")
}

#[test]
fn a_runtime_on_an_applications_device_runs_the_kernels() {
    let app = app_runtime();
    let shared = rt();
    assert!(!app.caps.f16 && !app.caps.timestamps, "the device has neither shader-f16 nor timestamps: {:?}", app.caps);
    assert_eq!(app.caps.subgroups, shared.caps.subgroups, "subgroups were enabled where the adapter has them");
    assert_eq!(app.tier, if app.caps.subgroups { Tier::Subgroups } else { Tier::Baseline });
    assert_eq!(app.info.name, shared.info.name);

    for seed in seeds("a_runtime_on_an_applications_device_runs_the_kernels", 2) {
        let mut rng = Rng::new(seed);
        let cfg = PoolConfig {
            layers: 2,
            kv_heads: 2,
            head_dim: 32,
            page_size: 8,
            dtype: KvDtype::F16,
            n_pages: 96,
            max_seqs: 3,
            n_shards: 2,
            ring_capacity: 16,
            top_k: 2,
            shard_map: ShardMap::Pikv { n_tok: 2, n_exp: 2 },
            max_buffer_bytes: None,
            codec: Codec::None,
            codec_pages: 0,
        };
        let ctx = format!("seed {seed}");
        let mut pool = pollster::block_on(KvPool::new(&app, cfg.clone())).expect("pool");
        let mut model = PoolModel::new(&cfg);
        let mut positions = vec![0u32; cfg.max_seqs as usize];
        for step in 0..4 {
            let toks = random_batch(&mut rng, &cfg, &mut positions, 24, false);
            let kv = random_kv(&mut rng, &cfg, toks.len());
            pool.append(&app, &toks, &kv, step).unwrap_or_else(|e| panic!("{ctx}: append: {e}"));
            model.append(&toks, &kv, step).unwrap_or_else(|e| panic!("{ctx}: reference append: {e}"));
        }
        assert_same_state(&app, &pool, &model, &ctx);
        pool.gather(&app).expect("gather");
        let group = 2;
        let attn = pollster::block_on(Attention::new(
            &app,
            &pool,
            AttendOptions { group, n_seqs: cfg.max_seqs, chunk_pages: 4, mass: false, ..Default::default() },
        ))
        .unwrap_or_else(|e| panic!("{ctx}: attention: {e}"));
        let q: Vec<f32> = (0..cfg.max_seqs * attn.q_heads() * cfg.head_dim).map(|_| rng.normal() as f32).collect();
        attn.set_queries(&app, &q).expect("queries");
        for layer in 0..cfg.layers {
            app.fill_u32(&attn.out, POISON_F32);
            attn.run(&app, layer, 0).expect("attend");
            let got = pollster::block_on(attn.read_output(&app)).expect("out");
            let want = attend_decode(&model, layer, cfg.max_seqs, &q, group, f64::from(attn.scale()));
            for (i, (g, w)) in got.iter().zip(&want.out).enumerate() {
                let tol = ATTENTION_ATOL + ATTENTION_RTOL * w.abs();
                assert!((f64::from(*g) - w).abs() <= tol, "{ctx}: layer {layer}, output {i}: {g} vs {w} ({})", attn.describe());
            }
        }
    }
}

#[test]
fn a_runtime_on_an_applications_device_sees_its_errors() {
    let app = app_runtime();
    app.check("a fresh device").expect("no error yet");
    // A copy past the end of a buffer: a validation error outside any error scope.
    let small = app.storage("too small", 16);
    let mut enc = app.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("bad copy") });
    enc.copy_buffer_to_buffer(&small, 0, &small, 8, 64);
    app.queue.submit([enc.finish()]);
    app.device.poll(wgpu::PollType::wait_indefinitely()).ok();
    let err = app.check("the bad copy").expect_err("the copy's validation error must reach Runtime::check");
    assert!(err.to_string().contains("the bad copy"), "{err}");
}

/// A device made with WebGPU's downlevel limits (4 storage buffers per stage, 256 invocations
/// per workgroup, 16 KiB of workgroup storage) is refused when handed over, naming the limit,
/// rather than failing kernel by kernel inside wgpu's validation.
#[test]
fn a_device_with_downlevel_limits_is_refused_by_name() {
    let shared = rt();
    let adapter = shared.adapter.clone();
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("a downlevel device"),
        required_limits: wgpu::Limits::downlevel_defaults(),
        ..Default::default()
    }))
    .expect("a downlevel device");
    let e = Runtime::from_device(shared.instance.clone(), adapter, device, queue, ShaderChecks::Checked).err().expect("refused");
    let msg = e.to_string();
    assert!(msg.contains("max_storage_buffers_per_shader_stage is 4") && msg.contains("device_descriptor"), "{msg}");
    shared.check("the shared runtime is untouched").expect("healthy");
}
