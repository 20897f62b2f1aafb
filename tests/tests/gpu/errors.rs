//! Bad input and impossible configurations give clear errors and change nothing.

use expertkv_core::Error;
use expertkv_core::append::KvPool;
use expertkv_core::attend::{AttendOptions, Attention};
use expertkv_core::config::{Codec, KvDtype, PoolConfig, ShardMap};
use expertkv_core::rng::Rng;
use expertkv_core::{append::format::NewToken, reference::PoolModel};

use crate::append::{assert_same_state, random_kv};
use crate::common::rt;

fn small() -> PoolConfig {
    PoolConfig {
        layers: 1,
        kv_heads: 2,
        head_dim: 16,
        page_size: 4,
        dtype: KvDtype::F16,
        n_pages: 6,
        max_seqs: 2,
        n_shards: 1,
        ring_capacity: 8,
        top_k: 1,
        shard_map: ShardMap::ByExpert,
        max_buffer_bytes: None,
        codec: Codec::None,
        codec_pages: 0,
    }
}

fn tok(seq: u32, position: u32) -> NewToken {
    NewToken { layer: 0, seq, position, experts: vec![0], gates: vec![1.0] }
}

#[test]
fn exhausted_pool_refuses_the_batch_and_keeps_everything() {
    let rt = rt();
    let cfg = small();
    let mut pool = pollster::block_on(KvPool::new(rt, cfg.clone())).expect("pool");
    let mut model = PoolModel::new(&cfg);
    let mut rng = Rng::new(3);
    let first: Vec<NewToken> = (0..8).map(|p| tok(0, p)).collect();
    let kv = random_kv(&mut rng, &cfg, 8);
    pool.append(rt, &first, &kv, 0).expect("append");
    model.append(&first, &kv, 0).expect("append");
    // 6 pages of 4 slots, 2 KV heads: 8 tokens used 2 pages per head; 8 more need 4 but 2 are free.
    let second: Vec<NewToken> = (0..8).map(|p| tok(1, p)).collect();
    let kv2 = random_kv(&mut rng, &cfg, 8);
    pool.append(rt, &second, &kv2, 1).expect("submission itself succeeds");
    let err = pollster::block_on(pool.check_errors(rt, 2)).expect_err("exhaustion must be reported");
    assert!(matches!(err, Error::PoolExhausted { .. }), "{err}");
    assert!(err.to_string().contains("nothing was written"), "{err}");
    // The first sequence's tokens are intact; nothing of the refused batch landed.
    assert_same_state(rt, &pool, &model, "after refused batch");
}

#[test]
fn bad_tokens_are_refused_with_a_clear_error() {
    let rt = rt();
    let cfg = small();
    let mut pool = pollster::block_on(KvPool::new(rt, cfg.clone())).expect("pool");
    let mut rng = Rng::new(4);
    // Sequence out of range: refused on the GPU, reported by check_errors.
    let kv = random_kv(&mut rng, &cfg, 1);
    pool.append(rt, &[tok(7, 0)], &kv, 0).expect("submitted");
    let err = pollster::block_on(pool.check_errors(rt, 1)).expect_err("bad token");
    assert!(err.to_string().contains("max_seqs"), "{err}");
    // Wrong K/V length, wrong top-k, NaN gates: refused on the host before any GPU work.
    let e = pool.append(rt, &[tok(0, 0)], &kv[..1], 0).expect_err("short kv");
    assert!(e.to_string().contains("K/V data"), "{e}");
    let mut t = tok(0, 0);
    t.experts.push(3);
    assert!(pool.append(rt, &[t], &kv, 0).expect_err("top-k").to_string().contains("top_k"));
    let mut t = tok(0, 0);
    t.gates[0] = f32::NAN;
    assert!(pool.append(rt, &[t], &kv, 0).expect_err("nan").to_string().contains("not finite"));
    let too_many: Vec<NewToken> = (0..100).map(|p| tok(0, p)).collect();
    let kv100 = random_kv(&mut rng, &cfg, 100);
    assert!(pool.append(rt, &too_many, &kv100, 0).expect_err("batch").to_string().contains("split the batch"));
}

#[test]
fn impossible_configs_name_the_field() {
    let rt = rt();
    let mut cfg = small();
    cfg.head_dim = 12;
    let e = pollster::block_on(KvPool::new(rt, cfg)).err().expect("head_dim");
    assert!(e.to_string().contains("head_dim"), "{e}");
    let mut cfg = small();
    cfg.max_buffer_bytes = Some(64);
    let e = pollster::block_on(KvPool::new(rt, cfg)).err().expect("buffer");
    assert!(e.to_string().contains("max_buffer_bytes"), "{e}");
    let pool = pollster::block_on(KvPool::new(rt, small())).expect("pool");
    let e = pollster::block_on(Attention::new(rt, &pool, AttendOptions { group: 9, ..Default::default() })).err().expect("group");
    assert!(e.to_string().contains("group"), "{e}");
    let e =
        pollster::block_on(Attention::new(rt, &pool, AttendOptions { n_seqs: 5, group: 2, ..Default::default() })).err().expect("n_seqs");
    assert!(e.to_string().contains("n_seqs"), "{e}");
}

#[test]
fn non_finite_queries_are_refused() {
    let rt = rt();
    let pool = pollster::block_on(KvPool::new(rt, small())).expect("pool");
    let attn = pollster::block_on(Attention::new(rt, &pool, AttendOptions { group: 2, n_seqs: 1, ..Default::default() })).expect("attn");
    let mut q = vec![0.5f32; (attn.q_heads() * 16) as usize];
    q[3] = f32::INFINITY;
    let e = attn.set_queries(rt, &q).expect_err("inf");
    assert!(e.to_string().contains("not finite"), "{e}");
}

/// A layer outside the last staging is refused, even when an earlier, larger staging left room
/// for it in the buffers.
#[test]
fn unstaged_layers_are_refused() {
    let rt = rt();
    let pool = pollster::block_on(KvPool::new(rt, small())).expect("pool");
    let mut attn =
        pollster::block_on(Attention::new(rt, &pool, AttendOptions { group: 2, n_seqs: 1, ..Default::default() })).expect("attn");
    let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("test") });
    assert!(attn.encode_layer_params(&mut enc, 0).expect_err("nothing staged").to_string().contains("no staged layers"));
    attn.stage_params(rt, 0, 4);
    attn.encode_layer_params(&mut enc, 3).expect("layer 3 of 4");
    attn.stage_params(rt, 1, 2);
    attn.encode_layer_params(&mut enc, 1).expect("layer 1 of 2");
    let e = attn.encode_layer_params(&mut enc, 3).expect_err("layer 3 after staging 2");
    assert!(e.to_string().contains("was not staged"), "{e}");
    let e = attn.encode_layer_inputs(&mut enc, 2).expect_err("layer 2 after staging 2");
    assert!(e.to_string().contains("was not staged"), "{e}");
}

#[test]
fn lost_device_is_an_error_not_a_panic() {
    let opts = expertkv_core::RuntimeOptions::from_env().expect("env");
    let rt = pollster::block_on(expertkv_core::Runtime::new(opts)).expect("runtime");
    let mut pool = pollster::block_on(KvPool::new(&rt, small())).expect("pool");
    rt.device.destroy();
    let _ = rt.device.poll(wgpu::PollType::wait_indefinitely());
    assert!(rt.is_lost(), "destroy must trip the device-lost callback");
    let mut rng = Rng::new(9);
    let kv = random_kv(&mut rng, &small(), 1);
    let e = pool.append(&rt, &[tok(0, 0)], &kv, 0).expect_err("lost device");
    assert!(matches!(e, Error::DeviceLost { .. }), "{e}");
}

/// Objects made on one device and handed another runtime are refused by name before anything
/// reaches wgpu (which would otherwise report a validation error, or abort, mid-encode).
#[test]
fn objects_of_another_device_are_refused() {
    let a = rt();
    let b =
        pollster::block_on(expertkv_core::Runtime::new(expertkv_core::RuntimeOptions::from_env().expect("env"))).expect("a second device");
    let cfg = small();
    let mut pool = pollster::block_on(KvPool::new(a, cfg.clone())).expect("pool");
    let kv = random_kv(&mut Rng::new(5), &cfg, 1);
    let e = pool.append(&b, &[tok(0, 0)], &kv, 0).expect_err("append on another device");
    assert!(e.to_string().contains("another runtime"), "{e}");
    assert!(pool.gather(&b).expect_err("gather").to_string().contains("another runtime"));
    let e = pollster::block_on(Attention::new(&b, &pool, AttendOptions { group: 2, n_seqs: 1, ..Default::default() }))
        .err()
        .expect("attention");
    assert!(e.to_string().contains("another runtime"), "{e}");
    let attn = pollster::block_on(Attention::new(a, &pool, AttendOptions { group: 2, n_seqs: 1, ..Default::default() })).expect("attn");
    let q = vec![0.5f32; (attn.q_heads() * 16) as usize];
    assert!(attn.set_queries(&b, &q).expect_err("queries").to_string().contains("another runtime"));
    assert!(attn.run(&b, 0, 0).expect_err("run").to_string().contains("another runtime"));
    // Nothing was harmed on the right device.
    pool.append(a, &[tok(0, 0)], &kv, 0).expect("append on its own device");
    a.check("after the refusals").expect("device a healthy");
}

/// A pool larger than the device allows is refused by `KvPool::new` with the limit it breaks,
/// before anything is allocated (the device stays healthy and a pool that fits still builds).
#[test]
fn a_pool_larger_than_the_device_allows_is_refused_before_allocating() {
    let rt = rt();
    let mut cfg = small();
    cfg.page_size = 64;
    cfg.n_pages = 1 << 22; // 2^28 slots: their metadata alone is over any binding limit here
    cfg.ring_capacity = 1 << 22;
    let e = pollster::block_on(KvPool::new(rt, cfg)).err().expect("too large");
    assert!(matches!(e, Error::Limit { .. }), "{e}");
    assert!(e.to_string().contains("max_storage_buffer_binding_size"), "{e}");
    rt.check("after the refusal").expect("healthy");
    pollster::block_on(KvPool::new(rt, small())).expect("a pool that fits");
}
