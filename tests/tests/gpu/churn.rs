//! The pool's invariants under churn: random sequences of appends, evictions (H2O and
//! StreamingLLM), ring releases and whole-sequence releases, with the GPU pool read back and
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

use expertkv_core::append::{KvPool, PoolSnapshot};
use expertkv_core::config::{Codec, KvDtype, PoolConfig, ShardMap};
use expertkv_core::evict::Scheduler;
use expertkv_core::evict::config::{SchedulerConfig, Threshold};
use expertkv_core::gpu_data::{NO_OWNER, meta};
use expertkv_core::rng::Rng;

use crate::append::{random_batch, random_kv};
use crate::common::{replaying, rt, seeds};

/// A token's identity in the pool: (layer, sequence, KV head, position).
type TokenId = (u32, u32, u32, u32);

/// Check the invariants on `snap`; `appended` holds every token appended so far. Returns the
/// tokens cached now.
fn check(cfg: &PoolConfig, snap: &PoolSnapshot, appended: &HashSet<TokenId>, compacted: &HashSet<usize>, ctx: &str) -> usize {
    let n = cfg.n_pages as usize;
    let free_top = snap.ctl.free_top as usize;
    assert!(free_top <= n, "{ctx}: free top {free_top} over {n} pages");
    // Where each page is: the free stack or one ring.
    let mut seen = vec![false; n];
    for &p in &snap.free_stack[..free_top] {
        assert!((p as usize) < n, "{ctx}: free stack holds page {p}");
        assert!(!seen[p as usize], "{ctx}: page {p} is on the free stack twice");
        seen[p as usize] = true;
        assert_eq!(snap.page_meta[p as usize].owner, NO_OWNER, "{ctx}: free page {p} has an owner");
    }
    let cap = cfg.ring_capacity as usize;
    let mut live = HashSet::new();
    let mut slots_in_use = 0usize;
    let mut used = 0usize;
    for (key, ring) in snap.rings.iter().enumerate() {
        assert!(ring.count as usize <= cap, "{ctx}: ring {key} holds {} pages, capacity {cap}", ring.count);
        let shard_of = key as u32 % cfg.n_shards;
        let list = key as u32 / cfg.n_shards;
        let (head, seq, layer) = (list % cfg.kv_heads, (list / cfg.kv_heads) % cfg.max_seqs, list / (cfg.kv_heads * cfg.max_seqs));
        let _ = shard_of;
        let mut last_position = None;
        for i in 0..ring.count as usize {
            let p = snap.ring_pages[key * cap + (ring.head as usize + i) % cap];
            assert!((p as usize) < n, "{ctx}: ring {key} holds page {p}");
            assert!(!seen[p as usize], "{ctx}: page {p} is in two places (ring {key})");
            seen[p as usize] = true;
            used += 1;
            let pm = snap.page_meta[p as usize];
            assert_eq!(pm.owner, key as u32, "{ctx}: page {p} of ring {key} names owner {}", pm.owner);
            assert!(pm.fill <= cfg.page_size, "{ctx}: page {p} filled {} of {}", pm.fill, cfg.page_size);
            slots_in_use += pm.fill as usize;
            for s in 0..pm.fill {
                let m = ((p * cfg.page_size + s) * cfg.meta_words()) as usize;
                let position = snap.slot_meta[m + meta::POSITION];
                let id = (layer, seq, head, position);
                assert!(appended.contains(&id), "{ctx}: page {p} slot {s} holds {id:?}, never appended");
                assert!(live.insert(id), "{ctx}: {id:?} is cached twice");
                if let Some(prev) = last_position.filter(|_| !compacted.contains(&key)) {
                    assert!(position > prev, "{ctx}: ring {key} holds position {position} after {prev}");
                }
                last_position = Some(position);
            }
        }
    }
    assert_eq!(free_top + used, n, "{ctx}: {free_top} free + {used} in rings is not the {n} pages");
    assert!(seen.iter().all(|&s| s), "{ctx}: a page is neither free nor in a ring");
    assert_eq!(live.len(), slots_in_use, "{ctx}: cached tokens against the pages' fills");
    live.len()
}

#[test]
fn pool_invariants_hold_under_churn() {
    let rt = rt();
    let (mut ops, mut evictions, mut releases, mut sequence_releases, mut peak) = (0u32, 0u32, 0u32, 0u32, 0usize);
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
        let mut positions = vec![0u32; cfg.max_seqs as usize];
        let mut appended = HashSet::new();
        let mut compacted = HashSet::new();
        for step in 0..40u32 {
            let ctx = format!("{ctx0}, operation {step}");
            let op = match rng.below(10) {
                0..=4 => "append",
                5..=6 => "evict",
                7..=8 => "release",
                _ => "release sequence",
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
                _ => {
                    pool.release_sequence(rt, rng.below(cfg.max_seqs)).unwrap_or_else(|e| panic!("{ctx}: release sequence: {e}"));
                    sequence_releases += 1;
                }
            }
            let snap = pollster::block_on(pool.snapshot(rt)).expect("snapshot");
            // An emptied ring starts over in order.
            compacted.retain(|&k| snap.rings[k].count > 0);
            peak = peak.max(check(&cfg, &snap, &appended, &compacted, &format!("{ctx} ({op})")));
            ops += 1;
        }
    }
    if !replaying() {
        assert!(
            ops >= 100 && evictions > 5 && releases > 5 && sequence_releases > 1 && peak > 100,
            "coverage: {ops} operations, {evictions} evictions, {releases} ring releases, {sequence_releases} sequence releases, \
             at most {peak} tokens cached"
        );
    }
}
