//! A MoE file's experts in tiers (`expertkv_model::experts`): with fewer GPU slots than the
//! experts a step can choose from, the missing ones are fetched between a layer's router and its
//! FFN (and, prefetching, the next layer's predicted ones ahead of its router), and the logits
//! equal the all-resident run's bit for bit.

use expertkv_core::config::KvDtype;
use expertkv_core::rng::Rng;
use expertkv_model::SyntheticModel;
use expertkv_model::experts::{ExpertCacheConfig, ExpertPolicy, ExpertPrefetch, min_slots};
use expertkv_model::forward::{GpuLlama, ModelOptions};
use expertkv_model::gguf::{GgmlType, Gguf};

use crate::common::{pick, rt, seeds};

/// Q8_0 and Q4_K files of 8 experts (top 2), 1 and 2 sequences, each policy, with and without
/// pre-gating prefetch, at the fewest slots a step allows (misses nearly every step): every
/// step's logits equal to the all-resident model's bit for bit (so no copy ever replaced an
/// expert its layer still needed); every chosen (layer, expert) a hit or a miss; the bytes moved
/// those of the missed and prefetched experts; the GPU holding only the slots.
#[test]
fn an_expert_cache_smaller_than_the_experts_gives_the_all_resident_logits() {
    let rt = rt();
    let cases = [
        (GgmlType::Q8_0, 1, ExpertPolicy::Lru, ExpertPrefetch::None),
        (GgmlType::Q4K, 1, ExpertPolicy::Lfu, ExpertPrefetch::Pregate),
        (GgmlType::Q8_0, 2, ExpertPolicy::Score, ExpertPrefetch::Pregate),
        (GgmlType::Q8_0, 1, ExpertPolicy::Score, ExpertPrefetch::None),
        (GgmlType::Q8_0, 2, ExpertPolicy::Lru, ExpertPrefetch::None),
    ];
    for seed in seeds("model_expert_cache", cases.len() as u64) {
        let (weights, n_seqs, policy, prefetch) = pick(seed, &cases);
        let mut rng = Rng::new(seed);
        let base = SyntheticModel::moe(seed, 8, 2);
        // K-quant rows are whole super-blocks of 256.
        let spec = if weights == GgmlType::Q4K { SyntheticModel { hidden: 256, ffn: 256, ..base } } else { base }.with_weights(weights);
        let file = spec.gguf();
        let g = Gguf::parse(&file).expect("gguf");
        let slots = min_slots(n_seqs, 2, 8);
        let ctx = format!("seed {seed}: {weights:?}, {n_seqs} sequences, {slots} slots, {policy:?}, prefetch {prefetch:?}");
        let opts = ModelOptions::new(n_seqs, 64).dtype(KvDtype::F32);
        let mut all = pollster::block_on(GpuLlama::load(rt, &g, opts.clone())).expect("load");
        let cfg = ExpertCacheConfig { slots, policy, prefetch };
        let mut cached = pollster::block_on(GpuLlama::load(rt, &g, opts.expert_cache(Some(cfg)))).expect("load cached");
        assert!(cached.chunked_prefill_refusal().is_some_and(|w| w.contains("expert cache")), "{ctx}");
        let steps = 12;
        let mut chosen = 0u64;
        let mut ahead = 0u64;
        for step in 0..steps {
            let tokens: Vec<u32> = (0..n_seqs).map(|_| rng.below(256)).collect();
            let before = all.expert_counts().to_vec();
            let want = pollster::block_on(all.forward(rt, &tokens)).expect("forward");
            let got = pollster::block_on(cached.forward(rt, &tokens)).expect("forward cached");
            let same = want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{ctx}: step {step}: logits differ from the all-resident run's");
            // Distinct (layer, expert) pairs chosen this step: each a hit or a miss.
            let after = all.expert_counts();
            chosen += after.iter().zip(&before).filter(|(a, b)| a > b).count() as u64;
            let c = cached.expert_cache().expect("cache");
            let fetched_ahead = c.last_fetches.iter().filter(|f| f.ahead).count() as u64;
            assert_eq!(fetched_ahead, c.last.prefetched, "{ctx}: step {step}");
            // Layer 0 has no layer before it to predict it.
            assert!(c.last_fetches.iter().all(|f| !f.ahead || f.layer > 0), "{ctx}: step {step}");
            ahead += fetched_ahead;
        }
        let c = cached.expert_cache().expect("cache");
        println!("{ctx}: {:?} over {steps} steps", c.total);
        assert_eq!(c.total.hits + c.total.misses, chosen, "{ctx}: {:?}", c.total);
        let fetches = c.total.misses + c.total.prefetched;
        assert!(fetches >= u64::from(spec.layers) * u64::from(slots), "{ctx}: the cold start alone fetches: {:?}", c.total);
        assert!(c.total.hits > 0, "{ctx}: {:?}", c.total);
        let expert_bytes = c.host_bytes() / u64::from(8 * spec.layers);
        assert_eq!(c.total.bytes, fetches * expert_bytes, "{ctx}");
        assert_eq!(c.total.prefetched, ahead, "{ctx}");
        assert!(c.total.prefetch_used <= c.total.prefetched, "{ctx}: {:?}", c.total);
        // On demand under LRU the hits are the reuse curve's at this size: the cached run's own
        // and the all-resident run's (the same routing), and fewer than a larger cache's.
        if (policy, prefetch) == (ExpertPolicy::Lru, ExpertPrefetch::None) {
            for curve in [cached.expert_reuse(), all.expert_reuse()].map(|c| c.expect("a MoE model's curve")) {
                assert_eq!(curve.hits(slots), c.total.hits, "{ctx}: {curve:?}");
                assert_eq!(curve.references(), chosen, "{ctx}");
                assert!(curve.hits(slots) < curve.hits(8), "{ctx}: {curve:?}");
            }
        }
        if prefetch == ExpertPrefetch::Pregate {
            assert!(c.total.prefetched > 0, "{ctx}: nothing was fetched ahead: {:?}", c.total);
        } else {
            assert_eq!((c.total.prefetched, c.total.prefetch_used), (0, 0), "{ctx}");
        }
        assert_eq!(c.gpu_bytes(), c.host_bytes() / 8 * u64::from(slots), "{ctx}: only the slots are on the GPU");
        for (l, layer) in c.resident().iter().enumerate() {
            let mut r: Vec<u32> = layer.iter().flatten().copied().collect();
            r.sort_unstable();
            r.dedup();
            assert_eq!(r.len(), layer.iter().flatten().count(), "{ctx}: layer {l}: an expert in two slots");
        }
    }
}

/// A MoEfied dense model written as a MoE file (`expertkv_model::moe_file`, down in Q8_0): on the
/// GPU, all resident, its logits equal its CPU reference's (the chosen experts weigh 1: no
/// softmax kernel runs) and its choices the reference's; with the fewest slots a step allows and
/// pre-gating, the expert cache gives the all-resident logits bit for bit, with hits and misses.
#[test]
fn a_moefied_file_runs_as_its_reference_and_through_the_expert_cache() {
    use expertkv_model::moe::{MoeConfig, Moefication, top_k};
    use expertkv_model::moe_file::write_moefied;
    use expertkv_model::ops::WeightFormat;
    use expertkv_model::{CpuModel, LlamaConfig, LlamaWeights, Probe, Stage};
    use std::sync::Arc;
    let rt = rt();
    let seed = seeds("model_moefied_file", 1)[0];
    let mut rng = Rng::new(seed);
    let dense = SyntheticModel { ffn: 128, ..SyntheticModel::dense(seed) }.with_weights(GgmlType::Q8_0).gguf();
    let gd = Gguf::parse(&dense).expect("gguf");
    let weights = |g: &Gguf<'_>| Arc::new(LlamaWeights::from_gguf(g, &LlamaConfig::from_gguf(g).expect("config")).expect("weights"));
    let moe = Moefication::from_weights(&weights(&gd), &MoeConfig::new(4, 2)).expect("moefy");
    let file = write_moefied(&gd, &moe, WeightFormat::Q8_0, "test").expect("write");
    let g = Gguf::parse(&file).expect("the MoE file");
    let cpu = CpuModel::new(weights(&g)).expect("cpu");
    let opts = ModelOptions::new(1, 64).dtype(KvDtype::F32);
    let mut all = pollster::block_on(GpuLlama::load(rt, &g, opts.clone())).expect("load");
    assert_eq!(all.moe_shape(), Some((4, 2)), "seed {seed}");
    let slots = min_slots(1, 2, 4);
    let cfg = ExpertCacheConfig { slots, policy: ExpertPolicy::Lru, prefetch: ExpertPrefetch::Pregate };
    let mut cached = pollster::block_on(GpuLlama::load(rt, &g, opts.expert_cache(Some(cfg)))).expect("load cached");
    let mut cache = cpu.new_cache();
    let mut counts = [0u64; 2 * 4];
    for pos in 0..10u32 {
        let t = rng.below(256);
        let want = pollster::block_on(all.forward(rt, &[t])).expect("forward");
        let got = pollster::block_on(cached.forward(rt, &[t])).expect("forward cached");
        assert!(want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "seed {seed}: position {pos}: cached logits differ");
        let mut probe = |p: Probe<'_>| {
            if p.stage == Stage::RouterScores {
                for e in top_k(p.values, 2) {
                    counts[p.layer * 4 + e] += 1;
                }
            }
        };
        let reference = cpu.forward_probed(t, pos, &mut cache, 2, true, &mut probe).expect("cpu forward");
        let (err, max) =
            (reference.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs())), reference.iter().fold(0f32, |m, a| m.max(a.abs())));
        assert!(max > 0.1 && err <= 1e-4 * max, "seed {seed}: position {pos}: GPU vs CPU {err} (max {max})");
    }
    assert_eq!(all.expert_counts(), &counts[..], "seed {seed}: every layer's choices, GPU against CPU");
    let c = cached.expert_cache().expect("cache");
    assert!(c.total.hits > 0 && c.total.misses > 0, "seed {seed}: {:?}", c.total);
}

/// Too few slots for one step's experts, or a cache on a dense file, is refused at load with the
/// minimum stated.
#[test]
fn an_expert_cache_too_small_for_a_step_is_refused() {
    let rt = rt();
    let file = SyntheticModel::moe(3, 8, 2).with_weights(GgmlType::Q8_0).gguf();
    let g = Gguf::parse(&file).expect("gguf");
    let cfg = ExpertCacheConfig::on_demand(3, ExpertPolicy::Lru);
    let e = pollster::block_on(GpuLlama::load(rt, &g, ModelOptions::new(2, 32).expert_cache(Some(cfg)))).err().expect("refused");
    assert!(e.to_string().contains("at least 4"), "{e}");
    let dense = SyntheticModel::dense(3).gguf();
    let g = Gguf::parse(&dense).expect("gguf");
    let e = pollster::block_on(GpuLlama::load(rt, &g, ModelOptions::new(1, 32).expert_cache(Some(cfg)))).err().expect("refused");
    assert!(e.to_string().contains("needs a MoE file"), "{e}");
    assert!(ExpertPolicy::from_name("mru").is_err_and(|e| e.to_string().contains("lru, lfu, score")));
}

/// An on-demand LRU cache of `slots` slots a layer, as the re-balancing tests' options take it.
fn lru(slots: u32) -> Option<ExpertCacheConfig> {
    Some(ExpertCacheConfig::on_demand(slots, ExpertPolicy::Lru))
}

/// A MoE file's configuration and the bytes its expert slots take.
fn config_and_expert_bytes(g: &Gguf<'_>) -> (expertkv_model::LlamaConfig, expertkv_model::experts::ExpertBytes) {
    let c = expertkv_model::LlamaConfig::from_gguf(g).expect("config");
    let eb = expertkv_model::experts::ExpertBytes::of(g, &c).expect("bytes").expect("a MoE file");
    (c, eb)
}

/// One loaded MoE file re-balanced three times (`GpuLlama::reconfigure`): 2 expert slots and the
/// full cache, then 3 slots and H2O's budget-sized pool, then 3 slots (kept, with their experts)
/// and the full cache again; then once more with the slots emptied (`empty_expert_slots`). After each, a fresh sequence's logits equal those of a model loaded
/// with the same options bit for bit, the pool and slots allocate exactly what the options
/// predict (the budget's bytes, measured), kept slots keep their experts and new or emptied ones
/// start empty, and a refused change leaves the model usable.
#[test]
fn a_reconfigured_model_decodes_as_a_fresh_load_with_its_options() {
    use expertkv_core::evict::config::SchedulerConfig;
    let rt = rt();
    for seed in seeds("model_reconfigure", 1) {
        let mut rng = Rng::new(seed);
        let file = SyntheticModel::moe(seed, 8, 2).with_weights(GgmlType::Q8_0).gguf();
        let g = Gguf::parse(&file).expect("gguf");
        let (c, eb) = config_and_expert_bytes(&g);
        let full = ModelOptions::new(1, 64).dtype(KvDtype::F32);
        let h2o = full.clone().scheduler(Some((SchedulerConfig::default_for("h2o").expect("h2o"), 16)));
        let plans =
            [full.clone().expert_cache(lru(2)), h2o.expert_cache(lru(3)), full.clone().expert_cache(lru(3)), full.expert_cache(lru(3))];
        let mut m = pollster::block_on(GpuLlama::load(rt, &g, plans[0].clone())).expect("load");
        for (i, opts) in plans.iter().enumerate() {
            let ctx = format!("seed {seed}: plan {i}");
            if i > 0 {
                let bad = opts.clone().expert_cache(None);
                assert!(m.check_reconfigure(&bad).is_err_and(|e| e.to_string().contains("expert cache")), "{ctx}");
                let few = opts.clone().expert_cache(lru(1));
                assert!(m.check_reconfigure(&few).is_err_and(|e| e.to_string().contains("at least 2")), "{ctx}");
                let resident = m.expert_cache().expect("cache").resident();
                m = pollster::block_on(m.reconfigure(rt, opts.clone())).expect("reconfigure");
                // The slots kept across a change (3 to 3) keep their experts; new ones start
                // empty.
                let now = m.expert_cache().expect("cache").resident();
                if i >= 2 {
                    assert_eq!(now, resident, "{ctx}: the kept slots' experts");
                    assert!(now.iter().flatten().any(Option::is_some), "{ctx}: the kept slots hold experts");
                } else {
                    assert!(now.iter().flatten().all(Option::is_none), "{ctx}: new slots start empty: {now:?}");
                }
            }
            if i == 3 {
                // The same 3 slots again, emptied: a cold start like a fresh load's.
                m.empty_expert_slots(rt);
                assert!(m.expert_cache().expect("cache").resident().iter().flatten().all(Option::is_none), "{ctx}: emptied");
            }
            let max_binding = rt.max_binding_bytes();
            assert_eq!(m.kv_bytes_allocated(), opts.kv_bytes(&c, max_binding).expect("kv bytes"), "{ctx}");
            assert_eq!(m.expert_bytes_allocated(), eb.with_slots(opts.experts.expect("cache").slots), "{ctx}");
            let before = m.expert_cache().expect("cache").total;
            let mut fresh = pollster::block_on(GpuLlama::load(rt, &g, opts.clone())).expect("fresh load");
            // Past H2O's budget of 16, so its evictions run on the rebuilt pool.
            for step in 0..24 {
                let t = [rng.below(256)];
                let want = pollster::block_on(fresh.forward(rt, &t)).expect("fresh forward");
                let got = pollster::block_on(m.forward(rt, &t)).expect("forward");
                assert!(want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "{ctx}: step {step}: logits differ");
            }
            let (now, f) = (m.expert_cache().expect("cache").total, fresh.expert_cache().expect("cache").total);
            // Empty slots miss as a fresh load's do, step for step. Warm ones (kept across the
            // 3-to-3 change) usually miss less, but need not: LRU from another start may evict
            // differently later (a fresh seed drew 60 and 60), so their contents are checked above.
            let misses = now.misses - before.misses;
            if i != 2 {
                assert_eq!(misses, f.misses, "{ctx}: new slots start empty");
            }
        }
    }
}

/// A model re-balanced in the middle of a request (`GpuLlama::reconfigure_live`, the online
/// split's growth): two sequences 20 tokens in, the pool grown from 24 to 64 tokens a sequence
/// and the expert slots cut from 6 to 4. Every step's logits, before and after, equal those of
/// a model loaded with the final options and never changed, bit for bit (the K/V carried
/// across through host memory); the pool and slots allocate what the new options predict.
/// Changes that cannot carry the K/V are refused first, and the model decodes on. Then a dense
/// file with one sequence prefilled and the other empty: the same, the empty one staying empty.
#[test]
fn a_model_reconfigured_mid_request_decodes_on_as_if_never_changed() {
    use expertkv_core::evict::config::SchedulerConfig;
    let rt = rt();
    for seed in seeds("model_reconfigure_live", 1) {
        let mut rng = Rng::new(seed);
        let file = SyntheticModel::moe(seed, 8, 2).with_weights(GgmlType::Q8_0).gguf();
        let g = Gguf::parse(&file).expect("gguf");
        let (c, eb) = config_and_expert_bytes(&g);
        let grown = ModelOptions::new(2, 64).expert_cache(lru(4));
        let mut m = pollster::block_on(GpuLlama::load(rt, &g, ModelOptions::new(2, 24).expert_cache(lru(6)))).expect("load");
        let mut want = pollster::block_on(GpuLlama::load(rt, &g, grown.clone())).expect("load");
        for step in 0..40 {
            let ctx = format!("seed {seed}: step {step}");
            if step == 20 {
                let h2o = grown.clone().scheduler(Some((SchedulerConfig::default_for("h2o").expect("h2o"), 16)));
                let refused = [
                    (h2o, "no scheduler"),
                    (grown.clone().dtype(KvDtype::F32), "the same"),
                    (ModelOptions::new(2, 20).expert_cache(lru(4)), "holds 20 tokens"),
                    (ModelOptions::new(1, 64).expert_cache(lru(4)), "2 sequences live"),
                ];
                for (opts, why) in refused {
                    assert!(m.check_reconfigure_live(&opts).is_err_and(|e| e.to_string().contains(why)), "{ctx}: {why}");
                }
                m = pollster::block_on(m.reconfigure_live(rt, grown.clone())).expect("reconfigure_live");
                assert_eq!(m.positions, vec![20, 20], "{ctx}");
                assert_eq!(m.kv_bytes_allocated(), grown.kv_bytes(&c, rt.max_binding_bytes()).expect("kv bytes"), "{ctx}");
                assert_eq!(m.expert_bytes_allocated(), eb.with_slots(4), "{ctx}");
            }
            let t = [rng.below(256), rng.below(256)];
            let a = pollster::block_on(want.forward(rt, &t)).expect("forward");
            let b = pollster::block_on(m.forward(rt, &t)).expect("forward");
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{ctx}: logits differ");
        }
        let dense = SyntheticModel::dense(seed).with_weights(GgmlType::Q8_0).gguf();
        let g = Gguf::parse(&dense).expect("gguf");
        let grown = ModelOptions::new(2, 64);
        let mut m = pollster::block_on(GpuLlama::load(rt, &g, ModelOptions::new(2, 24))).expect("load");
        let mut want = pollster::block_on(GpuLlama::load(rt, &g, grown.clone())).expect("load");
        let ids: Vec<u32> = (0..20).map(|_| rng.below(256)).collect();
        let a = pollster::block_on(want.prefill(rt, 0, &ids)).expect("prefill");
        let b = pollster::block_on(m.prefill(rt, 0, &ids)).expect("prefill");
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "seed {seed}: dense prefill");
        m = pollster::block_on(m.reconfigure_live(rt, grown)).expect("reconfigure_live with an empty sequence");
        assert_eq!(m.positions, vec![20, 0], "seed {seed}");
        for step in 0..12 {
            let t = [rng.below(256), rng.below(256)];
            let a = pollster::block_on(want.forward(rt, &t)).expect("forward");
            let b = pollster::block_on(m.forward(rt, &t)).expect("forward");
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "seed {seed}: dense step {step}: logits differ");
        }
    }
}

/// FlexGen's host tier beside an expert cache: one schedule moves both in the same steps
/// (`GpuLlama::last_transfers`). Against the same host tier with every expert resident, every
/// step's logits are equal bit for bit and FlexGen moves the same pages. Every transfer is
/// submitted before the stage that reads it; a demand fetch never evicts an expert its layer
/// chose this step; a page fetch swaps out only a page with a lower bound, never one fetched
/// earlier in the step; a prefetch waits behind its layer's page fetches. The pool and slots
/// allocate what the options predict.
#[test]
fn one_schedule_moves_kv_pages_and_experts_in_the_same_step() {
    use expertkv_core::evict::config::SchedulerConfig;
    use expertkv_model::experts::ExpertBytes;
    use expertkv_model::forward::{Moved, Stage};
    let rt = rt();
    let cases = [(1, ExpertPolicy::Lru, ExpertPrefetch::Pregate, 64), (2, ExpertPolicy::Score, ExpertPrefetch::None, 40)];
    for seed in seeds("model_flexgen_experts", cases.len() as u64) {
        let (n_seqs, policy, prefetch, steps) = pick(seed, &cases);
        let mut rng = Rng::new(seed);
        let spec = SyntheticModel::moe(seed, 8, 2).with_weights(GgmlType::Q8_0);
        let file = spec.gguf();
        let g = Gguf::parse(&file).expect("gguf");
        let c = expertkv_model::LlamaConfig::from_gguf(&g).expect("config");
        let slots = min_slots(n_seqs, 2, 8);
        let ctx = format!("seed {seed}: {n_seqs} sequences, {slots} slots, {policy:?}, prefetch {prefetch:?}");
        let opts = ModelOptions::new(n_seqs, 96).dtype(KvDtype::F32).scheduler(Some((SchedulerConfig::FlexGen, 16)));
        let mut all = pollster::block_on(GpuLlama::load(rt, &g, opts.clone())).expect("load");
        let cached_opts = opts.clone().expert_cache(Some(ExpertCacheConfig { slots, policy, prefetch }));
        let mut cached = pollster::block_on(GpuLlama::load(rt, &g, cached_opts.clone())).expect("load cached");
        let eb = ExpertBytes::of(&g, &c).expect("bytes").expect("a MoE file");
        assert_eq!(cached.kv_bytes_allocated(), cached_opts.kv_bytes(&c, rt.max_binding_bytes()).expect("kv bytes"), "{ctx}");
        assert_eq!(cached.expert_bytes_allocated(), eb.with_slots(slots), "{ctx}");
        let (mut both, mut pages, mut experts, mut ahead) = (0u32, 0u64, 0u64, 0u64);
        for step in 0..steps {
            let tokens: Vec<u32> = (0..n_seqs).map(|_| rng.below(256)).collect();
            let before = all.expert_counts().to_vec();
            let want = pollster::block_on(all.forward(rt, &tokens)).expect("forward");
            let got = pollster::block_on(cached.forward(rt, &tokens)).expect("forward cached");
            let ctx = format!("{ctx}: step {step}");
            assert!(want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "{ctx}: logits differ from the all-resident run's");
            // The experts each layer chose this step (the all-resident run's routing is the same).
            let chosen = |layer: u32, x: u32| all.expert_counts()[(layer * 8 + x) as usize] > before[(layer * 8 + x) as usize];
            let page_moves = |m: &GpuLlama| -> Vec<_> {
                m.last_transfers().iter().filter_map(|t| if let Moved::Page(p) = &t.moved { Some(*p) } else { None }).collect()
            };
            assert_eq!(page_moves(&cached), page_moves(&all), "{ctx}: the host tier moved other pages");
            let log = cached.last_transfers();
            let mut gpu_pages = Vec::new();
            for (i, t) in log.iter().enumerate() {
                let issued = t.issued_before.unwrap_or_else(|| panic!("{ctx}: transfer {i} submitted after every stage: {t:?}"));
                assert!(issued <= t.needed_by, "{ctx}: transfer {i} submitted after the stage that reads it: {t:?}");
                match &t.moved {
                    Moved::Page(p) => {
                        assert!(p.bound > p.evicted_bound, "{ctx}: {p:?}");
                        assert!(!gpu_pages.contains(&p.gpu_page), "{ctx}: page {} fetched and swapped out in one step", p.gpu_page);
                        gpu_pages.push(p.gpu_page);
                        pages += 1;
                    }
                    Moved::Expert(f) if !f.ahead => {
                        assert_eq!(t.needed_by, Stage::experts(f.layer), "{ctx}: {t:?}");
                        assert!(chosen(f.layer, f.expert), "{ctx}: fetched an expert its layer did not choose: {f:?}");
                        assert!(f.evicted.is_none_or(|x| !chosen(f.layer, x)), "{ctx}: evicted an expert its layer chose: {f:?}");
                        experts += 1;
                    }
                    Moved::Expert(f) => {
                        // Speculative copies ride behind the demand pages of their layer.
                        let last_page = log.iter().rposition(|u| matches!(&u.moved, Moved::Page(_)) && u.needed_by.layer == f.layer);
                        assert!(last_page.is_none_or(|p| p < i), "{ctx}: a prefetch went ahead of its layer's pages");
                        assert_eq!(t.needed_by, Stage::experts(f.layer), "{ctx}: {t:?}");
                        ahead += 1;
                    }
                }
            }
            let has = |page: bool| log.iter().any(|t| matches!(&t.moved, Moved::Page(_)) == page);
            both += u32::from(has(true) && has(false));
        }
        println!("{ctx}: {pages} pages, {experts} experts on demand, {ahead} ahead; {both} steps moved both");
        assert!(both > 0 && pages > 0 && experts > 0, "{ctx}: no step moved a page and an expert");
        let t = cached.transfer_totals();
        assert_eq!((t.steps_moving_both, t.pages, t.experts, t.experts_ahead), (u64::from(both), pages, experts, ahead), "{ctx}");
        assert_eq!(ahead > 0, prefetch == ExpertPrefetch::Pregate, "{ctx}");
        let (fa, fc) = (&all.kv.flexgen.as_ref().expect("flexgen").0.stats, &cached.kv.flexgen.as_ref().expect("flexgen").0.stats);
        assert_eq!((fa.fetched_pages, fa.offloaded_pages), (fc.fetched_pages, fc.offloaded_pages), "{ctx}");
    }
}
