//! CPU references of the routing kernels (`shaders/wgsl/route/*.wgsl`).

use super::append::PoolModel;
use crate::gpu_data::{ExpertStats, NO_OWNER, RouteParams, meta, routers};

/// Per-expert cost the adaptive router avoids (twin of `expert_cost` in `common/route.wgsl`).
pub fn expert_cost(p: &RouteParams, s: &ExpertStats) -> f64 {
    f64::from(p.c_miss) * f64::from(s.miss) + f64::from(p.c_lb) * (f64::from(s.load) * f64::from(p.n_experts) - 1.0)
}

/// Score bias of each expert (`route/bias.wgsl`), computed in f64. `stats` is one layer's.
pub fn bias(p: &RouteParams, stats: &[ExpertStats]) -> Vec<f64> {
    let e = p.n_experts as usize;
    let mean: f64 = stats[..e].iter().map(|s| f64::from(s.load)).sum::<f64>() / e as f64;
    stats[..e]
        .iter()
        .map(|s| match p.router {
            routers::LOAD_BALANCE => -f64::from(p.alpha) * (f64::from(s.load) - mean),
            routers::CACHE_AWARE => -f64::from(p.lambda) * (1.0 + f64::from(s.miss)).ln(),
            routers::ENTROPY => f64::from(p.beta) * (f64::from(s.load) + 1.0 / (16.0 * e as f64)).ln(),
            routers::ADAPTIVE => f64::from(s.bias),
            _ => 0.0,
        })
        .collect()
}

/// The hash of the hash router (twin of `hash_u32` in `route/topk.wgsl`).
pub fn hash_u32(x: u32) -> u32 {
    let mut h = x;
    h ^= h >> 16;
    h = h.wrapping_mul(0x7feb_352d);
    h ^= h >> 15;
    h = h.wrapping_mul(0x846c_a68b);
    h ^= h >> 16;
    h
}

/// Top-k selection (`route/topk.wgsl`): for every token the chosen experts, best first, and their
/// gates (model softmax renormalised over the chosen). `bias` is the f32 bias the GPU used: the
/// score `logit + bias` is one f32 addition on both sides, so selections must be identical.
pub fn topk(p: &RouteParams, logits: &[f32], bias: &[f32]) -> (Vec<u32>, Vec<f64>) {
    let (t_n, e_n, k) = (p.n_tokens as usize, p.n_experts as usize, p.top_k as usize);
    let mut experts = Vec::with_capacity(t_n * k);
    let mut gates = Vec::with_capacity(t_n * k);
    let base = p.token_base as usize;
    for t in 0..t_n {
        let row = &logits[(base + t) * e_n..(base + t + 1) * e_n];
        let score = |e: usize| row[e] + bias[e];
        let chosen: Vec<usize> = if p.router == routers::HASH {
            let h = hash_u32(p.token_offset.wrapping_add(t as u32)) as usize % e_n;
            (0..k).map(|i| (h + i) % e_n).collect()
        } else {
            let allowed: Vec<usize> = if p.router == routers::HIERARCHICAL {
                let per = e_n / p.n_groups as usize;
                let gscore: Vec<f32> =
                    (0..p.n_groups as usize).map(|g| (0..per).map(|j| score(g * per + j)).fold(-3.4e38f32, f32::max)).collect();
                let mut order: Vec<usize> = (0..gscore.len()).collect();
                // Stable sort by score descending: ties keep the lower index first.
                order.sort_by(|a, b| gscore[*b].partial_cmp(&gscore[*a]).unwrap_or(std::cmp::Ordering::Equal));
                let kept = &order[..p.topk_groups as usize];
                (0..e_n).filter(|e| kept.contains(&(e / per))).collect()
            } else {
                (0..e_n).collect()
            };
            let mut order = allowed;
            order.sort_by(|a, b| score(*b).partial_cmp(&score(*a)).unwrap_or(std::cmp::Ordering::Equal));
            order.truncate(k);
            order
        };
        let mx = chosen.iter().map(|e| f64::from(row[*e])).fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = chosen.iter().map(|e| (f64::from(row[*e]) - mx).exp()).collect();
        let s: f64 = w.iter().sum();
        experts.extend(chosen.iter().map(|e| *e as u32));
        gates.extend(w.iter().map(|x| x / s));
    }
    (experts, gates)
}

/// Statistics after one step (`route/count.wgsl` + `route/stats.wgsl`): returns the new stats of
/// the layer, the step's routing entropy and its realised cost.
pub fn stats(p: &RouteParams, before: &[ExpertStats], experts: &[u32]) -> (Vec<ExpertStats>, f64, f64) {
    let e_n = p.n_experts as usize;
    let mut counts = vec![0u32; e_n];
    for e in experts {
        if (*e as usize) < e_n {
            counts[*e as usize] += 1;
        }
    }
    let slots = f64::from(p.n_tokens * p.top_k);
    let mut out = before[..e_n].to_vec();
    let (mut h, mut c) = (0.0, 0.0);
    for (e, s) in out.iter_mut().enumerate() {
        let share = f64::from(counts[e]) / slots;
        if counts[e] > 0 {
            h -= share * share.ln();
        }
        c += share * expert_cost(p, s);
        s.load = ((1.0 - f64::from(p.ema)) * f64::from(s.load) + f64::from(p.ema) * share) as f32;
        s.appended += counts[e];
    }
    (out, h, c)
}

/// The adaptive router's mean gradient, mean KL(q || p) and mean expected cost over the tokens
/// (`route/adaptive.wgsl`), in f64.
pub fn adaptive_gradient(p: &RouteParams, stats: &[ExpertStats], logits: &[f32], bias: &[f32]) -> (Vec<f64>, f64, f64) {
    let (t_n, e_n) = (p.n_tokens as usize, p.n_experts as usize);
    let cost: Vec<f64> = stats[..e_n].iter().map(|s| expert_cost(p, s)).collect();
    let mut g = vec![0.0; e_n];
    let (mut kl_sum, mut ec_sum) = (0.0, 0.0);
    let base = p.token_base as usize;
    for t in 0..t_n {
        let l: Vec<f64> = logits[(base + t) * e_n..(base + t + 1) * e_n].iter().map(|v| f64::from(*v)).collect();
        let b: Vec<f64> = bias[..e_n].iter().map(|v| f64::from(*v)).collect();
        let lse = |v: &dyn Fn(usize) -> f64| {
            let m = (0..e_n).map(v).fold(f64::NEG_INFINITY, f64::max);
            m + (0..e_n).map(|e| (v(e) - m).exp()).sum::<f64>().ln()
        };
        let lp = lse(&|e| l[e]);
        let lq = lse(&|e| l[e] + b[e]);
        let q: Vec<f64> = (0..e_n).map(|e| (l[e] + b[e] - lq).exp()).collect();
        let ec: f64 = (0..e_n).map(|e| q[e] * cost[e]).sum();
        let kl: f64 = (0..e_n).map(|e| q[e] * (b[e] - lq + lp)).sum();
        for e in 0..e_n {
            g[e] += q[e] * (cost[e] - ec) + f64::from(p.kappa) * q[e] * (b[e] - lq + lp - kl);
        }
        kl_sum += kl;
        ec_sum += ec;
    }
    let tn = t_n as f64;
    (g.iter().map(|x| x / tn).collect(), kl_sum / tn, ec_sum / tn)
}

/// `route/miss.wgsl#count`: K/V vectors (token x KV head) still cached per (layer, expert),
/// `[layer][expert]`, every cached slot counting once for each of its top-k experts.
pub fn resident_counts(pool: &PoolModel, n_experts: u32) -> Vec<u32> {
    let c = &pool.cfg;
    let keys_per_layer = c.max_seqs * c.kv_heads * c.n_shards;
    let mut resident = vec![0u32; (c.layers * n_experts) as usize];
    for (page, pm) in pool.page_meta.iter().enumerate() {
        if pm.owner == NO_OWNER {
            continue;
        }
        let layer = pm.owner / keys_per_layer;
        for s in 0..pm.fill as usize {
            let m = (page * c.page_size as usize + s) * c.meta_words() as usize;
            for i in 0..c.top_k as usize {
                resident[(layer * n_experts + pool.slot_meta[m + meta::EXPERTS + i]) as usize] += 1;
            }
        }
    }
    resident
}

/// `route/miss.wgsl#finish`: the share of an expert's appended K/V vectors (`appended` tokens x
/// `kv_heads`) no longer cached; 0 for an expert that was never routed to.
pub fn miss_rate(appended: u32, kv_heads: u32, resident: u32) -> f32 {
    let vectors = appended * kv_heads;
    if vectors > 0 { (vectors - resident.min(vectors)) as f32 / vectors as f32 } else { 0.0 }
}
