//! f64 reference of decode attention (q_len 1, GQA) over a pool's pages, with each cached
//! token's attention mass summed over the query heads of its KV head.

use super::pool::PoolModel;

pub struct AttentionOutput {
    /// [seq][q_head][head_dim]
    pub out: Vec<f64>,
    /// Every attended cached vector: (seq, KV head, page, slot, attention mass summed over the
    /// query heads of that KV head).
    pub mass: Vec<(u32, u32, u32, u32, f64)>,
}

/// Decode attention for sequences `0..n_seqs` of `layer`. `queries` is [seq][q_head][head_dim]
/// with q_heads = kv_heads * group; scores are scaled by `scale`.
pub fn attend_decode(model: &PoolModel, layer: u32, n_seqs: u32, queries: &[f32], group: u32, scale: f64) -> AttentionOutput {
    attend_decode_over(model, layer, n_seqs, queries, group, scale, &|seq, head| model.page_list(layer, seq, head))
}

/// [`attend_decode`] over the pages `pages(seq, head)` gives (QUEST's selection), instead of
/// each list's every page.
pub fn attend_decode_over(
    model: &PoolModel,
    layer: u32,
    n_seqs: u32,
    queries: &[f32],
    group: u32,
    scale: f64,
    pages: &dyn Fn(u32, u32) -> Vec<u32>,
) -> AttentionOutput {
    let _ = layer;
    let cfg = &model.cfg;
    let d = cfg.head_dim as usize;
    let hkv = cfg.kv_heads;
    let hq = (hkv * group) as usize;
    let mut out = vec![0.0; n_seqs as usize * hq * d];
    let mut mass = Vec::new();
    for seq in 0..n_seqs {
        for h in 0..hkv {
            let tokens: Vec<(u32, u32)> =
                pages(seq, h).into_iter().flat_map(|page| (0..model.page_meta[page as usize].fill).map(move |s| (page, s))).collect();
            let mut head_mass = vec![0.0; tokens.len()];
            let keys: Vec<Vec<f64>> = tokens.iter().map(|&(p, s)| model.vector(p, s, 0)).collect();
            let values: Vec<Vec<f64>> = tokens.iter().map(|&(p, s)| model.vector(p, s, 1)).collect();
            for g in 0..group {
                let qh = (h * group + g) as usize;
                let q0 = (seq as usize * hq + qh) * d;
                let q: Vec<f64> = queries[q0..q0 + d].iter().map(|v| f64::from(*v)).collect();
                let scores: Vec<f64> = keys.iter().map(|k| k.iter().zip(&q).map(|(a, b)| a * b).sum::<f64>() * scale).collect();
                if scores.is_empty() {
                    continue;
                }
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let l: f64 = w.iter().sum();
                for (t, wt) in w.iter().enumerate() {
                    let p = wt / l;
                    head_mass[t] += p;
                    for (o, v) in out[q0..q0 + d].iter_mut().zip(&values[t]) {
                        *o += p * v;
                    }
                }
            }
            mass.extend(tokens.iter().zip(head_mass).map(|(&(p, s), m)| (seq, h, p, s, m)));
        }
    }
    AttentionOutput { out, mass }
}
