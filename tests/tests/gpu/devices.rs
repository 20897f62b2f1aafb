//! The pool's shards on two devices (`expertkv_core::devices`): two devices opened from the one
//! adapter stand in for two GPUs. Every token lands on the device of its shard, and decode
//! attention split over both (each device's split and reduce passes, their outputs and softmax
//! statistics merged on the host, the merged statistics sent back for the mass pass) equals the one-device pool's attention and
//! attention mass.

use std::collections::HashMap;

use expertkv_core::append::KvPool;
use expertkv_core::attend::{AttendOptions, Attention};
use expertkv_core::config::{Codec, KvDtype, PoolConfig, ShardMap};
use expertkv_core::devices::ShardedPool;
use expertkv_core::gpu_data::meta;
use expertkv_core::pipeline::pool_model_of;
use expertkv_core::rng::Rng;
use expertkv_core::runtime::Runtime;

use crate::append::{random_batch, random_kv};
use crate::common::{POISON_F32, rt, rt_trusted, seeds};

/// Random pools of 2 or 4 shards (PiKV's map or by expert, top 1 or 2), several sequences and
/// layers, filled in random batches on one device and on two: per layer, random queries give the
/// same output within f32 rounding (the partials, outputs and statistics poisoned before each
/// run), and every token's
/// accumulated attention mass is the same on the device holding it; the devices hold exactly
/// the tokens of their shards, and both hold some.
#[test]
fn shards_on_two_devices_attend_as_one_pool() {
    let devices = [rt(), rt_trusted()];
    for seed in seeds("sharded_pool", 4) {
        let mut rng = Rng::new(seed);
        let n_shards = [2u32, 4][rng.below(2) as usize];
        let top_k = 1 + rng.below(2);
        let shard_map = if rng.below(2) == 0 { ShardMap::ByExpert } else { ShardMap::Pikv { n_tok: n_shards, n_exp: n_shards } };
        let ring = 6 + rng.below(6);
        let mut cfg = PoolConfig {
            layers: 1 + rng.below(2),
            kv_heads: 1 + rng.below(2),
            head_dim: [16u32, 32, 64][rng.below(3) as usize],
            page_size: [4u32, 8, 16][rng.below(3) as usize],
            dtype: if rng.below(2) == 0 { KvDtype::F16 } else { KvDtype::F32 },
            n_pages: 0,
            max_seqs: 1 + rng.below(3),
            n_shards,
            ring_capacity: ring,
            top_k,
            shard_map,
            max_buffer_bytes: None,
            codec: Codec::None,
            codec_pages: 0,
        };
        cfg.n_pages = cfg.n_keys() * ring;
        let opts = AttendOptions {
            group: 1 + rng.below(4),
            n_seqs: cfg.max_seqs,
            chunk_pages: 1 + rng.below(4),
            mass: true,
            ..Default::default()
        };
        let ctx = format!("seed {seed}: {cfg:?}, group {}, chunk_pages {}", opts.group, opts.chunk_pages);
        let rt = devices[0];
        let mut one = pollster::block_on(KvPool::new(rt, cfg.clone())).expect("pool");
        let attn = pollster::block_on(Attention::new(rt, &one, opts.clone())).expect("attention");
        let mut two = pollster::block_on(ShardedPool::new(&devices, cfg.clone(), opts.clone())).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        let mut positions = vec![0u32; cfg.max_seqs as usize];
        let mut on_device = [0u64; 2];
        let target = cfg.n_shards * (ring - 1) * cfg.page_size / 2 * cfg.max_seqs / 2;
        let mut step = 0;
        while positions.iter().sum::<u32>() < target {
            let n = 1 + rng.below(((ring - 1) * cfg.page_size).min(32)) as usize;
            let tokens = random_batch(&mut rng, &cfg, &mut positions, n, false);
            let kv = random_kv(&mut rng, &cfg, n);
            for t in &tokens {
                on_device[two.device_of(t) as usize] += 1;
            }
            one.append(rt, &tokens, &kv, step).expect("append");
            one.gather(rt).expect("gather");
            two.append(&devices, &tokens, &kv, step).unwrap_or_else(|e| panic!("{ctx}: {e}"));
            step += 1;
        }
        assert_eq!(two.parts.iter().map(|p| p.tokens).collect::<Vec<_>>(), on_device, "{ctx}");
        assert!(on_device.iter().all(|&n| n > 0), "{ctx}: a device holds nothing: {on_device:?}");
        for (part, rt) in two.parts.iter().zip(devices) {
            pollster::block_on(part.pool.check_errors(rt, 0)).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        }
        for layer in 0..cfg.layers {
            let q: Vec<f32> = (0..opts.n_seqs * attn.q_heads() * cfg.head_dim).map(|_| rng.normal() as f32 * 2.0).collect();
            attn.set_queries(rt, &q).expect("queries");
            rt.fill_u32(&attn.out, POISON_F32);
            for (part, rt) in two.parts.iter().zip(devices) {
                for b in [&part.attn.partials, &part.attn.out, &part.attn.stats] {
                    rt.fill_u32(b, POISON_F32);
                }
            }
            attn.run(rt, layer, step).expect("attend");
            let want = pollster::block_on(attn.read_output(rt)).expect("output");
            let got = pollster::block_on(two.attend(&devices, layer, step, &q)).unwrap_or_else(|e| panic!("{ctx}: {e}"));
            assert_eq!(got.out.len(), want.len(), "{ctx}");
            for (i, (g, w)) in got.out.iter().zip(&want).enumerate() {
                let (g, w) = (f64::from(*g), f64::from(*w));
                assert!((g - w).abs() <= 2e-5 + 1e-4 * w.abs(), "{ctx}: layer {layer} output[{i}]: two devices {g}, one {w}");
            }
            // A record of head_dim + 2 floats a head a device, whatever the context.
            let heads = u64::from(opts.n_seqs * attn.q_heads());
            assert!(
                got.bytes_read == 2 * heads * u64::from(cfg.head_dim + 2) * 4 && got.merge_s >= 0.0 && got.mass_s > 0.0,
                "{ctx}: {} bytes read, merge {} s, mass {} s",
                got.bytes_read,
                got.merge_s,
                got.mass_s
            );
        }
        let want = token_mass(rt, &one);
        let mut got = HashMap::new();
        for (part, rt) in two.parts.iter().zip(devices) {
            got.extend(token_mass(rt, &part.pool));
        }
        assert_eq!(got.len(), want.len(), "{ctx}: tokens held");
        assert!(want.values().any(|&m| m > 0.0), "{ctx}: no mass accumulated");
        for (k, w) in &want {
            let g = got.get(k).unwrap_or_else(|| panic!("{ctx}: token {k:?} on no device"));
            let (g, w) = (f64::from(*g), f64::from(*w));
            assert!(
                (g - w).abs() <= 1e-5 + 1e-4 * w.abs(),
                "{ctx}: token (layer, seq, head, position) {k:?}: mass {g} on two devices, {w} on one"
            );
        }
    }
}

/// Every cached token's accumulated attention mass, by (layer, sequence, KV head, position).
fn token_mass(rt: &Runtime, pool: &KvPool) -> HashMap<(u32, u32, u32, u32), f32> {
    let model = pollster::block_on(pool_model_of(rt, pool)).expect("the pool read back");
    let c = &pool.cfg;
    let (mw, attn) = (c.meta_words() as usize, meta::attn(c.top_k as usize));
    let mut out = HashMap::new();
    for layer in 0..c.layers {
        for seq in 0..c.max_seqs {
            for head in 0..c.kv_heads {
                for (page, slot) in model.tokens(layer, seq, head) {
                    let m = (page as usize * c.page_size as usize + slot as usize) * mw;
                    let position = model.slot_meta[m + meta::POSITION];
                    out.insert((layer, seq, head, position), f32::from_bits(model.slot_meta[m + attn]));
                }
            }
        }
    }
    out
}

/// One device, or fewer shards than devices: refused by name.
#[test]
fn a_sharded_pool_refuses_what_it_cannot_split() {
    let devices = [rt(), rt_trusted()];
    let mut cfg = PoolConfig {
        layers: 1,
        kv_heads: 1,
        head_dim: 16,
        page_size: 4,
        dtype: KvDtype::F32,
        n_pages: 0,
        max_seqs: 1,
        n_shards: 1,
        ring_capacity: 4,
        top_k: 1,
        shard_map: ShardMap::ByExpert,
        max_buffer_bytes: None,
        codec: Codec::None,
        codec_pages: 0,
    };
    cfg.n_pages = cfg.n_keys() * 4;
    let opts = AttendOptions { group: 1, n_seqs: 1, chunk_pages: 1, mass: false, ..Default::default() };
    let err = |devs: &[&expertkv_core::runtime::Runtime], cfg: &PoolConfig, o: &AttendOptions| {
        pollster::block_on(ShardedPool::new(devs, cfg.clone(), o.clone())).err().expect("refused").to_string()
    };
    assert!(err(&devices, &cfg, &opts).contains("leave a device empty"));
    cfg.n_shards = 2;
    cfg.n_pages = cfg.n_keys() * 4;
    assert!(err(&devices[..1], &cfg, &opts).contains("one device is the plain pool"));
}
