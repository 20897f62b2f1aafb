//! The pool's invariants under churn: random sequences of appends, evictions (H2O and
//! StreamingLLM), ring releases, whole-sequence releases and QUEST selections (its page bounds
//! and choices checked against the pool as it then stands), with the GPU pool read back and
//! checked after every operation, without the CPU reference (which the stage tests compare
//! against): every page is free or owned by one ring, exactly once; free + used = total; no
//! cached token is duplicated and each was appended; the slots in use equal the pages' fills;
//! a ring keeps its tokens in the order they were appended until an eviction compacts it.
//!
//! Compaction (`evict/compact.wgsl`) fills the holes victims leave with the ring's newest
//! survivors, the fewest moves, so a compacted ring's pages no longer hold its tokens oldest
//! first; the test checks order on the rings no eviction has moved slots in since they were last
//! empty.

use std::collections::HashSet;

use expertkv_core::append::KvPool;
use expertkv_core::attend::{AttendOptions, Attention};
use expertkv_core::config::{Codec, KvDtype, PoolConfig, ShardMap};
use expertkv_core::evict::Scheduler;
use expertkv_core::evict::config::{SchedulerConfig, Threshold};
use expertkv_core::evict::quest::Quest;
use expertkv_core::rng::Rng;

use crate::append::{random_batch, random_kv};
use crate::common::{fixed_seeds, rt, seeds};

#[test]
fn pool_invariants_hold_under_churn() {
    let rt = rt();
    let (mut ops, mut evictions, mut releases, mut sequence_releases, mut peak) = (0u32, 0u32, 0u32, 0u32, 0usize);
    let mut selections = 0u32;
    for seed in seeds("pool_invariants_hold_under_churn", 4) {
        let mut rng = Rng::new(seed);
        let n_shards = [1, 2, 4][rng.below(3) as usize];
        let cfg = PoolConfig {
            layers: 1 + rng.below(2),
            kv_heads: 1 + rng.below(2),
            head_dim: 8,
            page_size: [4, 8][rng.below(2) as usize],
            dtype: KvDtype::F16,
            n_pages: 160 + rng.below(64),
            max_seqs: 2 + rng.below(2),
            n_shards,
            ring_capacity: 12 + rng.below(8),
            top_k: 1 + rng.below(2),
            shard_map: if n_shards > 1 { ShardMap::Pikv { n_tok: n_shards, n_exp: n_shards } } else { ShardMap::ByExpert },
            max_buffer_bytes: None,
            codec: Codec::None,
            codec_pages: 0,
        };
        let sched =
            if rng.below(2) == 0 { SchedulerConfig::H2o { sinks: 2, window: 4 } } else { SchedulerConfig::StreamingLlm { sinks: 2 } };
        let budget = cfg.page_size * (2 + rng.below(3));
        let ctx0 = format!("seed {seed}: {sched:?}, budget {budget}, {cfg:?}");
        let mut pool = pollster::block_on(KvPool::new(rt, cfg.clone())).unwrap_or_else(|e| panic!("{ctx0}: {e}"));
        let s =
            pollster::block_on(Scheduler::new(rt, &pool, sched, budget, Threshold::default())).unwrap_or_else(|e| panic!("{ctx0}: {e}"));
        // QUEST over the same pool: attention reads the pages it selects for its queries.
        let group = 1 + rng.below(3);
        let quest_budget = cfg.page_size * (1 + rng.below(3));
        let mut quest = pollster::block_on(Quest::new(rt, &pool, quest_budget)).unwrap_or_else(|e| panic!("{ctx0}: {e}"));
        let attn = pollster::block_on(Attention::with_lists(
            rt,
            &pool,
            AttendOptions { group, n_seqs: cfg.max_seqs, mass: false, ..Default::default() },
            Some((&quest.sel_list, &quest.sel_counts)),
        ))
        .unwrap_or_else(|e| panic!("{ctx0}: {e}"));
        quest.bind(rt, &pool, &attn);
        let mut positions = vec![0u32; cfg.max_seqs as usize];
        let mut appended = HashSet::new();
        let mut compacted = HashSet::new();
        for step in 0..40u32 {
            let ctx = format!("{ctx0}, operation {step}");
            let op = match rng.below(11) {
                0..=4 => "append",
                5..=6 => "evict",
                7..=8 => "release",
                9 => "release sequence",
                _ => "quest",
            };
            match op {
                "append" => {
                    let n = 1 + rng.below(4 * cfg.page_size) as usize;
                    let toks = random_batch(&mut rng, &cfg, &mut positions, n, false);
                    let kv = random_kv(&mut rng, &cfg, toks.len());
                    match pool.append(rt, &toks, &kv, step) {
                        Ok(()) => {
                            for t in &toks {
                                for h in 0..cfg.kv_heads {
                                    appended.insert((t.layer, t.seq, h, t.position));
                                }
                            }
                        }
                        // A full pool refuses the batch and writes nothing: the invariants hold.
                        Err(expertkv_core::Error::PoolExhausted { .. }) => {}
                        Err(e) => panic!("{ctx}: append: {e}"),
                    }
                }
                "evict" => {
                    pool.gather(rt).expect("gather");
                    let lens: Vec<u32> = positions.clone();
                    s.run(rt, step, &lens).unwrap_or_else(|e| panic!("{ctx}: evict: {e}"));
                    let moved = pollster::block_on(s.read_ring_counts(rt)).expect("ring counts");
                    compacted.extend(moved.iter().enumerate().filter(|(_, c)| c[0] > 0).map(|(k, _)| k));
                    evictions += 1;
                }
                "release" => {
                    let counts: Vec<u32> = (0..cfg.n_keys()).map(|_| rng.below(3)).collect();
                    pool.release(rt, &counts).unwrap_or_else(|e| panic!("{ctx}: release: {e}"));
                    releases += 1;
                }
                "release sequence" => {
                    pool.release_sequence(rt, rng.below(cfg.max_seqs)).unwrap_or_else(|e| panic!("{ctx}: release sequence: {e}"));
                    sequence_releases += 1;
                }
                _ => {
                    pool.gather(rt).expect("gather");
                    let layer = rng.below(cfg.layers);
                    let q: Vec<f32> = (0..cfg.max_seqs * attn.q_heads() * cfg.head_dim).map(|_| rng.normal() as f32).collect();
                    attn.set_queries(rt, &q).expect("queries");
                    crate::quest::run_select(rt, &quest, &attn, layer);
                    let model = pollster::block_on(expertkv_core::pipeline::pool_model_of(rt, &pool)).expect("pool model");
                    crate::quest::check_selection(rt, &model, &quest, attn.q_heads(), &q, group, quest_budget, layer, &ctx);
                    selections += 1;
                }
            }
            let snap = pollster::block_on(pool.snapshot(rt)).expect("snapshot");
            // An emptied ring starts over in order.
            compacted.retain(|&k| snap.rings[k].count > 0);
            let cached =
                snap.check_invariants(&cfg, &|id| appended.contains(&id), &compacted).unwrap_or_else(|e| panic!("{ctx} ({op}): {e}"));
            peak = peak.max(cached);
            ops += 1;
        }
    }
    if fixed_seeds() {
        assert!(
            ops >= 100 && evictions > 5 && releases > 5 && sequence_releases > 1 && selections > 3 && peak > 100,
            "coverage: {ops} operations, {evictions} evictions, {releases} ring releases, {sequence_releases} sequence releases, \
             {selections} QUEST selections, at most {peak} tokens cached"
        );
    }
}

/// The same invariants on a compressed pool (int8 or int4 pages): appends, the codec's
/// compression of full pages, H2O or StreamingLLM evictions (which thaw the compressed pages
/// they touch), ring releases and whole-sequence releases, every page raw or compressed on its
/// own free stack or in exactly one ring after every operation, and the pool's state (K/V and
/// compressed pages included) equal to the CPU pool model's. (Found by `expertkv soak --codec int4`: a
/// release once pushed compressed pages onto the raw free stack.)
#[test]
fn compressed_pool_invariants_hold_under_churn() {
    use expertkv_core::reference::PoolModel;
    let rt = rt();
    for seed in seeds("compressed_pool_invariants_hold_under_churn", 3) {
        let mut rng = Rng::new(seed);
        let cfg = PoolConfig {
            layers: 1 + rng.below(2),
            kv_heads: 1 + rng.below(2),
            head_dim: 8,
            page_size: 8,
            dtype: KvDtype::F16,
            n_pages: 48,
            max_seqs: 2 + rng.below(2),
            n_shards: 1,
            ring_capacity: 24,
            top_k: 1,
            shard_map: ShardMap::ByExpert,
            max_buffer_bytes: None,
            codec: if rng.below(2) == 0 { Codec::Int8 { group: 8 } } else { Codec::Int4 { group: 8 } },
            codec_pages: 160,
        };
        let sched =
            if rng.below(2) == 0 { SchedulerConfig::H2o { sinks: 2, window: 4 } } else { SchedulerConfig::StreamingLlm { sinks: 2 } };
        let budget = cfg.page_size * (3 + rng.below(3));
        let ctx0 = format!("seed {seed}: {sched:?}, budget {budget}, {cfg:?}");
        let mut pool = pollster::block_on(KvPool::new(rt, cfg.clone())).unwrap_or_else(|e| panic!("{ctx0}: {e}"));
        let s =
            pollster::block_on(Scheduler::new(rt, &pool, sched, budget, Threshold::default())).unwrap_or_else(|e| panic!("{ctx0}: {e}"));
        let mut model = PoolModel::new(&cfg);
        let mut positions = vec![0u32; cfg.max_seqs as usize];
        let mut appended = HashSet::new();
        let (mut compressed_peak, mut sequence_releases, mut thawed) = (0u32, 0, 0u32);
        let mut compacted = HashSet::new();
        for step in 0..48u32 {
            let ctx = format!("{ctx0}, operation {step}");
            match rng.below(12) {
                9..=10 => {
                    // Evict, checked against the CPU reference (utilities, budgets, victims,
                    // the thaw's counts), starting from the lockstep model.
                    pool.gather(rt).expect("gather");
                    let lens = positions.clone();
                    let before = pollster::block_on(s.read_lists(rt)).expect("lists");
                    s.run(rt, step, &lens).unwrap_or_else(|e| panic!("{ctx}: evict: {e}"));
                    let after = pollster::block_on(s.read_lists(rt)).expect("lists");
                    pollster::block_on(expertkv_core::pipeline::check_eviction(rt, &s, &mut model, step, &lens, &before, &after))
                        .unwrap_or_else(|e| panic!("{ctx}: {e}"));
                    thawed += pollster::block_on(s.read_thaw(rt)).expect("thaw").map_or(0, |t| t.pages);
                    let moved = pollster::block_on(s.read_ring_counts(rt)).expect("ring counts");
                    compacted.extend(moved.iter().enumerate().filter(|(_, c)| c[0] > 0).map(|(k, _)| k));
                }
                0..=6 => {
                    let n = 1 + rng.below(6 * cfg.page_size) as usize;
                    let toks = random_batch(&mut rng, &cfg, &mut positions, n, false);
                    let kv = random_kv(&mut rng, &cfg, toks.len());
                    match pool.append(rt, &toks, &kv, step) {
                        Ok(()) => {
                            model.append(&toks, &kv, step).unwrap_or_else(|e| panic!("{ctx}: model append: {e}"));
                            appended.extend(toks.iter().flat_map(|t| (0..cfg.kv_heads).map(move |h| (t.layer, t.seq, h, t.position))));
                            pool.compress(rt).unwrap_or_else(|e| panic!("{ctx}: compress: {e}"));
                            model.compress();
                        }
                        Err(expertkv_core::Error::PoolExhausted { .. }) => {}
                        Err(e) => panic!("{ctx}: append: {e}"),
                    }
                }
                7..=8 => {
                    let counts: Vec<u32> = (0..cfg.n_keys()).map(|_| rng.below(3)).collect();
                    pool.release(rt, &counts).unwrap_or_else(|e| panic!("{ctx}: release: {e}"));
                    model.release(&counts);
                }
                _ => {
                    let seq = rng.below(cfg.max_seqs);
                    pool.release_sequence(rt, seq).unwrap_or_else(|e| panic!("{ctx}: release sequence: {e}"));
                    let counts: Vec<u32> = (0..cfg.n_keys())
                        .map(|k| if (k / cfg.n_shards / cfg.kv_heads) % cfg.max_seqs == seq { u32::MAX } else { 0 })
                        .collect();
                    model.release(&counts);
                    sequence_releases += 1;
                }
            }
            let snap = pollster::block_on(pool.snapshot(rt)).expect("snapshot");
            compacted.retain(|&k| snap.rings[k].count > 0);
            snap.check_invariants(&cfg, &|id| appended.contains(&id), &compacted).unwrap_or_else(|e| panic!("{ctx}: {e}"));
            pollster::block_on(expertkv_core::pipeline::compare_pool(rt, &pool, &model)).unwrap_or_else(|e| panic!("{ctx}: {e}"));
            compressed_peak = compressed_peak.max(cfg.codec_pages - snap.ctl.codec_free_top);
        }
        if fixed_seeds() {
            assert!(
                compressed_peak > 4 && sequence_releases > 0 && thawed > 0,
                "{ctx0}: {compressed_peak} compressed pages at most, {sequence_releases} sequence releases, {thawed} pages thawed"
            );
        }
    }
}

/// The host tier under churn: random appends, FlexGen offloads (the coldest pages past the
/// budget to host memory) and fetches (host pages whose QUEST bound for random queries beats the
/// weakest resident page's), and whole-sequence releases, with the pool's invariants checked
/// after every operation and every token of a live sequence in exactly one tier, GPU or host.
#[test]
fn host_tier_keeps_every_token_once_under_churn() {
    use expertkv_core::evict::flexgen::FlexGen;
    use expertkv_core::evict::quest::Quest;
    let rt = rt();
    let (mut offloads, mut fetched) = (0u32, 0u64);
    for seed in seeds("host_tier_keeps_every_token_once_under_churn", 3) {
        let mut rng = Rng::new(seed);
        let cfg = PoolConfig {
            layers: 1 + rng.below(2),
            kv_heads: 1 + rng.below(2),
            head_dim: 8,
            page_size: 4,
            dtype: KvDtype::F16,
            n_pages: 160,
            max_seqs: 2,
            n_shards: 1,
            ring_capacity: 48,
            top_k: 1,
            shard_map: ShardMap::ByExpert,
            max_buffer_bytes: None,
            codec: Codec::None,
            codec_pages: 0,
        };
        let budget = cfg.page_size * (2 + rng.below(3));
        let group = 2;
        let ctx0 = format!("seed {seed}: budget {budget}, {cfg:?}");
        let mut pool = pollster::block_on(KvPool::new(rt, cfg.clone())).unwrap_or_else(|e| panic!("{ctx0}: {e}"));
        let mut fg = FlexGen::new(&pool, budget).unwrap_or_else(|e| panic!("{ctx0}: {e}"));
        let quest = pollster::block_on(Quest::new(rt, &pool, budget)).unwrap_or_else(|e| panic!("{ctx0}: {e}"));
        let bounds = |pool: &KvPool| -> Vec<f32> {
            pool.gather(rt).expect("gather");
            let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("bounds") });
            quest.encode_summarize(&mut enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None }));
            rt.queue.submit([enc.finish()]);
            pollster::block_on(rt.read_all(&quest.bounds)).expect("bounds")
        };
        let mut positions = vec![0u32; cfg.max_seqs as usize];
        let mut live = HashSet::new();
        for step in 0..40u32 {
            let ctx = format!("{ctx0}, operation {step}");
            match rng.below(10) {
                0..=4 => {
                    let n = 1 + rng.below(4 * cfg.page_size) as usize;
                    let toks = random_batch(&mut rng, &cfg, &mut positions, n, false);
                    let kv = random_kv(&mut rng, &cfg, toks.len());
                    match pool.append(rt, &toks, &kv, step) {
                        Ok(()) => live.extend(toks.iter().flat_map(|t| (0..cfg.kv_heads).map(move |h| (t.layer, t.seq, h, t.position)))),
                        Err(expertkv_core::Error::PoolExhausted { .. }) => {}
                        Err(e) => panic!("{ctx}: append: {e}"),
                    }
                }
                5..=6 => {
                    let b = bounds(&pool);
                    pollster::block_on(fg.offload(rt, &pool, &b)).unwrap_or_else(|e| panic!("{ctx}: offload: {e}"));
                    offloads += 1;
                }
                7..=8 => {
                    let b = bounds(&pool);
                    let q_len = (cfg.max_seqs * cfg.kv_heads * group * cfg.head_dim) as usize;
                    for layer in 0..cfg.layers {
                        let q: Vec<f32> = (0..q_len).map(|_| rng.normal() as f32).collect();
                        pollster::block_on(fg.fetch(rt, &pool, layer, &q, group, &b)).unwrap_or_else(|e| panic!("{ctx}: fetch: {e}"));
                    }
                }
                _ => {
                    let seq = rng.below(cfg.max_seqs);
                    pool.release_sequence(rt, seq).unwrap_or_else(|e| panic!("{ctx}: release sequence: {e}"));
                    fg.release_sequence(&cfg, seq);
                    live.retain(|id| id.1 != seq);
                }
            }
            let snap = pollster::block_on(pool.snapshot(rt)).expect("snapshot");
            let on_gpu = std::cell::RefCell::new(Vec::new());
            // Offloads take pages out of a ring's middle: ring order is not checked here.
            let all: HashSet<usize> = (0..cfg.n_keys() as usize).collect();
            snap.check_invariants(
                &cfg,
                &|id| {
                    on_gpu.borrow_mut().push(id);
                    live.contains(&id)
                },
                &all,
            )
            .unwrap_or_else(|e| panic!("{ctx}: {e}"));
            let mut tiers: Vec<_> = on_gpu.into_inner();
            tiers.extend(fg.host_token_ids(&cfg));
            let n = tiers.len();
            let tiers: HashSet<_> = tiers.into_iter().collect();
            assert_eq!(n, tiers.len(), "{ctx}: a token in both tiers or twice");
            assert_eq!(tiers, live, "{ctx}: the tiers hold exactly the live sequences' tokens");
        }
        fetched += fg.stats.fetched_pages;
    }
    if fixed_seeds() {
        assert!(offloads > 5 && fetched > 0, "coverage: {offloads} offloads, {fetched} pages fetched");
    }
}

/// A thaw short of raw pages: the rings whose touched compressed pages still fit are thawed and
/// compacted, the rest (a prefix rule, key order) keep every token this eviction, and the GPU
/// and the CPU pool model agree on both, the counts and the whole pool.
#[test]
fn a_thaw_short_of_raw_pages_defers_whole_rings() {
    use expertkv_core::append::format::NewToken;
    use expertkv_core::reference::PoolModel;
    let rt = rt();
    let seed = seeds("thaw_defers", 1)[0];
    let mut rng = Rng::new(seed);
    let cfg = PoolConfig {
        layers: 1,
        kv_heads: 2,
        head_dim: 8,
        page_size: 8,
        dtype: KvDtype::F16,
        // Every ring's newest page and four to spare.
        n_pages: 8,
        max_seqs: 2,
        n_shards: 1,
        ring_capacity: 24,
        top_k: 1,
        shard_map: ShardMap::ByExpert,
        max_buffer_bytes: None,
        codec: Codec::Int8 { group: 8 },
        codec_pages: 64,
    };
    let mut pool = pollster::block_on(KvPool::new(rt, cfg.clone())).expect("pool");
    let s = pollster::block_on(Scheduler::new(rt, &pool, SchedulerConfig::H2o { sinks: 2, window: 4 }, 16, Threshold::default()))
        .expect("scheduler");
    let mut model = PoolModel::new(&cfg);
    // Sequence 0 holds 24 tokens (its rings need few thaws), sequence 1 holds 80 (more than the
    // raw pages free), appended 8 positions at a time and compressed as they go.
    let mut positions = [0u32; 2];
    for (step, (seq, n)) in [(0u32, 24u32), (1, 80)].into_iter().flat_map(|(q, n)| (0..n / 8).map(move |_| (q, 8))).enumerate() {
        let toks: Vec<NewToken> = (0..n)
            .map(|i| NewToken { layer: 0, seq, position: positions[seq as usize] + i, experts: vec![rng.below(8)], gates: vec![1.0] })
            .collect();
        positions[seq as usize] += n;
        let kv = random_kv(&mut rng, &cfg, toks.len());
        pool.append(rt, &toks, &kv, step as u32).expect("append");
        model.append(&toks, &kv, step as u32).expect("model append");
        pool.compress(rt).expect("compress");
        model.compress();
    }
    pollster::block_on(expertkv_core::pipeline::compare_pool(rt, &pool, &model)).expect("before the eviction");
    pool.gather(rt).expect("gather");
    let lens = positions.to_vec();
    let before = pollster::block_on(s.read_lists(rt)).expect("lists");
    s.run(rt, 0, &lens).expect("evict");
    let after = pollster::block_on(s.read_lists(rt)).expect("lists");
    pollster::block_on(expertkv_core::pipeline::check_eviction(rt, &s, &mut model, 0, &lens, &before, &after))
        .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    pollster::block_on(expertkv_core::pipeline::compare_pool(rt, &pool, &model)).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    let t = pollster::block_on(s.read_thaw(rt)).expect("thaw").expect("a codec thaws");
    assert!(t.pages > 0 && t.deferred_rings == 2, "seed {seed}: sequence 0's rings thawed, sequence 1's deferred: {t:?}");
    // Sequence 0 kept its budget; sequence 1 kept everything.
    let snap = pollster::block_on(pool.snapshot(rt)).expect("snapshot");
    let tokens = |key: usize| snap.rings[key].count.saturating_sub(1) * cfg.page_size + snap.rings[key].fill;
    assert_eq!([tokens(0), tokens(1), tokens(2), tokens(3)], [16, 16, 80, 80], "seed {seed}: {:?}", snap.rings);
    snap.check_invariants(&cfg, &|_| true, &(0..4).collect()).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
}
