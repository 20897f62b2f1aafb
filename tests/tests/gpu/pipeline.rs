//! The demo pipeline end to end on a small workload: the GPU pool equals the CPU reference
//! after prefill and decode, and attention matches the f64 reference.

use expertkv_core::pipeline::{DemoConfig, Pipeline};
use expertkv_core::route::config::RouterConfig;
use expertkv_core::workload::WorkloadConfig;

use crate::common::{fixed_seeds, pick, rt, seeds};

#[test]
fn demo_pipeline_matches_reference() {
    let rt = rt();
    let routers = [RouterConfig::Topk, RouterConfig::default_for("adaptive").expect("router")];
    for seed in seeds("demo_pipeline", 2) {
        let router = pick(seed, &routers);
        let cfg = DemoConfig {
            workload: WorkloadConfig { seed, n_seqs: 3, layers: 2, prompt_len: 150, ..Default::default() },
            steps: 5,
            router,
            scheduler: None,
            ..Default::default()
        };
        let mut p = pollster::block_on(Pipeline::new(rt, cfg)).expect("pipeline");
        pollster::block_on(p.prefill(rt, &mut |_, _| {})).expect("prefill");
        let mut last = None;
        for _ in 0..5 {
            last = Some(pollster::block_on(p.step(rt)).expect("step"));
        }
        let r = last.expect("steps ran");
        assert_eq!(r.context, 155);
        assert!(r.pages_in_use > 0 && r.kv_bytes_resident >= r.kv_bytes_tokens, "seed {seed}: {r:?}");
        assert_eq!(r.shard_pages.iter().sum::<u32>(), r.pages_in_use, "seed {seed}");
        let v = pollster::block_on(p.verify(rt)).expect("verify").expect("verification enabled");
        assert!(v.attention_checked > 0, "seed {seed}: {v:?}");
        // Routing ran on the GPU for every prompt and decode token of every layer.
        let stats = pollster::block_on(p.router().read_stats(rt)).expect("stats");
        let appended: u32 = stats.iter().map(|s| s.appended).sum();
        assert_eq!(appended, 155 * 3 * 2 * 2, "seed {seed}: routing slots counted (tokens x layers x top_k)");
        assert!(r.routing_entropy > 0.0, "seed {seed}");
    }
}

#[test]
fn demo_pipeline_with_eviction_matches_reference_and_stays_under_budget() {
    use expertkv_core::evict::config::SchedulerConfig;
    let rt = rt();
    use expertkv_core::evict::config::EkvaConfig;
    let runs = [("h2o", None), ("streaming-llm", None), ("adakv", None), ("h2o", Some(EkvaConfig::default()))];
    for seed in seeds("demo_pipeline_evict", 4) {
        let (sched, allocator) = pick(seed, &runs);
        let cfg = DemoConfig {
            workload: WorkloadConfig { seed, n_seqs: 2, layers: 2, prompt_len: 120, ..Default::default() },
            steps: 4,
            scheduler: Some(SchedulerConfig::default_for(sched).expect("scheduler")),
            allocator,
            budget: "48".into(),
            router: RouterConfig::default_for("cache-aware").expect("router"),
            ..Default::default()
        };
        let mut p = pollster::block_on(Pipeline::new(rt, cfg.clone())).expect("pipeline");
        pollster::block_on(p.prefill(rt, &mut |_, _| {})).expect("prefill");
        for _ in 0..4 {
            let r = pollster::block_on(p.step(rt)).expect("step");
            // Measured: the pages in use stay within the budget's page bound.
            let lists = (cfg.workload.n_seqs * cfg.workload.layers * cfg.workload.kv_heads) as u64;
            let max_pages = lists * (48u64.div_ceil(u64::from(cfg.page_size)) + u64::from(cfg.n_shards) - 1);
            assert!(u64::from(r.pages_in_use) <= max_pages, "seed {seed} {sched}: {} pages over {max_pages}", r.pages_in_use);
            assert!(r.evicted > 0, "seed {seed} {sched}: the budget must evict every step");
            let err = r.attention_error.expect("reference attention");
            assert!(err > 0.0 && err < 0.5, "seed {seed} {sched}: attention error {err}");
            assert!(r.full_kv_bytes.expect("full cache") > r.kv_bytes_resident, "seed {seed} {sched}");
            assert!(r.miss_rate > 0.3, "seed {seed} {sched}: evicted tokens are misses for the router ({})", r.miss_rate);
            // Per-expert hits and misses account for every routed (token, expert) pair.
            let w = &cfg.workload;
            let pairs = u64::from(w.n_seqs * w.layers * w.top_k) * u64::from(r.context);
            let (hits, misses): (u64, u64) = (r.expert_hits.iter().sum(), r.expert_misses.iter().sum());
            assert_eq!(hits + misses, pairs, "seed {seed} {sched}: hits {hits} + misses {misses}");
            assert!(misses > 0 && hits > 0, "seed {seed} {sched}");
            // ... and agree with the miss rate (resident K/V vectors are per KV head: 4 here).
            let share = misses as f64 / pairs as f64;
            assert!(
                (share - f64::from(r.miss_rate)).abs() < 0.02,
                "seed {seed} {sched}: misses {share:.3} vs miss rate {:.3}",
                r.miss_rate
            );
            // EKVA: the expert groups of every list together keep exactly the list's budget.
            if allocator.is_some() {
                assert_eq!(r.expert_budget.len(), cfg.workload.n_experts as usize);
                assert_eq!(r.expert_budget.iter().sum::<u64>(), lists * 48, "seed {seed}: ekva split {:?}", r.expert_budget);
                assert!(r.expert_importance.iter().all(|x| x.is_finite() && *x >= 0.0), "{:?}", r.expert_importance);
            } else {
                assert!(r.expert_budget.is_empty());
            }
            // The metrics CSV row has a field per header column.
            assert_eq!(r.csv_row().split(',').count(), expertkv_core::pipeline::StepReport::CSV_HEADER.split(',').count());
        }
        let v = pollster::block_on(p.verify(rt)).expect("verify").expect("verification enabled");
        assert!(v.attention_checked > 0, "seed {seed} {sched}: {v:?}");
    }
}

#[test]
fn pyramid_budgets_shrink_with_depth_and_fastv_keeps_early_layers_whole() {
    use expertkv_core::evict::config::SchedulerConfig;
    use expertkv_core::gpu_data::KEEP_ALL;
    let rt = rt();
    let seed = seeds("pyramid_fastv", 1)[0];
    let layers = 4u32;
    for (sched, pyramid) in
        [(SchedulerConfig::H2o { sinks: 4, window: 8 }, Some(3.0f32)), (SchedulerConfig::FastvTokens { from_layer: 2 }, None)]
    {
        let ctx = format!("seed {seed}: {sched:?}, pyramid {pyramid:?}");
        let cfg = DemoConfig {
            workload: WorkloadConfig { seed, n_seqs: 2, layers, prompt_len: 160, ..Default::default() },
            steps: 3,
            scheduler: Some(sched.clone()),
            budget: "64".into(),
            pyramid,
            ..Default::default()
        };
        let mut p = pollster::block_on(Pipeline::new(rt, cfg.clone())).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        pollster::block_on(p.prefill(rt, &mut |_, _| {})).expect("prefill");
        for _ in 0..3 {
            pollster::block_on(p.step(rt)).expect("step");
        }
        let s = p.kv.scheduler.as_ref().expect("scheduler");
        let lists = pollster::block_on(s.read_lists(rt)).expect("lists");
        let per_layer = lists.len() / layers as usize;
        // Tokens kept per layer (summed over sequences and heads): lists are layer-major.
        let kept: Vec<u32> = lists.chunks(per_layer).map(|c| c.iter().map(|l| l.tokens - l.evicted).sum()).collect();
        let full = per_layer as u32 * (160 + 3);
        for (layer, (&k, &b)) in kept.iter().zip(&s.layer_budgets).enumerate() {
            if b == KEEP_ALL {
                assert_eq!(k, full, "{ctx}: layer {layer} keeps everything");
            } else {
                assert!(k <= b * per_layer as u32 && k > 0, "{ctx}: layer {layer} keeps {k}, budget {b} per list");
            }
        }
        match sched {
            SchedulerConfig::FastvTokens { .. } => assert!(kept[0] == full && kept[3] < full / 2, "{ctx}: {kept:?}"),
            _ => {
                assert!(kept.windows(2).all(|w| w[0] > w[1]), "{ctx}: kept tokens must shrink with depth: {kept:?}");
                assert_eq!(s.layer_budgets.iter().sum::<u32>(), 64 * layers, "{ctx}");
            }
        }
        let v = pollster::block_on(p.verify(rt)).expect("verify").expect("verification enabled");
        assert!(v.attention_checked > 0, "{ctx}: {v:?}");
    }
}

#[test]
fn flexgen_keeps_the_gpu_tier_in_budget_and_fetches_selected_pages() {
    use expertkv_core::evict::config::SchedulerConfig;
    let rt = rt();
    let seed = seeds("flexgen_pipeline", 1)[0];
    let cfg = DemoConfig {
        workload: WorkloadConfig { seed, n_seqs: 2, layers: 1, prompt_len: 200, ..Default::default() },
        steps: 6,
        scheduler: Some(SchedulerConfig::FlexGen),
        budget: "64".into(),
        verify: false,
        ..Default::default()
    };
    let mut p = pollster::block_on(Pipeline::new(rt, cfg.clone())).expect("pipeline");
    pollster::block_on(p.prefill(rt, &mut |_, _| {})).expect("prefill");
    let mut last = None;
    for _ in 0..6 {
        last = Some(pollster::block_on(p.step(rt)).expect("step"));
    }
    let r = last.expect("steps");
    let (fg, _) = p.kv.flexgen.as_ref().expect("flexgen");
    let lists = cfg.workload.n_seqs * cfg.workload.kv_heads;
    // GPU tier: the budget's pages plus the newest page of each shard ring, per list.
    let max_pages = lists * (64u32.div_ceil(cfg.page_size) + cfg.n_shards);
    assert!(r.pages_in_use <= max_pages, "seed {seed}: {} GPU pages over {max_pages}", r.pages_in_use);
    // Every token is somewhere: GPU pages or host memory.
    let gpu_vectors = r.kv_bytes_tokens / (cfg.pool_config().token_kv_bytes() / u64::from(cfg.workload.kv_heads));
    let host_vectors: u64 = (0..lists).map(|l| u64::from(fg.host_tokens(l))).sum();
    assert_eq!(gpu_vectors + host_vectors, u64::from(lists) * 206, "seed {seed}: tokens lost between the tiers");
    assert!(fg.stats.fetched_pages > 0 && fg.stats.offloaded_pages > 0, "seed {seed}: {:?}", fg.stats);
    assert!(r.host_kv_bytes > 0 && r.tier_bytes_moved > 0);
    let err = r.attention_error.expect("reference");
    assert!(err > 0.0 && err < 0.5, "seed {seed}: attention error {err}");
}

#[test]
fn demo_pipeline_with_a_codec_compresses_and_matches_reference() {
    use expertkv_core::config::Codec;
    let rt = rt();
    let codecs = [Codec::Int4 { group: 32 }, Codec::Int8 { group: 16 }, Codec::LowRank { rank: 32 }, Codec::Lora { rank: 16 }];
    let mut f16_sums = 0;
    for seed in seeds("demo_pipeline_codec", 4) {
        let codec = pick(seed, &codecs);
        // The quantisers' error is small; the synthetic K/V are near-isotropic, so a rank-r basis
        // of d = 64 dimensions keeps about r / d of their energy (the planted-structure test in
        // codec.rs checks the fit itself).
        let bound = if codec.is_low_rank() { 0.95 } else { 0.2 };
        // int4 on pages of 32: where the device has f16 and subgroups the tile kernel attends
        // (its values summed in f16), so the lockstep's per-vector check runs.
        // (twice the prompt, so that compressed pages outweigh each list's raw tail).
        let int4 = matches!(codec, Codec::Int4 { .. });
        let (page_size, prompt_len) = if int4 { (32, 320) } else { (DemoConfig::default().page_size, 160) };
        let cfg = DemoConfig {
            workload: WorkloadConfig { seed, n_seqs: 2, layers: 2, prompt_len, ..Default::default() },
            steps: 3,
            scheduler: None,
            codec,
            page_size,
            ..Default::default()
        };
        let mut p = pollster::block_on(Pipeline::new(rt, cfg)).expect("pipeline");
        pollster::block_on(p.prefill(rt, &mut |_, _| {})).expect("prefill");
        let mut last = None;
        for _ in 0..3 {
            last = Some(pollster::block_on(p.step(rt)).expect("step"));
        }
        let r = last.expect("steps");
        // Measured: the pool's resident bytes (raw + compressed pages) under the f16 bytes held.
        assert!(
            r.kv_bytes_resident < r.kv_bytes_tokens,
            "seed {seed} {codec:?}: {} resident for {} of f16",
            r.kv_bytes_resident,
            r.kv_bytes_tokens
        );
        let err = r.attention_error.expect("reference");
        assert!(err > 0.0 && err < 1.5 * bound, "seed {seed} {codec:?}: attention error {err}");
        let (ek, ev) = pollster::block_on(p.reconstruction_error(rt)).expect("recon").expect("codec");
        assert!(ek > 0.0 && ek < bound && ev > 0.0 && ev < bound, "seed {seed} {codec:?}: reconstruction {ek} {ev}");
        let v = pollster::block_on(p.verify(rt)).expect("verify").expect("verification enabled");
        assert!(v.attention_checked > 0, "seed {seed} {codec:?}: {v:?}");
        f16_sums += usize::from(p.kv.attn.f16_value_sums());
    }
    if fixed_seeds() && expertkv_core::attend::subgroup_layout(rt, 128, expertkv_core::config::KvDtype::F16).is_some() {
        assert!(f16_sums > 0, "no case ran an attention that sums values in f16 under the lockstep");
    }
}

/// Every codec under the evicting schedulers: the pages an eviction touches are thawed (decoded
/// into raw pages) before compaction, the lockstep's CPU pool model does the same, and the
/// pools, attention and thaw counts agree at every step.
#[test]
fn codec_pages_under_eviction_thaw_and_match_the_reference() {
    use expertkv_core::config::Codec;
    use expertkv_core::evict::config::SchedulerConfig;
    let rt = rt();
    let codecs = [
        Codec::Int4 { group: 32 },
        Codec::Int8 { group: 16 },
        Codec::FastvDims { keep: 32 },
        Codec::LowRank { rank: 32 },
        Codec::Lora { rank: 16 },
    ];
    let schedulers = ["h2o", "streaming-llm", "lru", "lru-plus", "adakv", "duo", "fastv-tokens:from_layer=1"];
    for seed in seeds("codec_under_eviction", 5) {
        let codec = pick(seed, &codecs);
        let sched = pick(seed.rotate_left(17), &schedulers);
        let cfg = DemoConfig {
            workload: WorkloadConfig { seed, n_seqs: 2, layers: 2, prompt_len: 160, ..Default::default() },
            steps: 4,
            scheduler: Some(SchedulerConfig::parse(sched).expect("scheduler")),
            budget: "64".into(),
            codec,
            ..Default::default()
        };
        let mut p = pollster::block_on(Pipeline::new(rt, cfg)).expect("pipeline");
        pollster::block_on(p.prefill(rt, &mut |_, _| {})).expect("prefill");
        let mut evicted = 0;
        for _ in 0..4 {
            let r = pollster::block_on(p.step(rt)).expect("step");
            evicted += r.evicted;
            // Some of the pages in use are compressed ones.
            let raw_page = u64::from(p.kv.pool.cfg.page_words()) * 4;
            assert!(r.kv_bytes_resident < u64::from(r.pages_in_use) * raw_page, "seed {seed} {sched} {codec:?}: {r:?}");
        }
        assert!(evicted > 0, "seed {seed} {sched} {codec:?}: the budget evicts");
        let s = p.kv.scheduler.as_ref().expect("scheduler");
        let thaw = pollster::block_on(s.read_thaw(rt)).expect("thaw").expect("a codec thaws");
        assert!(thaw.pages_total > 0, "seed {seed} {sched} {codec:?}: evictions touched compressed pages: {thaw:?}");
        assert_eq!(thaw.deferred_rings_total, 0, "seed {seed} {sched} {codec:?}: the raw pages sufficed");
        let v = pollster::block_on(p.verify(rt)).expect("verify").expect("verification enabled");
        assert!(v.attention_checked > 0, "seed {seed} {sched} {codec:?}: {v:?}");
    }
}

#[test]
fn a_recorded_trace_reads_back_and_replays_identically() {
    use expertkv_core::trace::{TraceHeader, TraceWriter, first_difference, read_trace};
    let rt = rt();
    let seed = seeds("trace_replay", 1)[0];
    let cfg = DemoConfig {
        workload: WorkloadConfig { seed, n_seqs: 2, layers: 2, prompt_len: 96, ..Default::default() },
        steps: 3,
        budget: "40".into(),
        verify: false,
        ..Default::default()
    };
    let run = || -> Vec<expertkv_core::trace::LayerRecord> {
        let mut p = pollster::block_on(Pipeline::new(rt, cfg.clone())).expect("pipeline");
        pollster::block_on(p.prefill(rt, &mut |_, _| {})).expect("prefill");
        let mut out = Vec::new();
        for _ in 0..cfg.steps {
            pollster::block_on(p.step(rt)).expect("step");
            out.extend(pollster::block_on(p.trace_records(rt)).expect("records"));
        }
        out
    };
    let recorded = run();
    let mut w = TraceWriter::new(Vec::new(), &TraceHeader::new(cfg.clone())).expect("header");
    for r in &recorded {
        w.write(r).expect("write");
    }
    let bytes = w.finish().expect("finish");
    let trace = read_trace(bytes.as_slice()).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    assert_eq!(trace.records, recorded, "seed {seed}: the trace reads back as written");
    // The records say something: routing of every token, pages read, evictions and moves.
    let evicted: u64 = recorded.iter().map(|r| r.tokens_evicted).sum();
    let moved: u64 = recorded.iter().map(|r| r.bytes_moved).sum();
    assert!(evicted > 0 && moved > 0 && recorded.iter().all(|r| r.pages_read > 0 && r.experts.len() == 4), "seed {seed}: {recorded:?}");
    // A second run of the same configuration replays it exactly.
    for (want, got) in trace.records.iter().zip(&run()) {
        assert_eq!(first_difference(want, got), None, "seed {seed}: step {} layer {}", want.step, want.layer);
    }
}

#[test]
fn a_fused_step_does_what_the_staged_step_does() {
    use expertkv_core::config::Codec;
    use expertkv_core::evict::config::SchedulerConfig;
    let rt = rt();
    let cases = [
        (Some(SchedulerConfig::H2o { sinks: 4, window: 8 }), Codec::None),
        (Some(SchedulerConfig::AdaKv { floor: 0.2, sinks: 2, window: 8 }), Codec::None),
        (None, Codec::Int8 { group: 16 }),
    ];
    for seed in seeds("fused_step", cases.len() as u64) {
        let (sched, codec) = pick(seed, &cases);
        let base = DemoConfig {
            workload: WorkloadConfig { seed, n_seqs: 2, layers: 2, prompt_len: 96, ..Default::default() },
            steps: 3,
            scheduler: sched.clone(),
            budget: "40".into(),
            codec,
            verify: false,
            ..Default::default()
        };
        let run = |reference: bool| {
            let cfg = DemoConfig { reference_attention: reference, ..base.clone() };
            let mut p = pollster::block_on(Pipeline::new(rt, cfg)).expect("pipeline");
            pollster::block_on(p.prefill(rt, &mut |_, _| {})).expect("prefill");
            // With the full-cache reference beside it the step needs the host between stages.
            assert_eq!(p.fused(), !reference, "seed {seed}");
            let mut recs = Vec::new();
            let mut reports = Vec::new();
            for _ in 0..3 {
                reports.push(pollster::block_on(p.step(rt)).expect("step"));
                recs.extend(pollster::block_on(p.trace_records(rt)).expect("records"));
            }
            (recs, reports)
        };
        let (fused, fr) = run(false);
        let (staged, sr) = run(true);
        assert_eq!(fused, staged, "seed {seed} {sched:?} {codec:?}: the fused step differs from the staged one");
        for (a, b) in fr.iter().zip(&sr) {
            assert_eq!((a.evicted, a.pages_in_use, a.kv_bytes_resident), (b.evicted, b.pages_in_use, b.kv_bytes_resident), "seed {seed}");
            assert!(a.gpu.is_some() == b.gpu.is_some());
        }
    }
}

/// The browser test compares the page's decision checksum with the native one: the checksum must
/// repeat for the same run, whichever way the step is staged, and tell different runs apart.
#[test]
fn the_decision_checksum_repeats_and_tells_runs_apart() {
    let rt = rt();
    let digest = |seed: u64, budget: &str, verify: bool| {
        let cfg = DemoConfig {
            workload: WorkloadConfig { seed, n_seqs: 2, layers: 2, prompt_len: 128, n_experts: 8, ..Default::default() },
            steps: 4,
            budget: budget.into(),
            verify,
            reference_attention: false,
            ..Default::default()
        };
        let mut p = pollster::block_on(Pipeline::new(rt, cfg)).expect("pipeline");
        pollster::block_on(p.prefill(rt, &mut |_, _| {})).expect("prefill");
        let mut d = expertkv_core::digest::DecisionDigest::new();
        for _ in 0..4 {
            pollster::block_on(p.step(rt)).expect("step");
            pollster::block_on(d.absorb_step(rt, &p)).expect("digest");
        }
        assert_eq!(d.steps(), 4);
        d.value()
    };
    for seed in seeds("decision_checksum", 2) {
        let a = digest(seed, "25%", false);
        assert_eq!(a, digest(seed, "25%", false), "seed {seed}: the same run gave two checksums");
        assert_eq!(a, digest(seed, "25%", true), "seed {seed}: the staged step (CPU lockstep) decided differently");
        assert_ne!(a, digest(seed ^ 1, "25%", false), "seed {seed}: another workload seed, same checksum");
        assert_ne!(a, digest(seed, "50%", false), "seed {seed}: another budget, same checksum");
    }
}

/// QUEST end to end: with verification on, every layer of every step checks the GPU's page
/// selection against the CPU reference (each page's key bounds exactly, its upper bound on q.k
/// within tolerance, the chosen pages exactly given the GPU's keys) and attention over the
/// chosen pages against the f64 reference; the bytes attended stay within the budget's pages.
#[test]
fn quest_selects_and_attends_as_the_reference_does() {
    use expertkv_core::evict::config::SchedulerConfig;
    let rt = rt();
    for seed in seeds("quest_pipeline", 2) {
        let cfg = DemoConfig {
            workload: WorkloadConfig { seed, n_seqs: 2, layers: 2, prompt_len: 160, ..Default::default() },
            steps: 3,
            scheduler: Some(SchedulerConfig::Quest),
            budget: "48".into(),
            router: pick(seed, &[RouterConfig::Topk, RouterConfig::default_for("cache-aware").expect("router")]),
            ..Default::default()
        };
        let mut p = pollster::block_on(Pipeline::new(rt, cfg.clone())).expect("pipeline");
        pollster::block_on(p.prefill(rt, &mut |_, _| {})).expect("prefill");
        let w = &cfg.workload;
        let lists = u64::from(w.n_seqs * w.layers * w.kv_heads);
        let keep = u64::from(48u32.div_ceil(cfg.page_size));
        for _ in 0..cfg.steps {
            let r = pollster::block_on(p.step(rt)).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            let page = cfg.pool_config().page_bytes();
            assert!(
                r.kv_bytes_attended > 0 && r.kv_bytes_attended <= lists * keep * page,
                "seed {seed}: {} bytes attended, budget {} pages per list",
                r.kv_bytes_attended,
                keep
            );
        }
        let v = pollster::block_on(p.verify(rt)).expect("verify").expect("verification enabled");
        assert!(v.attention_checked >= u64::from(cfg.steps * w.layers), "seed {seed}: {v:?}");
    }
}

/// The recall tier in the pipeline, under the CPU lockstep: every victim captured as the
/// reference captures it, every layer's recalled pages those the reference finds best (up to near
/// ties), attention and masses over the resident and the recalled tokens within tolerance, the
/// pool and the tier identical at the end; the pages in use stay the budget's, and recalling
/// brings attention closer to the full cache's than the same budget without it.
#[test]
fn the_recall_tier_attends_what_eviction_removed_in_lockstep() {
    use expertkv_core::evict::config::SchedulerConfig;
    let rt = rt();
    let runs = ["h2o", "streaming-llm", "lru", "adakv"];
    for seed in seeds("pipeline_recall", 4) {
        let sched = pick(seed, &runs);
        let base = DemoConfig {
            workload: WorkloadConfig { seed, n_seqs: 2, layers: 2, prompt_len: 96, ..Default::default() },
            steps: 4,
            scheduler: Some(SchedulerConfig::default_for(sched).expect("scheduler")),
            budget: "32".into(),
            ..Default::default()
        };
        let run = |recall: u32| {
            let cfg = DemoConfig { recall, ..base.clone() };
            let mut p = pollster::block_on(Pipeline::new(rt, cfg.clone())).unwrap_or_else(|e| panic!("seed {seed} {sched}: {e}"));
            pollster::block_on(p.prefill(rt, &mut |_, _| {})).unwrap_or_else(|e| panic!("seed {seed} {sched}: prefill: {e}"));
            let mut errors = Vec::new();
            let mut pages = Vec::new();
            for step in 0..4 {
                let r = pollster::block_on(p.step(rt)).unwrap_or_else(|e| panic!("seed {seed} {sched} recall {recall}: step {step}: {e}"));
                errors.push(r.attention_error.expect("reference attention"));
                pages.push(r.pages_in_use);
            }
            let v = pollster::block_on(p.verify(rt)).unwrap_or_else(|e| panic!("seed {seed} {sched} recall {recall}: {e}"));
            assert!(v.expect("lockstep").attention_checked >= 8, "seed {seed}");
            if let Some(t) = &p.kv.recall {
                // The lockstep checked calibrated digests, not only the uncalibrated sign bits.
                let (_, _, state) = pollster::block_on(t.read_digests(rt)).expect("digests");
                assert!(state.chunks(2).any(|s| s[1] > 0), "seed {seed} {sched}: no list's digest calibrated");
            }
            (errors, pages)
        };
        let (plain, plain_pages) = run(0);
        let (recalled, recall_pages) = run(2);
        assert_eq!(recall_pages, plain_pages, "seed {seed} {sched}: the tier takes no pool page");
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        assert!(mean(&recalled) < mean(&plain), "seed {seed} {sched}: attention error {recalled:?} with recall, {plain:?} without");
    }
}
