//! A pool larger than the adapter's storage-binding limit is split over buffers; tokens placed
//! on both sides of the boundary are stored and attended exactly as the reference says.

use expertkv_core::append::KvPool;
use expertkv_core::attend::{AttendOptions, Attention, SplitVariant};
use expertkv_core::config::{Codec, KvDtype, PoolConfig, ShardMap};
use expertkv_core::rng::Rng;
use expertkv_core::{
    append::format::NewToken,
    reference::{PoolModel, attend_decode},
};

use crate::append::random_kv;
use crate::common::{POISON_F32, rt, seeds, skip};

#[test]
fn pool_crosses_the_real_binding_limit() {
    let rt = rt();
    let limit = rt.max_binding_bytes();
    // 128 KiB pages (f32, one head x 256 dims x 64 slots x K,V), 8 KV heads: a few pages past
    // the limit.
    let mut cfg = PoolConfig {
        layers: 1,
        kv_heads: 8,
        head_dim: 256,
        page_size: 64,
        dtype: KvDtype::F32,
        n_pages: 0,
        max_seqs: 1,
        n_shards: 1,
        ring_capacity: 0,
        top_k: 1,
        shard_map: ShardMap::ByExpert,
        max_buffer_bytes: None,
        codec: Codec::None,
        codec_pages: 0,
    };
    let per_buffer = (limit / cfg.page_bytes()) as u32;
    if per_buffer > 4096 {
        skip(
            "pool_crosses_the_real_binding_limit",
            format!("this adapter's binding limit ({limit} bytes) would need a pool over 512 MiB to cross"),
        );
        return;
    }
    // Whole pages for every head: each token takes one slot in each of the 8 heads' rings.
    cfg.n_pages = (per_buffer / cfg.kv_heads + 1) * cfg.kv_heads;
    cfg.ring_capacity = cfg.n_pages / cfg.kv_heads + 1;
    let seed = seeds("pool_crosses_the_real_binding_limit", 1)[0];
    let mut rng = Rng::new(seed);
    let mut pool = pollster::block_on(KvPool::new(rt, cfg.clone())).expect("pool");
    assert_eq!(pool.n_buffers(), 2, "seed {seed}: pool of {} bytes over limit {limit}", cfg.n_pages as u64 * cfg.page_bytes());
    assert!(pool.kv_buffers.iter().all(|b| b.size() <= limit));
    let mut model = PoolModel::new(&cfg);
    // Every page, all slots: tokens land on both sides of the boundary.
    let total = cfg.n_pages * cfg.page_size / cfg.kv_heads;
    let batch = 2048;
    let mut pos = 0;
    while pos < total {
        let n = batch.min(total - pos);
        let toks: Vec<NewToken> =
            (pos..pos + n).map(|p| NewToken { layer: 0, seq: 0, position: p, experts: vec![0], gates: vec![1.0] }).collect();
        let kv = random_kv(&mut rng, &cfg, n as usize);
        pool.append(rt, &toks, &kv, 0).expect("append");
        model.append(&toks, &kv, 0).expect("append");
        pos += n;
    }
    pool.gather(rt).expect("gather");
    let kv = pollster::block_on(pool.read_kv(rt)).expect("kv");
    assert!(kv == model.kv, "seed {seed}: K/V across the buffer boundary differ from the reference");

    let attn = pollster::block_on(Attention::new(
        rt,
        &pool,
        AttendOptions { group: 2, n_seqs: 1, chunk_pages: 16, mass: false, variant: Some(SplitVariant::Tiled), ..Default::default() },
    ))
    .expect("attention");
    let q: Vec<f32> = (0..attn.q_heads() * cfg.head_dim).map(|_| rng.normal() as f32).collect();
    attn.set_queries(rt, &q).expect("queries");
    rt.fill_u32(&attn.out, POISON_F32);
    attn.run(rt, 0, 0).expect("attend");
    let got = pollster::block_on(attn.read_output(rt)).expect("out");
    let want = attend_decode(&model, 0, 1, &q, 2, f64::from(attn.scale()));
    for (i, (g, w)) in got.iter().zip(&want.out).enumerate() {
        assert!((f64::from(*g) - w).abs() <= 2e-5 + 1e-4 * w.abs(), "seed {seed}: out[{i}] = {g}, reference {w}");
    }
}

/// The bytes a pool allocates for its pages and tables equal what its configuration predicts
/// (`PoolConfig::pool_bytes`, which a GPU memory budget is planned with), for random shapes,
/// pools split over several buffers, and compressed pools; so do QUEST's bounds and lists.
#[test]
fn a_pools_allocated_bytes_are_the_predicted_bytes() {
    let rt = rt();
    for seed in seeds("pool_bytes", 8) {
        let mut rng = Rng::new(seed);
        let cfg = if rng.below(2) == 0 { crate::append::random_config(&mut rng) } else { crate::compress::config(&mut rng) };
        let pool = pollster::block_on(KvPool::new(rt, cfg.clone())).expect("pool");
        let predicted = cfg.pool_bytes(rt.max_binding_bytes());
        assert_eq!(pool.pool_bytes_allocated(), predicted, "seed {seed}: {cfg:?}");
        assert!(predicted >= u64::from(cfg.n_pages) * cfg.page_bytes(), "seed {seed}");
        let quest = pollster::block_on(expertkv_core::evict::quest::Quest::new(rt, &pool, cfg.page_size)).expect("quest");
        assert_eq!(quest.bytes_allocated(), expertkv_core::evict::quest::Quest::bytes(&cfg), "seed {seed}: QUEST");
    }
}
