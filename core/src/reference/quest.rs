//! QUEST's CPU reference (`evict/quest_summarize.wgsl`, `evict/quest_select.wgsl`): each page's key bounds
//! (every dimension's min and max over its cached keys), each page's upper bound on q.k
//! (`sum_i max(q_i min_i, q_i max_i)`, the largest over the KV head's query heads), and the
//! selection (the `keep` pages of a list with the highest bound, ties to the lower list index,
//! in list order).
//!
//! The bounds are exact (stored values). The upper bound is an f32 sum on the GPU whose order
//! and contraction the driver chooses, so the reference's f64 bound is compared within a
//! tolerance ([`QUEST_BOUND_RTOL`]) and the selection is checked exactly given the GPU's keys.

use super::append::PoolModel;
use crate::gpu_data::from_orderable;

/// The tolerance of a page's upper bound: this share of `1 + |bound|`.
pub const QUEST_BOUND_RTOL: f64 = 1e-4;

/// `page`'s key bounds: `[min; head_dim]` then `[max; head_dim]` over its `fill` cached keys
/// (`None` for a page with no tokens).
pub fn page_bounds(model: &PoolModel, page: u32) -> Option<Vec<f64>> {
    let fill = model.page_meta[page as usize].fill;
    if fill == 0 {
        return None;
    }
    let d = model.cfg.head_dim as usize;
    let mut out = vec![f64::INFINITY; d];
    out.extend(vec![f64::NEG_INFINITY; d]);
    for s in 0..fill {
        for (i, v) in model.vector(page, s, 0).into_iter().enumerate() {
            out[i] = out[i].min(v);
            out[d + i] = out[d + i].max(v);
        }
    }
    Some(out)
}

/// The upper bound on q.k over a page with `bounds` (`[min; d]` then `[max; d]`) for the query
/// heads `queries` (each `d` long), the largest over them.
pub fn upper_bound(bounds: &[f64], queries: &[&[f32]]) -> f64 {
    let d = bounds.len() / 2;
    queries
        .iter()
        .map(|q| (0..d).map(|i| (f64::from(q[i]) * bounds[i]).max(f64::from(q[i]) * bounds[d + i])).sum::<f64>())
        .fold(f64::NEG_INFINITY, f64::max)
}

/// The bound a selection key stands for (keys are the complement of the bound's orderable bits,
/// so that the best page has the smallest key).
pub fn key_bound(key: u32) -> f64 {
    f64::from(from_orderable(!key))
}

/// The pages QUEST keeps of `list` given each list slot's key: the `keep` smallest keys, ties to
/// the lower list index, in list order.
pub fn select_pages(list: &[u32], keys: &[u32], keep: usize) -> Vec<u32> {
    let keep = keep.min(list.len());
    let mut order: Vec<usize> = (0..list.len()).collect();
    order.sort_by_key(|&j| (keys[j], j));
    let mut chosen = order[..keep].to_vec();
    chosen.sort_unstable();
    chosen.into_iter().map(|j| list[j]).collect()
}
