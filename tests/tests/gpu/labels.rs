//! The route stage on the model (`expertkv_model::labels`): every layer's tokens routed before
//! their append, from the three routing sources (a MoE file's router, a MoEfied FFN's, the
//! MoEfication's router over a dense FFN), on small random GGUF files. Against the CPU
//! reference: the labels (the CPU forward's layer inputs through the same router weights, top
//! k), their gates, and the whole pool's structure (rings, page tables, slot metadata with the
//! experts and gates, free list) appended by the CPU pool model with those labels.

use std::sync::Arc;

use expertkv_core::append::format::{NewToken, encode_values};
use expertkv_core::config::{KvDtype, ShardMap};
use expertkv_core::evict::config::{EkvaConfig, SchedulerConfig};
use expertkv_core::reference::PoolModel;
use expertkv_core::route::config::RouterConfig;
use expertkv_model::forward::{GpuLlama, ModelOptions};
use expertkv_model::labels::{KvRouting, LabelSource, reference_scores};
use expertkv_model::moe::{MoeConfig, Moefication};
use expertkv_model::{CpuModel, LlamaConfig, LlamaWeights, Probe, Stage, SyntheticModel};
use expertkv_model::{gguf::GgmlType, gguf::Gguf};

use crate::common::{pick, rt, seeds};

/// One routing source on a synthetic file: the file, the CPU model that decodes as the GPU
/// does, the router weights per layer, and the MoEfication to install (none for a MoE file).
struct Case {
    source: LabelSource,
    file: Vec<u8>,
    moe: Option<Moefication>,
    e: u32,
    k: u32,
}

fn case(seed: u64, source: LabelSource) -> Case {
    let weights = pick(seed, &[GgmlType::Q8_0, GgmlType::F32, GgmlType::Q4_1]);
    match source {
        LabelSource::MoeFile => Case { source, file: SyntheticModel::moe(seed, 8, 2).with_weights(weights).gguf(), moe: None, e: 8, k: 2 },
        _ => {
            let file = SyntheticModel::dense(seed).with_weights(weights).gguf();
            let g = Gguf::parse(&file).expect("gguf");
            let cfg = LlamaConfig::from_gguf(&g).expect("config");
            let w = LlamaWeights::from_gguf(&g, &cfg).expect("weights");
            let moe = Moefication::from_weights(&w, &MoeConfig::new(6, 2)).expect("moefication");
            Case { source, file, moe: Some(moe), e: 6, k: 2 }
        }
    }
}

/// The CPU model decoding as the GPU does for `c`, and every layer's router weights.
fn cpu_side(c: &Case, g: &Gguf<'_>) -> (CpuModel, Arc<LlamaWeights>, Vec<Vec<f32>>) {
    let cfg = LlamaConfig::from_gguf(g).expect("config");
    let w = Arc::new(LlamaWeights::from_gguf(g, &cfg).expect("weights"));
    let cpu = CpuModel::new(w.clone()).expect("cpu");
    let (cpu, routers) = match (&c.moe, c.source) {
        (None, _) => {
            let r = (0..cfg.block_count).map(|l| g.tensor_f32(&format!("blk.{l}.ffn_gate_inp.weight")).expect("router")).collect();
            (cpu, r)
        }
        (Some(m), src) => {
            let cpu = if src == LabelSource::Moefied { cpu.with_moe(Some(Arc::new(m.clone()))).expect("cpu moe") } else { cpu };
            (cpu, m.layers.iter().map(|l| l.centroids.clone()).collect())
        }
    };
    (cpu, w, routers)
}

/// The top `k` of `scores`, best first, and whether the k-th leads the next by a margin no
/// float rounding between the GPU and CPU forward passes can cross.
fn top_k_clear(scores: &[f32], k: usize) -> (Vec<u32>, bool) {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|a, b| scores[*b].total_cmp(&scores[*a]));
    let scale = scores.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    let clear = (0..k).all(|i| (scores[order[i]] - scores[order[i + 1]]).abs() > 1e-3 * scale);
    (order[..k].iter().map(|&e| e as u32).collect(), clear)
}

/// Every source: the GPU's labels equal the CPU's top k of the same router over the CPU
/// forward's layer inputs (tokens whose k-th and next scores lie within rounding are counted,
/// not compared), gates within f32 tolerance of the softmax over the chosen; the pool equal to
/// the CPU pool model appended with those labels, over random shard counts and maps; two
/// sequences decode together.
#[test]
fn route_stage_labels_and_pool_match_the_cpu_reference() {
    let rt = rt();
    for seed in seeds("model_labels", 3) {
        for (i, source) in [LabelSource::MoeFile, LabelSource::Moefied, LabelSource::LabelsOnly].into_iter().enumerate() {
            let c = case(seed, source);
            let g = Gguf::parse(&c.file).expect("gguf");
            let (cpu, w, routers) = cpu_side(&c, &g);
            let cfg = cpu.config().clone();
            // Every seed runs each map once, with shard counts that vary by seed.
            let n_shards = [2u32, 4, 8][(seed as usize + i) % 3];
            let shard_map = [ShardMap::ByExpert, ShardMap::Pikv { n_tok: 2, n_exp: 2 }, ShardMap::ByTokenBlock { block: 4 }]
                [(seed as usize / 3 + i) % 3];
            let ctx = format!("seed {seed}, {}: {n_shards} shards by {}", source.name(), shard_map.name());
            let routing = KvRouting { n_shards, shard_map, ..KvRouting::new(c.e, c.k) };
            let opts = ModelOptions::new(2, 48).dtype(KvDtype::F32).routing(Some(routing));
            let mut m = pollster::block_on(GpuLlama::load(rt, &g, opts)).expect("load");
            match (&c.moe, source) {
                (Some(moe), LabelSource::Moefied) => m.set_moe(rt, &g, moe).expect("set_moe"),
                (Some(moe), _) => m.set_labels(rt, moe).expect("set_labels"),
                (None, _) => {}
            }
            assert_eq!(m.label_source(), Some(source), "{ctx}");
            let mut model = PoolModel::new(&m.kv.pool.cfg);
            let mut caches = [cpu.new_cache(), cpu.new_cache()];
            let (mut compared, mut close) = (0, 0);
            let tokens: Vec<[u32; 2]> = (0..20u32).map(|i| [(i * 37 + 5) % 256, (i * 11 + seed as u32) % 256]).collect();
            let (k, layers) = (c.k as usize, cfg.block_count as usize);
            for (pos, step) in tokens.iter().enumerate() {
                pollster::block_on(m.forward(rt, step)).expect("forward");
                let (experts, gates) = pollster::block_on(m.step_labels(rt)).expect("labels");
                assert_eq!(experts.len(), layers * 2 * k, "{ctx}");
                // Per layer, per sequence: the layer input and K/V of the CPU forward.
                let mut inputs = vec![vec![Vec::new(); 2]; layers];
                let mut kv = vec![vec![(Vec::new(), Vec::new()); 2]; layers];
                for (seq, &t) in step.iter().enumerate() {
                    let mut probe = |p: Probe<'_>| match p.stage {
                        Stage::Embedding => inputs[0][seq] = p.values.to_vec(),
                        Stage::Output if p.layer + 1 < layers => inputs[p.layer + 1][seq] = p.values.to_vec(),
                        Stage::K => kv[p.layer][seq].0 = p.values.to_vec(),
                        Stage::V => kv[p.layer][seq].1 = p.values.to_vec(),
                        _ => {}
                    };
                    cpu.forward_probed(t, pos as u32, &mut caches[seq], layers, true, &mut probe).expect("cpu forward");
                }
                for l in 0..layers {
                    let mut batch = Vec::new();
                    let mut words = Vec::new();
                    for seq in 0..2 {
                        let at = (l * 2 + seq) * k;
                        let (got, got_g) = (&experts[at..at + k], &gates[at..at + k]);
                        let scores = reference_scores(&inputs[l][seq], &w.layers[l].ffn_norm, cfg.rms_norm_eps, &routers[l]);
                        let (want, clear) = top_k_clear(&scores, k);
                        if clear {
                            compared += 1;
                            assert_eq!(got, &want[..], "{ctx}: position {pos}, layer {l}, sequence {seq}: labels");
                            let mx = want.iter().map(|&e| f64::from(scores[e as usize])).fold(f64::NEG_INFINITY, f64::max);
                            let ex: Vec<f64> = want.iter().map(|&e| (f64::from(scores[e as usize]) - mx).exp()).collect();
                            let sum: f64 = ex.iter().sum();
                            // The router's input is the GPU's residual stream, within the f32 model
                            // check's 2e-5 of the CPU's, so a score within 2e-5 of the largest
                            // |score|; a softmax gate moves by at most half the largest score error
                            // (plus f32 rounding of the gates themselves). Seen: 3e-6 at scores
                            // up to 11 (fixed seeds and salts 1-3, 2026-12-07); 2e-3 before.
                            let smax = scores.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs()));
                            let tol = 1e-5 * smax + 1e-6;
                            for (gg, x) in got_g.iter().zip(&ex) {
                                assert!(
                                    (f64::from(*gg) - x / sum).abs() <= tol,
                                    "{ctx}: position {pos}, layer {l}: gate {gg} against {} (tolerance {tol:.1e})",
                                    x / sum
                                );
                            }
                        } else {
                            close += 1;
                        }
                        batch.push(NewToken {
                            layer: l as u32,
                            seq: seq as u32,
                            position: pos as u32,
                            experts: got.to_vec(),
                            gates: got_g.to_vec(),
                        });
                        encode_values(&kv[l][seq].0, KvDtype::F32, &mut words);
                        encode_values(&kv[l][seq].1, KvDtype::F32, &mut words);
                    }
                    model.append(&batch, &words, pos as u32).expect("pool model append");
                }
            }
            println!("{ctx}: {compared} labels compared, {close} within rounding of a tie");
            assert!(compared >= 8 * close.max(1), "{ctx}: most labels are clear of ties ({compared} compared, {close} close)");
            let snap = pollster::block_on(m.kv.pool.snapshot(rt)).expect("snapshot");
            assert_eq!(snap.rings, model.rings, "{ctx}: rings");
            assert_eq!(snap.ring_pages, model.ring_pages, "{ctx}: ring pages");
            assert_eq!(snap.page_meta, model.page_meta, "{ctx}: page metadata");
            assert_eq!(snap.slot_meta, model.slot_meta, "{ctx}: slot metadata (positions, experts, gates)");
            assert_eq!(snap.free_stack, model.free_stack, "{ctx}: free list");
            // The router's statistics count every token's k labels, all still resident.
            let stats = pollster::block_on(m.label_stats(rt)).expect("stats");
            for (l, layer) in stats.chunks(c.e as usize).enumerate() {
                let appended: u32 = layer.iter().map(|s| s.appended).sum();
                assert_eq!(appended as usize, tokens.len() * 2 * k, "{ctx}: layer {l}: {layer:?}");
                assert!(layer.iter().all(|s| s.resident == s.appended && s.miss == 0.0), "{ctx}: layer {l}: {layer:?}");
            }
            if source != LabelSource::LabelsOnly {
                let (same, of) = m.label_agreement();
                println!("{ctx}: pre-gated labels agree with the FFN's first expert on {same} of {of} tokens");
                assert_eq!(of, (tokens.len() * layers * 2) as u64, "{ctx}: every token compared");
            }
        }
    }
}

/// The route stage's routers on the model: hash labels by token id, not scores; cache-aware
/// moves labels away from experts whose tokens an evicting scheduler dropped (on the same
/// tokens, it differs from top-k once misses exist); EKVA splits H2O's budget by expert on the
/// model and every list keeps its share. Refusals name both parts.
#[test]
fn route_stage_routers_and_ekva_on_the_model() {
    let rt = rt();
    let seed = seeds("model_label_routers", 1)[0];
    let c = case(seed, LabelSource::MoeFile);
    let g = Gguf::parse(&c.file).expect("gguf");
    let tokens: Vec<u32> = (0..48u32).map(|i| (i * 53 + 7) % 256).collect();
    let h2o = (SchedulerConfig::H2o { sinks: 2, window: 4 }, 20);
    let run = |router: RouterConfig, allocator: Option<EkvaConfig>| {
        let routing = KvRouting { router, n_shards: 4, allocator, ..KvRouting::new(c.e, c.k) };
        let opts = ModelOptions::new(1, 64).scheduler(Some(h2o.clone())).routing(Some(routing));
        let mut m = pollster::block_on(GpuLlama::load(rt, &g, opts)).expect("load");
        let mut labels = Vec::new();
        for &t in &tokens {
            let logits = pollster::block_on(m.forward(rt, &[t])).expect("forward");
            assert!(logits.iter().all(|x| x.is_finite()));
            labels.extend(pollster::block_on(m.step_labels(rt)).expect("labels").0);
        }
        (m, labels)
    };
    let (topk, topk_labels) = run(RouterConfig::Topk, None);
    let misses: f32 = pollster::block_on(topk.label_stats(rt)).expect("stats").iter().map(|s| s.miss).sum();
    assert!(misses > 0.0, "seed {seed}: H2O's evictions are misses of the experts' tokens");
    let (_, hash_labels) = run(RouterConfig::Hash, None);
    assert_ne!(hash_labels, topk_labels, "seed {seed}: hash labels from token ids");
    let (_, ca_labels) = run(RouterConfig::CacheAware { lambda: 50.0 }, None);
    assert_ne!(ca_labels, topk_labels, "seed {seed}: cache-aware avoids the experts with misses");
    assert_eq!(&ca_labels[..2 * c.k as usize], &topk_labels[..2 * c.k as usize], "seed {seed}: no misses yet at the first token: as top-k");
    let (ekva, _) = run(RouterConfig::Topk, Some(EkvaConfig::default()));
    let lists = pollster::block_on(ekva.kv.scheduler.as_ref().expect("scheduler").read_lists(rt)).expect("lists");
    for (i, l) in lists.iter().enumerate() {
        assert!(l.tokens - l.evicted <= l.budget, "seed {seed}: list {i} keeps its EKVA budget: {l:?}");
    }
    // Refusals, before any GPU work on the model.
    let routing = KvRouting { allocator: Some(EkvaConfig::default()), ..KvRouting::new(c.e, c.k) };
    let err = pollster::block_on(GpuLlama::load(rt, &g, ModelOptions::new(1, 32).routing(Some(routing)))).err().expect("allocator alone");
    assert!(err.to_string().contains("allocator") && err.to_string().contains("scheduler"), "{err}");
    let err = pollster::block_on(GpuLlama::load(rt, &g, ModelOptions::new(1, 32).routing(Some(KvRouting::new(4, 2))))).err().expect("E4");
    assert!(err.to_string().contains("MoE file") && err.to_string().contains("8 experts"), "{err}");
    let dense = case(seed, LabelSource::LabelsOnly);
    let gd = Gguf::parse(&dense.file).expect("gguf");
    let mut m = pollster::block_on(GpuLlama::load(rt, &gd, ModelOptions::new(1, 32).routing(Some(KvRouting::new(6, 2))))).expect("load");
    let err = pollster::block_on(m.forward(rt, &[1])).expect_err("no routing source");
    assert!(err.to_string().contains("routing source"), "{err}");
    let other = Moefication::from_weights(
        &LlamaWeights::from_gguf(&gd, &LlamaConfig::from_gguf(&gd).expect("config")).expect("weights"),
        &MoeConfig::new(4, 1),
    )
    .expect("moefication");
    let err = m.set_labels(rt, &other).expect_err("E4 k1 into a stage of E6 k2");
    assert!(err.to_string().contains("E6 k2") && err.to_string().contains("4 experts"), "{err}");
}
