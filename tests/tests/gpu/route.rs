//! The routers: bias and top-k against the CPU reference (indices exactly, floats within
//! tolerance), statistics, the adaptive gradient, miss rates counted from the pool, and tests that
//! show each router doing its job.

use expertkv_core::append::KvPool;
use expertkv_core::config::{Codec, KvDtype, PoolConfig, ShardMap};
use expertkv_core::gpu_data::{ExpertStats, RouteSummary};
use expertkv_core::reference::route as reference;
use expertkv_core::rng::Rng;
use expertkv_core::route::config::RouterConfig;
use expertkv_core::route::{RouteShape, Router};
use expertkv_core::runtime::Runtime;
use expertkv_core::{append::format::NewToken, reference::PoolModel};

use crate::append::random_kv;
use crate::common::{POISON_F32, POISON_U32, rt, rt_trusted, seeds};

fn random_router(rng: &mut Rng, e: u32, k: u32) -> RouterConfig {
    loop {
        let r = match rng.below(7) {
            0 => RouterConfig::Hash,
            1 => RouterConfig::Topk,
            2 => RouterConfig::LoadBalance { alpha: rng.range(0.0, 20.0) as f32 },
            3 => RouterConfig::CacheAware { lambda: rng.range(0.0, 5.0) as f32 },
            4 => RouterConfig::Entropy { beta: rng.range(-2.0, 2.0) as f32 },
            5 => RouterConfig::Adaptive { lr: rng.range(0.1, 4.0) as f32, kappa: rng.range(0.0, 2.0) as f32, c_miss: 1.0, c_lb: 0.5 },
            _ => {
                let divisors: Vec<u32> = (1..=e).filter(|g| e.is_multiple_of(*g) && *g <= 256).collect();
                let groups = divisors[rng.below(divisors.len() as u32) as usize];
                let topk_groups = 1 + rng.below(groups.min(8));
                RouterConfig::Hierarchical { groups, topk_groups }
            }
        };
        if r.validate(e, k).is_ok() {
            return r;
        }
    }
}

fn random_stats(rng: &mut Rng, n: usize) -> Vec<ExpertStats> {
    let raw: Vec<f64> = (0..n).map(|_| rng.uniform() + 0.01).collect();
    let s: f64 = raw.iter().sum();
    raw.iter()
        .map(|r| ExpertStats {
            load: (r / s) as f32,
            miss: rng.uniform() as f32,
            bias: rng.range(-1.0, 1.0) as f32,
            appended: rng.below(1000),
            ..Default::default()
        })
        .collect()
}

/// Logits with many exact ties (quantised), so the tie-break is exercised.
fn random_logits(rng: &mut Rng, t: u32, e: u32, quantised: bool) -> Vec<f32> {
    (0..t * e)
        .map(|_| {
            let v = rng.normal() * 2.0;
            if quantised { ((v * 2.0).round() / 2.0) as f32 } else { v as f32 }
        })
        .collect()
}

fn close(g: f64, w: f64, tol: f64) -> bool {
    (g - w).abs() <= tol * (1.0 + w.abs())
}

fn check_route_case(rt: &Runtime, seed: u64) {
    let mut rng = Rng::new(seed);
    let e = [1u32, 2, 7, 8, 16, 60, 64, 128, 256][rng.below(9) as usize];
    let k = 1 + rng.below(e.min(8));
    let t = 1 + rng.below(1500);
    let layers = 1 + rng.below(2);
    let layer = rng.below(layers);
    let cfg = random_router(&mut rng, e, k);
    let ctx = format!("seed {seed}: {cfg:?}, E {e}, k {k}, T {t}, layer {layer}");
    let router = pollster::block_on(Router::new(rt, cfg.clone(), RouteShape { n_experts: e, top_k: k, layers, max_tokens: t }, 0.25))
        .unwrap_or_else(|err| panic!("{ctx}: {err}"));
    let stats = random_stats(&mut rng, (layers * e) as usize);
    router.write_stats(rt, &stats).expect("stats");
    let quantised = rng.below(2) == 0;
    // Every layer's rows: the kernels read layer `layer`'s at layer * max_tokens.
    let logits = random_logits(&mut rng, layers * t, e, quantised);
    router.set_logits(rt, 0, &logits).expect("logits");
    rt.fill_u32(&router.experts, POISON_U32);
    rt.fill_u32(&router.gates, POISON_F32);
    let offset = rng.next_u32();
    router.run(rt, layer, t, offset).unwrap_or_else(|err| panic!("{ctx}: {err}"));

    let p = router.params(layer, t, offset);
    let layer_stats = &stats[(layer * e) as usize..((layer + 1) * e) as usize];
    let gpu_bias = pollster::block_on(router.read_bias(rt)).expect("bias");
    let want_bias = reference::bias(&p, layer_stats);
    for (i, (g, w)) in gpu_bias.iter().zip(&want_bias).enumerate() {
        assert!(close(f64::from(*g), *w, 1e-5), "{ctx}: bias[{i}] = {g}, reference {w}");
    }
    let got_e = pollster::block_on(router.read_experts(rt, layer, t)).expect("experts");
    let got_g = pollster::block_on(router.read_gates(rt, layer, t)).expect("gates");
    let (want_e, want_g) = reference::topk(&p, &logits, &gpu_bias);
    for tok in 0..t as usize {
        let r = tok * k as usize..(tok + 1) * k as usize;
        assert_eq!(got_e[r.clone()], want_e[r.clone()], "{ctx}: token {tok} experts");
        for i in r {
            assert!(close(f64::from(got_g[i]), want_g[i], 1e-5), "{ctx}: gate {i} = {}, reference {}", got_g[i], want_g[i]);
        }
    }
    // Statistics: the moving-average load, appended counts, entropy and cost of the step.
    let after = pollster::block_on(router.read_stats(rt)).expect("stats");
    let summary = pollster::block_on(router.read_summary(rt)).expect("summary");
    let (want_stats, h, c) = reference::stats(&p, layer_stats, &want_e);
    for (i, (g, w)) in after[(layer * e) as usize..((layer + 1) * e) as usize].iter().zip(&want_stats).enumerate() {
        assert_eq!(g.appended, w.appended, "{ctx}: appended of expert {i}");
        assert!(close(f64::from(g.load), f64::from(w.load), 1e-5), "{ctx}: load of expert {i}: {} vs {}", g.load, w.load);
        if !matches!(cfg, RouterConfig::Adaptive { .. }) {
            assert_eq!(g.bias, layer_stats[i].bias, "{ctx}: only the adaptive router changes its bias");
        }
    }
    assert!(close(f64::from(summary[layer as usize].entropy), h, 1e-4), "{ctx}: entropy {} vs {h}", summary[layer as usize].entropy);
    assert!(close(f64::from(summary[layer as usize].cost), c, 1e-4), "{ctx}: cost {} vs {c}", summary[layer as usize].cost);
    assert_eq!(summary[layer as usize].steps, 1);
    if matches!(cfg, RouterConfig::Adaptive { .. }) {
        // The gradient pass runs after the statistics pass of the same step.
        let (grad, kl, ec) = reference::adaptive_gradient(&p, &want_stats, &logits, &gpu_bias);
        let s = &after[(layer * e) as usize..];
        for i in 0..e as usize {
            assert!(close(f64::from(s[i].grad), grad[i], 2e-4), "{ctx}: gradient of expert {i}: {} vs {}", s[i].grad, grad[i]);
            let want = f64::from(layer_stats[i].bias) - f64::from(p.lr) * f64::from(s[i].grad);
            assert!(close(f64::from(s[i].bias), want, 1e-5), "{ctx}: bias step of expert {i}");
        }
        assert!(close(f64::from(summary[layer as usize].kl), kl, 2e-4), "{ctx}: KL {} vs {kl}", summary[layer as usize].kl);
        assert!(close(f64::from(summary[layer as usize].expected_cost), ec, 2e-4), "{ctx}: expected cost");
    }
}

#[test]
fn route_gpu_match_cpu() {
    for seed in seeds("route", 40) {
        check_route_case(rt(), seed);
    }
}

#[test]
fn route_unchecked_gpu_match_cpu() {
    for seed in seeds("route_unchecked", 12) {
        check_route_case(rt_trusted(), seed);
    }
}

#[test]
fn every_router_has_a_gpu_case() {
    // The random cases above draw routers at random; make sure each kind runs at least once.
    let rt = rt();
    for (i, cfg) in RouterConfig::all_defaults().into_iter().enumerate() {
        let mut rng = Rng::new(1000 + i as u64);
        let (e, k, t) = (64, 8, 300);
        let router = pollster::block_on(Router::new(rt, cfg.clone(), RouteShape { n_experts: e, top_k: k, layers: 1, max_tokens: t }, 0.1))
            .expect("router");
        router.write_stats(rt, &random_stats(&mut rng, e as usize)).expect("stats");
        let logits = random_logits(&mut rng, t, e, true);
        router.set_logits(rt, 0, &logits).expect("logits");
        router.run(rt, 0, t, 0).expect("run");
        let bias = pollster::block_on(router.read_bias(rt)).expect("bias");
        let (want, _) = reference::topk(&router.params(0, t, 0), &logits, &bias);
        assert_eq!(pollster::block_on(router.read_experts(rt, 0, t)).expect("experts"), want, "{cfg:?}");
    }
}

/// Share of routing slots that went to `set` under `router` after `steps` steps.
#[allow(clippy::too_many_arguments)]
fn share_to(rt: &Runtime, cfg: RouterConfig, stats: &[ExpertStats], logits: &[f32], e: u32, k: u32, t: u32, set: &[u32]) -> f64 {
    let router =
        pollster::block_on(Router::new(rt, cfg, RouteShape { n_experts: e, top_k: k, layers: 1, max_tokens: t }, 0.1)).expect("router");
    router.write_stats(rt, stats).expect("stats");
    router.set_logits(rt, 0, logits).expect("logits");
    router.run(rt, 0, t, 0).expect("run");
    let ex = pollster::block_on(router.read_experts(rt, 0, t)).expect("experts");
    ex.iter().filter(|x| set.contains(x)).count() as f64 / ex.len() as f64
}

#[test]
fn cache_aware_moves_tokens_off_high_miss_experts_as_lambda_grows() {
    let rt = rt();
    let seed = seeds("cache_aware_behaviour", 1)[0];
    let mut rng = Rng::new(seed);
    let (e, k, t) = (32u32, 2u32, 2048u32);
    // Experts 0..8 are popular and have lost most of their KV (miss 0.9); the rest miss nothing.
    let hot: Vec<u32> = (0..8).collect();
    let logits: Vec<f32> = (0..t * e).map(|i| rng.normal() as f32 + if (i % e) < 8 { 1.5 } else { 0.0 }).collect();
    let stats: Vec<ExpertStats> =
        (0..e).map(|x| ExpertStats { load: 1.0 / e as f32, miss: if x < 8 { 0.9 } else { 0.0 }, ..Default::default() }).collect();
    let mut last = f64::INFINITY;
    let mut shares = Vec::new();
    for lambda in [0.0f32, 0.5, 1.0, 2.0, 4.0, 8.0] {
        let s = share_to(rt, RouterConfig::CacheAware { lambda }, &stats, &logits, e, k, t, &hot);
        assert!(s <= last, "seed {seed}: share to high-miss experts rose from {last} to {s} at lambda {lambda}");
        last = s;
        shares.push(s);
    }
    assert!(shares[0] > 0.5 && shares[5] < 0.05, "seed {seed}: shares {shares:?}");
}

#[test]
fn load_balance_flattens_a_skewed_load() {
    let rt = rt();
    let seed = seeds("load_balance_behaviour", 1)[0];
    let (e, k, t) = (16u32, 2u32, 1024u32);
    let run = |cfg: RouterConfig| -> f32 {
        let mut rng = Rng::new(seed);
        let router =
            pollster::block_on(Router::new(rt, cfg, RouteShape { n_experts: e, top_k: k, layers: 1, max_tokens: t }, 0.3)).expect("router");
        for step in 0..20 {
            // Zipf-skewed logits: expert x gets -0.8 ln(x + 1).
            let logits: Vec<f32> = (0..t * e).map(|i| rng.normal() as f32 - 0.8 * ((i % e) as f32 + 1.0).ln()).collect();
            router.set_logits(rt, 0, &logits).expect("logits");
            router.run(rt, 0, t, step * t).expect("run");
        }
        let s = pollster::block_on(router.read_stats(rt)).expect("stats");
        let max = s.iter().map(|x| x.load).fold(0.0, f32::max);
        max * e as f32 // 1.0 = perfectly flat
    };
    let topk = run(RouterConfig::Topk);
    let lb = run(RouterConfig::LoadBalance { alpha: 20.0 });
    assert!(topk > 2.5, "seed {seed}: the workload must be skewed (max load {topk} x uniform)");
    assert!(lb < 0.5 * topk, "seed {seed}: load balance left max load at {lb} x uniform (topk {topk})");
}

#[test]
fn hierarchical_never_picks_outside_the_chosen_groups() {
    let rt = rt();
    for seed in seeds("hierarchical_behaviour", 6) {
        let mut rng = Rng::new(seed);
        let (e, k, t) = (64u32, 8u32, 512u32);
        let groups = [4u32, 8, 16][rng.below(3) as usize];
        let topk_groups = 1 + rng.below(groups.min(8));
        let cfg = RouterConfig::Hierarchical { groups, topk_groups };
        if cfg.validate(e, k).is_err() {
            continue;
        }
        let router =
            pollster::block_on(Router::new(rt, cfg, RouteShape { n_experts: e, top_k: k, layers: 1, max_tokens: t }, 0.1)).expect("router");
        let logits = random_logits(&mut rng, t, e, false);
        router.set_logits(rt, 0, &logits).expect("logits");
        router.run(rt, 0, t, 0).expect("run");
        let ex = pollster::block_on(router.read_experts(rt, 0, t)).expect("experts");
        let per = (e / groups) as usize;
        for tok in 0..t as usize {
            let row = &logits[tok * e as usize..(tok + 1) * e as usize];
            let mut gs: Vec<(f32, usize)> =
                (0..groups as usize).map(|g| (row[g * per..(g + 1) * per].iter().cloned().fold(f32::MIN, f32::max), g)).collect();
            gs.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap_or(std::cmp::Ordering::Equal));
            let kept: Vec<usize> = gs[..topk_groups as usize].iter().map(|x| x.1).collect();
            for x in &ex[tok * k as usize..(tok + 1) * k as usize] {
                assert!(kept.contains(&(*x as usize / per)), "seed {seed}: token {tok} got expert {x} outside groups {kept:?}");
            }
        }
    }
}

#[test]
fn entropy_router_moves_routing_entropy_both_ways() {
    let rt = rt();
    let seed = seeds("entropy_behaviour", 1)[0];
    let (e, k, t) = (16u32, 2u32, 1024u32);
    let run = |cfg: RouterConfig| -> f32 {
        let mut rng = Rng::new(seed);
        let router =
            pollster::block_on(Router::new(rt, cfg, RouteShape { n_experts: e, top_k: k, layers: 1, max_tokens: t }, 0.3)).expect("router");
        let mut h = 0.0;
        for step in 0..15 {
            let logits: Vec<f32> = (0..t * e).map(|i| rng.normal() as f32 - 0.3 * ((i % e) as f32 + 1.0).ln()).collect();
            router.set_logits(rt, 0, &logits).expect("logits");
            router.run(rt, 0, t, step * t).expect("run");
            h = pollster::block_on(router.read_summary(rt)).expect("summary")[0].entropy;
        }
        h
    };
    let base = run(RouterConfig::Topk);
    let low = run(RouterConfig::Entropy { beta: 1.5 });
    let high = run(RouterConfig::Entropy { beta: -1.5 });
    assert!(low < base - 0.1, "seed {seed}: beta > 0 must lower the routing entropy ({low} vs topk {base})");
    assert!(high > base + 0.02, "seed {seed}: beta < 0 must raise it ({high} vs topk {base})");
}

/// Stated bound of the adaptive router's departure from the model's gate.
const ADAPTIVE_KL_MAX: f32 = 0.5;

#[test]
fn adaptive_router_lowers_its_cost_within_a_kl_of_topk() {
    let rt = rt();
    let seed = seeds("adaptive_behaviour", 1)[0];
    let mut rng = Rng::new(seed);
    let (e, k, t) = (32u32, 2u32, 1024u32);
    // Popular experts 0..6 have lost most of their KV: routing there costs, and a bias can avoid it.
    let stats: Vec<ExpertStats> =
        (0..e).map(|x| ExpertStats { load: 1.0 / e as f32, miss: if x < 6 { 0.8 } else { 0.05 }, ..Default::default() }).collect();
    let cfg = RouterConfig::Adaptive { lr: 2.0, kappa: 1.0, c_miss: 1.0, c_lb: 0.05 };
    let router =
        pollster::block_on(Router::new(rt, cfg, RouteShape { n_experts: e, top_k: k, layers: 1, max_tokens: t }, 0.2)).expect("router");
    router.write_stats(rt, &stats).expect("stats");
    let mut costs: Vec<RouteSummary> = Vec::new();
    for step in 0..40 {
        let logits: Vec<f32> = (0..t * e).map(|i| rng.normal() as f32 + if (i % e) < 6 { 1.0 } else { 0.0 }).collect();
        router.set_logits(rt, 0, &logits).expect("logits");
        router.run(rt, 0, t, step * t).expect("run");
        let s = pollster::block_on(router.read_summary(rt)).expect("summary")[0];
        assert!(s.kl <= ADAPTIVE_KL_MAX, "seed {seed}: step {step}: KL to the model's gate {} over {ADAPTIVE_KL_MAX}", s.kl);
        costs.push(s);
    }
    let first = costs[0].cost;
    let last: f32 = costs[35..].iter().map(|s| s.cost).sum::<f32>() / 5.0;
    assert!(last < 0.7 * first, "seed {seed}: realised cost {first} -> {last}");
    let e_first = costs[0].expected_cost;
    let e_last = costs[39].expected_cost;
    assert!(e_last < e_first, "seed {seed}: expected cost {e_first} -> {e_last}");
}

#[test]
fn miss_rates_come_from_the_pool() {
    let rt = rt();
    let seed = seeds("miss_from_pool", 1)[0];
    let mut rng = Rng::new(seed);
    let (e, k) = (8u32, 2u32);
    let cfg = PoolConfig {
        layers: 2,
        kv_heads: 1,
        head_dim: 8,
        page_size: 4,
        dtype: KvDtype::F32,
        n_pages: 64,
        max_seqs: 2,
        n_shards: 2,
        ring_capacity: 4,
        top_k: k,
        shard_map: ShardMap::Pikv { n_tok: 2, n_exp: 2 },
        max_buffer_bytes: None,
        codec: Codec::None,
        codec_pages: 0,
    };
    let mut pool = pollster::block_on(KvPool::new(rt, cfg.clone())).expect("pool");
    let mut model = PoolModel::new(&cfg);
    let mut router = pollster::block_on(Router::new(
        rt,
        RouterConfig::CacheAware { lambda: 1.0 },
        RouteShape { n_experts: e, top_k: k, layers: 2, max_tokens: 64 },
        0.1,
    ))
    .expect("router");
    router.bind_pool(rt, &pool).expect("bind");
    // Route 3 batches per layer on the GPU, append the routed tokens (experts as routed), then
    // release some pages and overflow rings so that some tokens are gone.
    let mut appended = vec![0u32; (2 * e) as usize];
    for step in 0..6u32 {
        let layer = step % 2;
        let t = 12u32;
        let logits = random_logits(&mut rng, t, e, false);
        router.set_logits(rt, layer, &logits).expect("logits");
        router.run(rt, layer, t, step * t).expect("route");
        let ex = pollster::block_on(router.read_experts(rt, layer, t)).expect("experts");
        let gates = pollster::block_on(router.read_gates(rt, layer, t)).expect("gates");
        for x in &ex {
            appended[(layer * e + x) as usize] += 1;
        }
        let toks: Vec<NewToken> = (0..t as usize)
            .map(|i| NewToken {
                layer,
                seq: (i % 2) as u32,
                position: step * 100 + i as u32,
                experts: ex[i * k as usize..(i + 1) * k as usize].to_vec(),
                gates: gates[i * k as usize..(i + 1) * k as usize].to_vec(),
            })
            .collect();
        let kv = random_kv(&mut rng, &cfg, t as usize);
        pool.append(rt, &toks, &kv, step).expect("append");
        model.append(&toks, &kv, step).expect("append");
    }
    let counts: Vec<u32> = (0..cfg.n_keys()).map(|i| u32::from(i % 3 == 0)).collect();
    pool.release(rt, &counts).expect("release");
    model.release(&counts);
    router.update_miss(rt).expect("miss");
    let stats = pollster::block_on(router.read_stats(rt)).expect("stats");
    let resident = expertkv_core::reference::route::resident_counts(&model, e);
    let mut some_missing = false;
    for i in 0..(2 * e) as usize {
        assert_eq!(stats[i].appended, appended[i], "seed {seed}: appended of (layer, expert) {i}");
        assert_eq!(stats[i].resident, resident[i], "seed {seed}: resident of (layer, expert) {i}");
        let want = expertkv_core::reference::route::miss_rate(appended[i], cfg.kv_heads, resident[i]);
        assert!((stats[i].miss - want).abs() < 1e-6, "seed {seed}: miss of {i}: {} vs {want}", stats[i].miss);
        some_missing |= resident[i] < appended[i];
    }
    assert!(some_missing, "seed {seed}: the release and ring overflows must have removed tokens");
}
