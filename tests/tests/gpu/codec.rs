//! Page codecs: compression on the GPU bit-exact with the CPU reference (pages, rings, free
//! stacks, metadata), attention over compressed pages against the f64 reference over the decoded
//! values, and the bytes the pool allocates.

use expertkv_core::attend::{AttendOptions, Attention, SplitVariant, subgroup_layout};
use expertkv_core::config::{Codec, KvDtype, PoolConfig, ShardMap};
use expertkv_core::pool::KvPool;
use expertkv_core::reference::{PoolModel, attend_decode};
use expertkv_core::rng::Rng;
use expertkv_core::runtime::Runtime;

use crate::common::{POISON_F32, POISON_U32, rt, seeds};
use crate::shard::{assert_same_state, random_batch, random_kv};

fn random_codec(rng: &mut Rng, d: u32) -> Codec {
    let groups: Vec<u32> = [8u32, 16, 32, 64].into_iter().filter(|g| d.is_multiple_of(*g)).collect();
    let group = groups[rng.below(groups.len() as u32) as usize];
    match rng.below(3) {
        0 => Codec::Int8 { group },
        1 => Codec::Int4 { group },
        _ => Codec::FastvDims { keep: 2 * (1 + rng.below(d / 2)) },
    }
}

fn config(rng: &mut Rng) -> PoolConfig {
    let d = [16u32, 32, 64, 128][rng.below(4) as usize];
    let shards = 1 + rng.below(2);
    let mut cfg = PoolConfig {
        layers: 1 + rng.below(2),
        kv_heads: 1 + rng.below(2),
        head_dim: d,
        page_size: [4u32, 8, 16][rng.below(3) as usize],
        dtype: KvDtype::F16,
        n_pages: 0,
        max_seqs: 1 + rng.below(3),
        n_shards: shards,
        ring_capacity: 24,
        top_k: 1,
        shard_map: ShardMap::Pikv { n_tok: shards, n_exp: shards },
        max_buffer_bytes: None,
        codec: random_codec(rng, d),
        codec_pages: 0,
    };
    // Raw pages for the ring tails and a batch; compressed pages for the rest (sometimes too few).
    cfg.n_pages = cfg.n_keys() * 3 + 8;
    cfg.codec_pages = cfg.n_keys() * (4 + rng.below(12));
    if rng.below(3) == 0 {
        cfg.max_buffer_bytes = Some(cfg.page_bytes() * u64::from(2 + rng.below(6)));
    }
    cfg
}

fn assert_same_codec(rt: &Runtime, pool: &KvPool, model: &PoolModel, ctx: &str) {
    assert_same_state(rt, pool, model, ctx);
    let snap = pollster::block_on(pool.snapshot(rt)).expect("snapshot");
    assert_eq!(snap.codec_free, model.codec_free, "{ctx}: codec free stack");
    let got = pollster::block_on(pool.read_codec_kv(rt)).expect("codec kv");
    let cfg = &model.cfg;
    let cw = cfg.codec.page_words(cfg.page_size, cfg.head_dim) as usize;
    let mw = cfg.meta_words() as usize;
    for id in cfg.n_pages..cfg.n_ids() {
        let pm = model.page_meta[id as usize];
        if pm.owner == u32::MAX {
            continue;
        }
        let c0 = (id - cfg.n_pages) as usize * cw;
        assert_eq!(got[c0..c0 + cw], model.codec_kv[c0..c0 + cw], "{ctx}: compressed page {id} ({:?})", cfg.codec);
        let m0 = id as usize * cfg.page_size as usize * mw;
        assert_eq!(
            snap.slot_meta[m0..m0 + pm.fill as usize * mw],
            model.slot_meta[m0..m0 + pm.fill as usize * mw],
            "{ctx}: metadata of compressed page {id}"
        );
    }
}

#[test]
fn compression_gpu_match_cpu_and_attention_decodes_in_kernel() {
    let rt = rt();
    let mut compressed = 0;
    for seed in seeds("codec", 20) {
        let mut rng = Rng::new(seed);
        let cfg = config(&mut rng);
        let ctx0 = format!("seed {seed}: {cfg:?}");
        let mut pool = pollster::block_on(KvPool::new(rt, cfg.clone())).unwrap_or_else(|e| panic!("{ctx0}: {e}"));
        rt.fill_u32(&pool.codec_kv, POISON_U32);
        let mut model = PoolModel::new(&cfg);
        let mut positions = vec![0u32; cfg.max_seqs as usize];
        for round in 0..5 {
            let ctx = format!("{ctx0}, round {round}");
            let n = 1 + rng.below(pool.max_append_tokens(rt).min(40)) as usize;
            let toks = random_batch(&mut rng, &cfg, &mut positions, n, false);
            let kv = random_kv(&mut rng, &cfg, n);
            pool.append(rt, &toks, &kv, round).expect("append");
            model.append(&toks, &kv, round).expect("append");
            if model.ctl.error_flags != 0 {
                // Raw pages ran out (the compressed pool was too small to free them): fine, but
                // both sides must agree.
                assert_same_state(rt, &pool, &model, &ctx);
                break;
            }
            pool.compress(rt).expect("compress");
            model.compress();
            assert_same_codec(rt, &pool, &model, &ctx);
        }
        compressed += cfg.codec_pages - model.ctl.codec_free_top;
        // Attention over raw and compressed pages, every variant the device has.
        pool.gather(rt).expect("gather");
        let mut variants = vec![SplitVariant::Tiled];
        if let Some(v) = subgroup_layout(rt, cfg.head_dim, cfg.dtype) {
            variants.push(v);
        }
        for variant in variants {
            let group = 1 + rng.below(4);
            let attn = pollster::block_on(Attention::new(
                rt,
                &pool,
                AttendOptions {
                    group,
                    n_seqs: cfg.max_seqs,
                    chunk_pages: 1 + rng.below(4),
                    mass: true,
                    variant: Some(variant),
                    ..Default::default()
                },
            ))
            .expect("attention");
            let q: Vec<f32> = (0..cfg.max_seqs * attn.q_heads() * cfg.head_dim).map(|_| rng.normal() as f32).collect();
            attn.set_queries(rt, &q).expect("queries");
            for layer in 0..cfg.layers {
                rt.fill_u32(&attn.out, POISON_F32);
                attn.run(rt, layer, 9).expect("attend");
                let got = pollster::block_on(attn.read_output(rt)).expect("out");
                let want = attend_decode(&model, layer, cfg.max_seqs, &q, group, f64::from(attn.scale()));
                for (i, (g, w)) in got.iter().zip(&want.out).enumerate() {
                    assert!(
                        (f64::from(*g) - w).abs() <= 2e-5 + 1e-4 * w.abs(),
                        "{ctx0}: {} layer {layer} out[{i}] = {g}, reference {w}",
                        variant.name()
                    );
                }
            }
        }
    }
    if std::env::var("EXPERTKV_TEST_SEED").is_err() {
        assert!(compressed > 50, "only {compressed} pages were compressed: the cases prove little");
    }
}

#[test]
fn compressed_pages_allocate_fewer_bytes() {
    let rt = rt();
    for codec in [Codec::Int8 { group: 32 }, Codec::Int4 { group: 32 }, Codec::FastvDims { keep: 64 }] {
        let cfg = PoolConfig {
            layers: 1,
            kv_heads: 8,
            head_dim: 128,
            page_size: 16,
            dtype: KvDtype::F16,
            n_pages: 64,
            max_seqs: 1,
            n_shards: 1,
            ring_capacity: 64,
            top_k: 1,
            shard_map: ShardMap::ByExpert,
            max_buffer_bytes: None,
            codec,
            codec_pages: 256,
        };
        let pool = pollster::block_on(KvPool::new(rt, cfg.clone())).expect("pool");
        let per_page = cfg.codec_page_bytes();
        // Measured from the allocation, against the layout's formula.
        assert_eq!(pool.codec_bytes_allocated(), 256 * per_page);
        let (p, d) = (16u64, 128u64);
        let formula = match codec {
            Codec::Int8 { group } => d * 4 + 2 * p * d + p * (d / u64::from(group)) * 4,
            Codec::Int4 { group } => d * 4 + p * d + p * (d / u64::from(group)) * 4,
            Codec::FastvDims { keep } => p * u64::from(keep) * 2 + p * d * 2,
            Codec::None => 0,
        };
        assert_eq!(per_page, formula, "{codec:?}");
        assert!(per_page < cfg.page_bytes(), "{codec:?}: {per_page} bytes per page, raw {}", cfg.page_bytes());
    }
}
