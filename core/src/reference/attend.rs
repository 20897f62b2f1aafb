//! f64 reference of decode attention (q_len 1, GQA) over a pool's pages, with each cached
//! token's attention mass summed over the query heads of its KV head.

use super::append::PoolModel;
use super::compress::f16_value;
use crate::config::Codec;

/// The tolerance of one attention output against the f64 reference where both read the same
/// stored K/V words (only f32 arithmetic differs): `ATTENTION_ATOL + ATTENTION_RTOL x |ref|`.
pub const ATTENTION_ATOL: f64 = 2e-5;
/// See [`ATTENTION_ATOL`].
pub const ATTENTION_RTOL: f64 = 1e-4;
/// Where a kernel sums values in f16 (the int4 tile and tensor-core kernels), this share of
/// what those sums hold ([`attend_decode_int8_query_code_part_over`]) on top: f16's 2^-11 per
/// rounding over at most a few dozen terms.
pub const F16_SUMS_TOL: f64 = 4e-3;
/// Where a kernel sums values in f16, one output vector's (a query head's `head_dim` outputs)
/// error norm may exceed the norm of its elements' f32 tolerances by at most this share of the
/// norm of what its f16 sums hold: half of [`F16_SUMS_TOL`]. Rounding errors spread over the
/// elements and partly cancel in the norm (the most seen: 1.14e-3, pages of 64 with three tiles
/// a flush, over 299 vectors of the fixed seeds, salts 1-3 and `EXPERTKV_TEST_SEED=
/// 9049782272071741206`, 2026-12-08; a quarter, 1e-3, failed that seed); a token dropped from the
/// sums moves every element by p_t (v_t - out), which the per-element bound lets through in
/// about half the vectors (tests/tests/gpu/compress.rs measures both).
pub const F16_SUMS_VECTOR_TOL: f64 = 2e-3;

/// The first output vector of `d` elements whose error norm against `want` exceeds
/// `norm(ATTENTION_ATOL + ATTENTION_RTOL |want|) + F16_SUMS_VECTOR_TOL x norm(held)`, `held`
/// being what each element's f16 sums hold: its index, error norm and bound.
pub fn f16_sums_vector_excess(got: &[f32], want: &[f64], held: &[f64], d: usize) -> Option<(usize, f64, f64)> {
    got.chunks(d).zip(want.chunks(d)).zip(held.chunks(d)).enumerate().find_map(|(v, ((g, w), c))| {
        let err = g.iter().zip(w).map(|(g, w)| (f64::from(*g) - w).powi(2)).sum::<f64>().sqrt();
        let base = w.iter().map(|w| (ATTENTION_ATOL + ATTENTION_RTOL * w.abs()).powi(2)).sum::<f64>().sqrt();
        let bound = base + F16_SUMS_VECTOR_TOL * c.iter().map(|c| c * c).sum::<f64>().sqrt();
        (err.is_nan() || err > bound).then_some((v, err, bound))
    })
}

/// What the reference decode attention computes: the output and each attended token's mass.
pub struct AttentionOutput {
    /// `[seq][q_head][head_dim]`
    pub out: Vec<f64>,
    /// Every attended cached vector: (seq, KV head, page, slot, attention mass summed over the
    /// query heads of that KV head).
    pub mass: Vec<(u32, u32, u32, u32, f64)>,
}

/// Decode attention for sequences `0..n_seqs` of `layer`. `queries` is `[seq][q_head][head_dim]`
/// with q_heads = kv_heads * group; scores are scaled by `scale`.
pub fn attend_decode(model: &PoolModel, layer: u32, n_seqs: u32, queries: &[f32], group: u32, scale: f64) -> AttentionOutput {
    attend_decode_over(model, layer, n_seqs, queries, group, scale, &|seq, head| model.page_list(layer, seq, head))
}

/// Causal attention of a chunk of `seq`'s queries (`[c][q_head][head_dim]`, query `c` at
/// position `first_position + c`) over `seq`'s pages of `layer`: query `c` sees the cached tokens
/// whose position is at most its own (`attend/prefill.wgsl`). Returns `[c][q_head][head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn attend_prefill(model: &PoolModel, layer: u32, seq: u32, first_position: u32, queries: &[f32], group: u32, scale: f64) -> Vec<f64> {
    let cfg = &model.cfg;
    let (d, hkv, mw) = (cfg.head_dim as usize, cfg.kv_heads, cfg.meta_words() as usize);
    let hq = (hkv * group) as usize;
    let n = queries.len() / (hq * d);
    let mut out = vec![0.0; n * hq * d];
    for h in 0..hkv {
        let tokens: Vec<(u32, u32, u32)> = model
            .page_list(layer, seq, h)
            .into_iter()
            .flat_map(|page| {
                (0..model.page_meta[page as usize].fill)
                    .map(move |s| (page, s, model.slot_meta[(page * cfg.page_size + s) as usize * mw + crate::gpu_data::meta::POSITION]))
            })
            .collect();
        for c in 0..n {
            let seen: Vec<&(u32, u32, u32)> = tokens.iter().filter(|t| t.2 <= first_position + c as u32).collect();
            for g in 0..group {
                let q0 = (c * hq + (h * group + g) as usize) * d;
                let q = &queries[q0..q0 + d];
                let scores: Vec<f64> = seen
                    .iter()
                    .map(|&&(p, s, _)| model.vector(p, s, 0).iter().zip(q).map(|(k, q)| k * f64::from(*q)).sum::<f64>() * scale)
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let l: f64 = w.iter().sum();
                for (&&(p, s, _), wt) in seen.iter().zip(&w) {
                    for (o, v) in out[q0..q0 + d].iter_mut().zip(model.vector(p, s, 1)) {
                        *o += wt / l * v;
                    }
                }
            }
        }
    }
    out
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
    attend_with(model, n_seqs, queries, group, pages, &|key, q, _, _| {
        key.iter().zip(q).map(|(k, q)| k * f64::from(*q)).sum::<f64>() * scale
    })
}

/// [`attend_decode`] with the scores of int4-compressed pages as the fast quantised kernel
/// (`attend/split_quant.wgsl`) computes them: per page and query head, `q * scale` (f32) is
/// multiplied by the page's per-channel key scales (f32), quantised to int8 with the power-of-two
/// step `alpha = 2^(E - 6)` (E the exponent of the largest magnitude, at least -120, so every
/// value lies in (-128, 128); rounded half to even, at most 127), and the score is
/// `alpha * sum q8 * (code - 8) + sum (q * scale) * (min + 8 * key scale)`. Raw pages, and every
/// other codec, score as in [`attend_decode`].
pub fn attend_decode_int8_query(model: &PoolModel, layer: u32, n_seqs: u32, queries: &[f32], group: u32, scale: f32) -> AttentionOutput {
    attend_decode_int8_query_over(model, n_seqs, queries, group, scale, &|seq, head| model.page_list(layer, seq, head))
}

/// [`attend_decode_int8_query`] over the pages `pages(seq, head)` gives (QUEST's selection).
pub fn attend_decode_int8_query_over(
    model: &PoolModel,
    n_seqs: u32,
    queries: &[f32],
    group: u32,
    scale: f32,
    pages: &dyn Fn(u32, u32) -> Vec<u32>,
) -> AttentionOutput {
    attend_with(model, n_seqs, queries, group, pages, &int8_query_score(model, scale))
}

/// What the tile kernel (`attend/split_quant_tile.wgsl`) sums in f16, `[seq][q_head][head_dim]`:
/// the attention-weighted codes times scales, `sum_t p_t (v_t - min_t)` over the int4 pages'
/// tokens (their value minus their group's min; raw tokens, summed in f32, count 0), with the
/// scores of [`attend_decode_int8_query_over`]. Its rounding error is relative to this.
pub fn attend_decode_int8_query_code_part_over(
    model: &PoolModel,
    n_seqs: u32,
    queries: &[f32],
    group: u32,
    scale: f32,
    pages: &dyn Fn(u32, u32) -> Vec<u32>,
) -> Vec<f64> {
    let cfg = &model.cfg;
    let d = cfg.head_dim as usize;
    let value = |page: u32, slot: u32| -> Vec<f64> {
        let v = model.vector(page, slot, 1);
        let Codec::Int4 { group: vg } = cfg.codec else { return vec![0.0; d] };
        if page < cfg.n_pages {
            return vec![0.0; d];
        }
        let cw = cfg.codec_page_bytes() as usize / 4;
        let words = &model.codec_kv[(page - cfg.n_pages) as usize * cw..][..cw];
        let ng = d / vg as usize;
        let prm = d + cfg.page_size as usize * d / 8 + slot as usize * ng;
        v.iter().enumerate().map(|(i, x)| x - f64::from(f16_value(words[prm + i / vg as usize]))).collect()
    };
    attend_with_values(model, n_seqs, queries, group, pages, &int8_query_score(model, scale), &value).out
}

/// The scores of [`attend_decode_int8_query`]: int4 pages with the int8 query, everything else
/// exactly.
fn int8_query_score(model: &PoolModel, scale: f32) -> impl Fn(&[f64], &[f32], u32, u32) -> f64 + '_ {
    let cfg = &model.cfg;
    let exact = move |key: &[f64], q: &[f32]| key.iter().zip(q).map(|(k, q)| k * f64::from(*q)).sum::<f64>() * f64::from(scale);
    let int4 = matches!(cfg.codec, Codec::Int4 { .. });
    let cw = cfg.codec_page_bytes() as usize / 4;
    let d = cfg.head_dim as usize;
    let row = d / 8;
    move |key: &[f64], q: &[f32], page: u32, slot: u32| {
        if !int4 || page < cfg.n_pages {
            return exact(key, q);
        }
        let c0 = (page - cfg.n_pages) as usize * cw;
        let words = &model.codec_kv[c0..c0 + cw];
        let qf: Vec<f32> = q.iter().map(|v| v * scale).collect();
        let qs: Vec<f32> = (0..d).map(|c| qf[c] * f16_value(words[c] >> 16)).collect();
        let mx = qs.iter().fold(0f32, |a, v| a.max(v.abs()));
        let ex = (((mx.to_bits() >> 23) & 0xff) as i32 - 127).max(-120);
        let step = 2f64.powi(6 - ex);
        let codes = &words[d + slot as usize * row..][..row];
        let mut isum = 0i64;
        let mut bias = 0f64;
        for c in 0..d {
            let q8 = (f64::from(qs[c]) * step).round_ties_even().min(127.0) as i64;
            let code = (codes[c / 8] >> ((c % 8) * 4)) & 15;
            isum += q8 * (i64::from(code) - 8);
            bias += f64::from(qf[c]) * f64::from(f16_value(words[c])) + 8.0 * f64::from(qs[c]);
        }
        2f64.powi(ex - 6) * isum as f64 + bias
    }
}

/// A cached key's scaled score: `(decoded key, query, page, slot)`.
type KeyScore<'a> = dyn Fn(&[f64], &[f32], u32, u32) -> f64 + 'a;

/// Decode attention with `score(key, query, page, slot)` giving each cached key's scaled score.
fn attend_with(
    model: &PoolModel,
    n_seqs: u32,
    queries: &[f32],
    group: u32,
    pages: &dyn Fn(u32, u32) -> Vec<u32>,
    score: &KeyScore<'_>,
) -> AttentionOutput {
    attend_with_values(model, n_seqs, queries, group, pages, score, &|p, s| model.vector(p, s, 1))
}

/// [`attend_with`] summing `value(page, slot)` instead of each token's decoded value.
fn attend_with_values(
    model: &PoolModel,
    n_seqs: u32,
    queries: &[f32],
    group: u32,
    pages: &dyn Fn(u32, u32) -> Vec<u32>,
    score: &KeyScore<'_>,
    value: &dyn Fn(u32, u32) -> Vec<f64>,
) -> AttentionOutput {
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
            let values: Vec<Vec<f64>> = tokens.iter().map(|&(p, s)| value(p, s)).collect();
            for g in 0..group {
                let qh = (h * group + g) as usize;
                let q0 = (seq as usize * hq + qh) * d;
                let q = &queries[q0..q0 + d];
                let scores: Vec<f64> = keys.iter().zip(&tokens).map(|(k, &(p, s))| score(k, q, p, s)).collect();
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
