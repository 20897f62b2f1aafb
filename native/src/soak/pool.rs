//! The soak of the synthetic workload: random K/V and queries through the decode step's stages
//! (`expertkv_core::step`, as the demo's pipeline runs them), one token per sequence and layer a
//! step, under an evicting scheduler and a page codec (either or both).

use std::collections::HashSet;

use anyhow::{Result, bail};
use expertkv_core::append::format::{NewToken, encode_values};
use expertkv_core::append::invariants::TokenId;
use expertkv_core::config::{Codec, KvDtype, PoolConfig, ShardMap};
use expertkv_core::evict::config::{SchedulerConfig, Threshold};
use expertkv_core::evict::recall::RecallConfig;
use expertkv_core::rng::Rng;
use expertkv_core::step::{self, Attend, Checks, HostSource, KvPause, KvSide, KvSideConfig, Recorder, Run};

use super::{Checker, SoakArgs};
use crate::GpuArgs;

/// Query heads per KV head.
const GROUP: u32 = 2;

pub(super) fn run(gpu: &GpuArgs, a: &SoakArgs, (min_len, max_len): (u32, u32)) -> Result<()> {
    let sched = match a.scheduler.as_str() {
        "none" => None,
        s => Some(SchedulerConfig::parse_for_budget(s, a.budget)?),
    };
    let codec = a.codec.as_deref().map_or(Ok(Codec::None), Codec::parse)?;
    if let Some(s) = sched.as_ref().filter(|s| !s.uses_evict_kernels()) {
        bail!("--scheduler {}: the soak runs the evicting schedulers (h2o, streaming-llm, lru, lru-plus, adakv, duo)", s.name());
    }
    if codec.is_low_rank() {
        bail!("--codec {}: the low-rank codecs need a calibration the soak does not run; use int8, int4 or fastv-dims", codec.name());
    }
    let page = 16;
    let ring = max_len.div_ceil(page) + 2;
    let lists = a.layers * a.seqs * a.kv_heads;
    let mut cfg = PoolConfig {
        layers: a.layers,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        page_size: page,
        dtype: KvDtype::F16,
        n_pages: lists * ring,
        max_seqs: a.seqs,
        n_shards: 1,
        ring_capacity: ring + 1,
        top_k: 1,
        shard_map: ShardMap::ByExpert,
        max_buffer_bytes: None,
        codec: Codec::None,
        codec_pages: 0,
    };
    if codec != Codec::None {
        // Raw pages for each list's newest page, one to spare, and (under eviction) the pages
        // an eviction thaws.
        let thaw = if sched.is_some() { 3 } else { 0 };
        (cfg.codec, cfg.codec_pages, cfg.n_pages) = (codec, lists * ring, lists * (3 + thaw));
    }
    let kv_cfg = KvSideConfig {
        pool: cfg.clone(),
        policy: sched.clone().map(|s| (s, a.budget)),
        pyramid: None,
        threshold: Threshold::default(),
        allocator: None,
        group: GROUP,
        chunk_pages: 8,
        route: None,
        recall: a.recall.map(|pages| RecallConfig::new(pages, max_len.next_multiple_of(page))),
    };
    kv_cfg.validate()?;
    let rt = gpu.runtime()?;
    let mut kv = pollster::block_on(KvSide::new(&rt, &kv_cfg))?;
    if !a.json {
        println!(
            "adapter: {} ({:?}); soak: {} steps, {} sequences of {min_len}..={max_len} tokens, {} layers x {} KV heads x {}, {}; pool {} pages ({} MiB)",
            rt.info.name,
            rt.info.backend,
            a.steps,
            a.seqs,
            a.layers,
            a.kv_heads,
            a.head_dim,
            match (&sched, codec) {
                (Some(s), Codec::None) => format!("{} keeping {} tokens", s.name(), a.budget),
                (Some(s), c) => format!("{} keeping {} tokens in {} pages", s.name(), a.budget, c.spec()),
                (None, Codec::None) => "full cache".into(),
                (None, c) => format!("codec {}", c.spec()),
            },
            cfg.n_ids(),
            kv.pool.kv_bytes_allocated() / (1 << 20)
        );
    }
    let mut rng = Rng::new(a.seed);
    let draw = |rng: &mut Rng| min_len + rng.below(max_len - min_len + 1);
    let mut positions = vec![0u32; a.seqs as usize];
    let mut targets: Vec<u32> = (0..a.seqs).map(|_| draw(&mut rng)).collect();
    let mut appended: HashSet<TokenId> = HashSet::new();
    // Evictions compact rings (their order is not checked); every ring under a scheduler.
    let compacted: HashSet<usize> = if sched.is_some() { (0..cfg.n_keys() as usize).collect() } else { HashSet::new() };
    let mut checker = Checker::new(&rt, a.json, cfg.clone(), compacted);
    let q_len = (a.seqs * a.kv_heads * GROUP * a.head_dim) as usize;
    let mut staged = None;
    let mut finished = 0u64;
    for step in 0..a.steps {
        let mut tokens = Vec::new();
        for layer in 0..a.layers {
            for seq in 0..a.seqs {
                tokens.push(NewToken { layer, seq, position: positions[seq as usize], experts: vec![rng.below(8)], gates: vec![1.0] });
            }
        }
        let values: Vec<f32> = (0..tokens.len() * (2 * a.kv_heads * a.head_dim) as usize).map(|_| rng.normal() as f32).collect();
        let mut words = Vec::new();
        encode_values(&values, cfg.dtype, &mut words);
        for t in &tokens {
            for h in 0..a.kv_heads {
                appended.insert((t.layer, t.seq, h, t.position));
            }
        }
        let queries: Vec<Vec<f32>> = (0..a.layers).map(|_| (0..q_len).map(|_| rng.normal() as f32).collect()).collect();
        let lens: Vec<u32> = positions.iter().map(|p| p + 1).collect();
        kv.prepare(&rt, &tokens, a.seqs, step, 0, Some(&lens))?;
        kv.attn.stage_queries(&rt, &queries)?;
        let words_buf = HostSource::stage(&rt, &mut staged, &words);
        let source =
            HostSource { attn: &kv.attn, words: words_buf, layer_bytes: words.len() as u64 * 4 / u64::from(a.layers), attends: true };
        let run = Run { per_layer: a.seqs, attend: Attend::Decode, evict: true, miss: false, checks: Checks::default() };
        let mut rec = Recorder::<KvPause>::new(&rt, "soak step", None);
        step::record(&kv, &source, &mut rec, run)?;
        rt.queue.submit(rec.finish().into_iter().map(|s| s.cb));
        rt.check("soak step")?;
        for seq in 0..a.seqs as usize {
            positions[seq] += 1;
            if positions[seq] >= targets[seq] {
                kv.release_sequence(&rt, seq as u32)?;
                appended.retain(|id| id.1 != seq as u32);
                (positions[seq], targets[seq]) = (0, draw(&mut rng));
                finished += 1;
            }
        }
        if (step + 1) % a.check_every == 0 || step + 1 == a.steps {
            pollster::block_on(kv.pool.check_errors(&rt, tokens.len() as u32))?;
            let snap = pollster::block_on(kv.pool.snapshot(&rt))?;
            checker.window(u64::from(step + 1), &snap, &|id| appended.contains(&id), finished)?;
        }
    }
    checker.summary(&format!("{} steps, the invariants held at every check; {finished} sequences finished", a.steps))
}
