//! QUEST: page key bounds exactly, page selection against the CPU (bounds within f32 tolerance,
//! the selection exact given the GPU's keys), and the selected pages hold the top keys.

use expertkv_core::append::KvPool;
use expertkv_core::append::format::encode_values;
use expertkv_core::attend::{AttendOptions, Attention};
use expertkv_core::config::{Codec, KvDtype, PoolConfig, ShardMap};
use expertkv_core::evict::quest::Quest;
use expertkv_core::gpu_data::from_orderable;
use expertkv_core::reference::PoolModel;
use expertkv_core::rng::Rng;
use expertkv_core::runtime::Runtime;
use expertkv_core::workload::{Workload, WorkloadConfig};

use crate::append::{random_batch, random_kv};
use crate::common::{POISON_U32, rt, seeds};

/// Refresh the page bounds and select `layer`'s pages for the queries set in `attn`.
pub(crate) fn run_select(rt: &Runtime, quest: &Quest, attn: &Attention, layer: u32) {
    quest.prepare(rt, layer, attn);
    let mut enc = rt.device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        quest.encode_summarize(&mut pass);
        quest.encode_select(&mut pass, layer).expect("bound");
    }
    rt.queue.submit([enc.finish()]);
    rt.wait().expect("wait");
}

/// QUEST's state after [`run_select`] against `model` (the pool's contents): every owned page's
/// key bounds exactly, each listed page's upper bound within f32 tolerance of the f64 one for
/// the queries `q`, and `layer`'s selection exact given the GPU's keys (the best pages for the
/// budget, in list order).
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_selection(
    rt: &Runtime,
    model: &PoolModel,
    quest: &Quest,
    q_heads: u32,
    q: &[f32],
    group: u32,
    budget: u32,
    layer: u32,
    ctx: &str,
) {
    let cfg = &model.cfg;
    let d = cfg.head_dim as usize;
    let bounds: Vec<f32> = pollster::block_on(rt.read_all(&quest.bounds)).expect("bounds");
    for (page, pm) in model.page_meta.iter().enumerate() {
        if pm.owner == u32::MAX || pm.fill == 0 {
            continue;
        }
        for i in 0..d {
            let vals: Vec<f64> = (0..pm.fill).map(|s| model.vector(page as u32, s, 0)[i]).collect();
            let lo = vals.iter().cloned().fold(f64::INFINITY, f64::min);
            let hi = vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            assert_eq!(f64::from(bounds[page * 2 * d + i]), lo, "{ctx}: min of page {page} dim {i}");
            assert_eq!(f64::from(bounds[page * 2 * d + d + i]), hi, "{ctx}: max of page {page} dim {i}");
        }
    }
    let sel: Vec<u32> = pollster::block_on(rt.read_all(&quest.sel_list)).expect("sel");
    let counts: Vec<u32> = pollster::block_on(rt.read_all(&quest.sel_counts)).expect("counts");
    let keys: Vec<u32> = pollster::block_on(rt.read_all(quest.page_keys())).expect("keys");
    let maxp = cfg.max_pages_per_seq() as usize;
    for seq in 0..cfg.max_seqs {
        for h in 0..cfg.kv_heads {
            let li = model.list_index(layer, seq, h) as usize;
            let list = model.page_list(layer, seq, h);
            // Upper bounds within f32 tolerance of the f64 ones.
            for (j, page) in list.iter().enumerate() {
                let p = *page as usize;
                let mut best = f64::NEG_INFINITY;
                for g in 0..group {
                    let q0 = ((seq * q_heads + h * group + g) * cfg.head_dim) as usize;
                    let ub: f64 = (0..d)
                        .map(|i| {
                            let qi = f64::from(q[q0 + i]);
                            (qi * f64::from(bounds[p * 2 * d + i])).max(qi * f64::from(bounds[p * 2 * d + d + i]))
                        })
                        .sum();
                    best = best.max(ub);
                }
                let got = f64::from(from_orderable(!keys[li * maxp + j]));
                assert!((got - best).abs() <= 1e-4 * (1.0 + best.abs()), "{ctx}: bound of list {li} page {j}: {got} vs {best}");
            }
            // Selection exact given the GPU's keys: the best `keep`, in list order.
            let keep = (budget.div_ceil(cfg.page_size) as usize).min(list.len());
            let mut order: Vec<usize> = (0..list.len()).collect();
            order.sort_by_key(|j| (keys[li * maxp + j], *j));
            let mut chosen: Vec<usize> = order[..keep].to_vec();
            chosen.sort_unstable();
            let want: Vec<u32> = chosen.iter().map(|j| list[*j]).collect();
            assert_eq!(counts[li] as usize, keep, "{ctx}: selected count of list {li}");
            assert_eq!(sel[li * maxp..li * maxp + keep], want[..], "{ctx}: selected pages of list {li}");
        }
    }
}

#[test]
fn quest_bounds_and_selection_gpu_match_cpu() {
    let rt = rt();
    for seed in seeds("quest", 10) {
        let mut rng = Rng::new(seed);
        let shards = 1 + rng.below(2);
        let cfg = PoolConfig {
            layers: 1,
            kv_heads: 1 + rng.below(3),
            head_dim: [8u32, 16, 64][rng.below(3) as usize],
            page_size: [4u32, 8, 16][rng.below(3) as usize],
            dtype: if rng.below(2) == 0 { KvDtype::F16 } else { KvDtype::F32 },
            n_pages: 400,
            max_seqs: 1 + rng.below(3),
            n_shards: shards,
            ring_capacity: 40,
            top_k: 1,
            shard_map: ShardMap::Pikv { n_tok: shards, n_exp: shards },
            max_buffer_bytes: if rng.below(2) == 0 { None } else { Some(4096 * 8) },
            codec: Codec::None,
            codec_pages: 0,
        };
        let ctx = format!("seed {seed}: {cfg:?}");
        let mut pool = pollster::block_on(KvPool::new(rt, cfg.clone())).expect("pool");
        let mut model = PoolModel::new(&cfg);
        let mut positions = vec![0u32; cfg.max_seqs as usize];
        for step in 0..4 {
            let n = 1 + rng.below(40) as usize;
            let toks = random_batch(&mut rng, &cfg, &mut positions, n, false);
            let kv = random_kv(&mut rng, &cfg, n);
            pool.append(rt, &toks, &kv, step).expect("append");
            model.append(&toks, &kv, step).expect("append");
        }
        pool.gather(rt).expect("gather");
        let group = 1 + rng.below(4);
        let budget = cfg.page_size * (1 + rng.below(4));
        let mut quest = pollster::block_on(Quest::new(rt, &pool, budget)).expect("quest");
        let attn = pollster::block_on(Attention::with_lists(
            rt,
            &pool,
            AttendOptions { group, n_seqs: cfg.max_seqs, mass: false, ..Default::default() },
            Some((&quest.sel_list, &quest.sel_counts)),
        ))
        .expect("attention");
        quest.bind(rt, &pool, &attn);
        let q: Vec<f32> = (0..cfg.max_seqs * attn.q_heads() * cfg.head_dim).map(|_| rng.normal() as f32).collect();
        attn.set_queries(rt, &q).expect("queries");
        rt.fill_u32(&quest.sel_list, POISON_U32);
        run_select(rt, &quest, &attn, 0);
        check_selection(rt, &model, &quest, attn.q_heads(), &q, group, budget, 0, &ctx);
    }
}

#[test]
fn quest_selected_pages_hold_the_top_keys() {
    const TOP: usize = 8;
    let rt = rt();
    let seed = seeds("quest_recall", 1)[0];
    let wcfg = WorkloadConfig { seed, n_seqs: 2, layers: 1, kv_heads: 2, group: 4, head_dim: 64, prompt_len: 0, ..Default::default() };
    let mut w = Workload::new(wcfg.clone()).expect("workload");
    let cfg = PoolConfig {
        layers: 1,
        kv_heads: 2,
        head_dim: 64,
        page_size: 16,
        dtype: KvDtype::F16,
        n_pages: 512,
        max_seqs: 2,
        n_shards: 2,
        ring_capacity: 64,
        top_k: 2,
        shard_map: ShardMap::Pikv { n_tok: 2, n_exp: 2 },
        max_buffer_bytes: None,
        codec: Codec::None,
        codec_pages: 0,
    };
    let mut pool = pollster::block_on(KvPool::new(rt, cfg.clone())).expect("pool");
    let mut model = PoolModel::new(&cfg);
    for step in 0..16 {
        let toks = w.next_positions(32);
        let mut words = Vec::new();
        for t in &toks {
            encode_values(&t.k, cfg.dtype, &mut words);
            encode_values(&t.v, cfg.dtype, &mut words);
        }
        let new: Vec<_> = toks.iter().map(|t| t.token.clone()).collect();
        pool.append(rt, &new, &words, step).expect("append");
        model.append(&new, &words, step).expect("append");
    }
    pool.gather(rt).expect("gather");
    let budget = 128; // a quarter of the 512 tokens
    let mut quest = pollster::block_on(Quest::new(rt, &pool, budget)).expect("quest");
    let attn = pollster::block_on(Attention::with_lists(
        rt,
        &pool,
        AttendOptions { group: 4, n_seqs: 2, mass: false, ..Default::default() },
        Some((&quest.sel_list, &quest.sel_counts)),
    ))
    .expect("attention");
    quest.bind(rt, &pool, &attn);
    let q = w.queries(0);
    attn.set_queries(rt, &q).expect("queries");
    run_select(rt, &quest, &attn, 0);
    let sel: Vec<u32> = pollster::block_on(rt.read_all(&quest.sel_list)).expect("sel");
    let counts: Vec<u32> = pollster::block_on(rt.read_all(&quest.sel_counts)).expect("counts");
    let maxp = cfg.max_pages_per_seq() as usize;
    let (mut found, mut total) = (0, 0);
    for seq in 0..2 {
        for h in 0..2 {
            let li = model.list_index(0, seq, h) as usize;
            let chosen = &sel[li * maxp..li * maxp + counts[li] as usize];
            let mut scored: Vec<(f64, u32)> = model
                .tokens(0, seq, h)
                .iter()
                .map(|&(page, s)| {
                    let k = model.vector(page, s, 0);
                    let best = (0..4)
                        .map(|g| {
                            let q0 = ((seq * 8 + h * 4 + g) * 64) as usize;
                            (0..64).map(|i| f64::from(q[q0 + i]) * k[i]).sum::<f64>()
                        })
                        .fold(f64::NEG_INFINITY, f64::max);
                    (best, page)
                })
                .collect();
            scored.sort_by(|a, b| b.0.total_cmp(&a.0));
            for (_, page) in &scored[..TOP] {
                total += 1;
                found += usize::from(chosen.contains(page));
            }
        }
    }
    let recall = found as f64 / total as f64;
    assert!(recall >= 0.9, "seed {seed}: recall of the top-{TOP} keys in QUEST's pages {recall}");
}
