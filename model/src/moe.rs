//! MoEfication of a dense SwiGLU FFN (after Zhang et al., "MoEfication", 2022): each layer's FFN
//! neurons are split into `E` groups, the "experts"; a router picks, per token, the `k` groups
//! whose centroid best matches the token, and only those groups' neurons are evaluated.
//!
//! Choices, and why:
//! - **What is clustered**: neuron `n`'s gate row `Wgate[n]`, normalised to unit length (spherical
//!   k-means, similarity = dot product). Neurons whose gates point the same way open for the same
//!   inputs, so a group's mean gate direction tells which tokens it matters for.
//! - **Initialisation**: greedy k-means++ (distance `2 - 2 cos`) with [`expertkv_core::rng::Rng`], seeded by
//!   [`MoeConfig::seed`] mixed with the layer index; then [`MoeConfig::iterations`] rounds of
//!   assign / recompute, a fixed count so the result depends on nothing but the weights and the
//!   seed. The same weights, `E` and seed give the same experts on every platform.
//! - **Balanced** (the default): every group holds `ffn / E` neurons (the first `ffn % E` one
//!   more). Each round assigns (neuron, group) pairs greedily by decreasing similarity, skipping
//!   full groups (ties: lower neuron, then lower group). Equal sizes make the cost of `k` experts
//!   fixed (exactly `k / E` of the FFN), which is what a GPU kernel with a fixed expert size and a
//!   fair comparison of `(E, k)` settings want. Unbalanced (`balanced: false`) is plain spherical
//!   k-means; an emptied group takes the neuron least similar to its own centroid.
//! - **Router**: a token's FFN input (`rmsnorm(x) * ffn_norm`), normalised to unit length, is
//!   scored against each group's centroid (the normalised mean of its unit gate rows) by dot
//!   product; the top `k` scores win (ties: lowest expert).
//! - **Fitted router** (optional, [`Moefication::fit_router`]): the centroid router ranks the
//!   experts far from the best choice on SmolLM2 (BENCHMARKS.md: at E = 8, k = 4 perplexity
//!   9,763 against 115 when the experts are chosen by their actual activation mass). A linear
//!   router fitted by ridge regression to that mass on a calibration text
//!   ([`CALIBRATION_TEXT`]) replaces the centroids in the same `[E][hidden]` matrix, so the GPU
//!   path is unchanged; it brings E = 8, k = 4 to 238 (same text, same experts), and on
//!   `eval`'s text 13,441 to 577. At a quarter of the FFN (E = 8, k = 2) even the best choice
//!   leaves this model broken, and the fitted router is no reliable improvement there.
//! - **Weights of the chosen experts: 1.** The groups partition one FFN, so the sum of all of
//!   them is exactly the dense FFN; scaling by a softmax of router scores (which nothing was
//!   trained with) would shrink every output and make `k = E` differ from the dense model. With
//!   weight 1, `E = 1` (or `k = E`) is the dense FFN up to summation order.
//!
//! Clustering all 30 layers of SmolLM2-135M takes under a second on two cores, fitting the
//! routers about 25 s; `expertkv run` and `eval` compute a MoEfication once and cache it on disk
//! ([`Moefication::to_bytes`] / [`Moefication::from_bytes`], keyed on a hash of the model file,
//! the [`MoeConfig`] and the calibration text).
//!
//! A GGUF file that holds real experts (llama.cpp's `ffn_gate_inp` and `ffn_*_exps`) is read
//! into the same structure by [`Moefication::native`]: expert `e` owns the file's neurons
//! `e * ffn .. (e + 1) * ffn`, the router's weights are `ffn_gate_inp` as trained, and the
//! chosen experts are weighted as the model was trained ([`Gating::Softmax`], llama.cpp's
//! `build_moe_ffn` for the llama architecture: a softmax over all `E` logits, the top `k` kept
//! and renormalised, which equals a softmax over the `k` chosen logits).

pub use crate::config::Gating;
use crate::math::{argmax, axpy, dot, matvec, silu};
use crate::matrix::Matrix;
use crate::weights::{LayerWeights, LlamaWeights};
use crate::{Error, Result};
use expertkv_core::rng::Rng;

/// Text for [`Moefication::fit_router`] (written for expertkv, unrelated to the text `eval`
/// measures on, so the fitted routers are not scored on what they were fitted to).
pub const CALIBRATION_TEXT: &str = include_str!("../data/calibration.txt");
/// The ridge of [`Moefication::fit_router`]: a thousandth of the inputs' mean energy per feature.
pub const DEFAULT_RIDGE: f64 = 1e-3;

/// The first bytes of [`Moefication::to_bytes`] (its format's version is the last digit).
const CACHE_MAGIC: &[u8; 8] = b"EKVMOE1\n";

/// The seed of [`MoeConfig::new`].
pub const DEFAULT_SEED: u64 = 0x6d6f_6566_7931;
/// Assign / recompute rounds of [`MoeConfig::new`] (k-means has settled well before on these
/// weights; a fixed count keeps the result reproducible).
pub const DEFAULT_ITERATIONS: usize = 16;

/// How to MoEfy a model.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MoeConfig {
    /// Groups (experts) per layer, `E`; 1 is the dense model.
    pub experts: usize,
    /// Groups evaluated per token, `k` (1 ..= `experts`).
    pub top_k: usize,
    /// Seed of the k-means++ initialisation, mixed with the layer index ([`DEFAULT_SEED`]; 0 for a
    /// MoE file's own experts, which are not clustered).
    pub seed: u64,
    /// Assign / recompute rounds after the initialisation ([`DEFAULT_ITERATIONS`]; 0 for a MoE
    /// file's own experts).
    pub iterations: usize,
    /// Equal group sizes (see the module docs).
    pub balanced: bool,
}

impl MoeConfig {
    /// `E` experts, top-`k`, balanced, with [`DEFAULT_SEED`] and [`DEFAULT_ITERATIONS`].
    pub fn new(experts: usize, top_k: usize) -> Self {
        MoeConfig { experts, top_k, seed: DEFAULT_SEED, iterations: DEFAULT_ITERATIONS, balanced: true }
    }

    /// Checks the settings against an FFN of `ffn` neurons.
    pub fn validate(&self, ffn: usize) -> Result<()> {
        if self.experts == 0 || self.experts > ffn {
            return Err(Error::config("experts", self.experts, format!("must be in 1..={ffn} (the FFN's neurons)")));
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return Err(Error::config("top_k", self.top_k, format!("must be in 1..={} (the experts)", self.experts)));
        }
        Ok(())
    }
}

/// One layer's experts and router.
#[derive(Clone, Debug)]
pub struct MoeLayer {
    hidden: usize,
    /// How the router scores a token and weights the chosen experts: [`Gating::Unit`] when MoEfied,
    /// [`Gating::Softmax`] for a MoE file.
    pub gating: Gating,
    /// `[E][hidden]`: the router's weights (MoEfication: unit-length centroids; a MoE file: its
    /// `ffn_gate_inp`).
    pub centroids: Vec<f32>,
    /// `[ffn]`: the expert of each neuron.
    pub expert_from_neuron: Vec<u32>,
    /// `[ffn]`: neuron ids grouped by expert, ascending within each; expert `e` is
    /// `neurons[offsets[e]..offsets[e + 1]]`.
    pub neurons: Vec<u32>,
    /// `[E + 1]`.
    pub offsets: Vec<u32>,
    /// `Wdown` transposed, `[ffn][hidden]`: neuron `n`'s output direction is contiguous, so a
    /// subset of neurons reads only its own rows.
    down_t: Vec<f32>,
}

impl MoeLayer {
    /// Experts `E` of this layer (`offsets.len() - 1`).
    pub fn experts(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Expert `e`'s neurons (ascending).
    pub fn expert(&self, e: usize) -> &[u32] {
        &self.neurons[self.offsets[e] as usize..self.offsets[e + 1] as usize]
    }

    /// Expert `e`'s router centroid.
    pub fn centroid(&self, e: usize) -> &[f32] {
        &self.centroids[e * self.hidden..(e + 1) * self.hidden]
    }

    /// The router's scores of `x` (an FFN input, any scale) into `out` (`[E]`): the dot product
    /// of each centroid with `x / |x|` ([`Gating::Unit`]) or with `x` ([`Gating::Softmax`]).
    /// The GPU scores with `x` unnormalised in both cases: a positive scale changes no choice.
    pub fn scores(&self, x: &[f32], out: &mut [f32]) {
        let norm = dot(x, x).sqrt();
        let inv = match self.gating {
            Gating::Unit if norm > 0.0 => 1.0 / norm,
            Gating::Unit => 0.0,
            Gating::Softmax | Gating::SoftmaxShare => 1.0,
        };
        for (e, s) in out.iter_mut().enumerate() {
            *s = dot(x, self.centroid(e)) * inv;
        }
    }

    /// The weights of the chosen `experts` given the router's `scores`: 1 each
    /// ([`Gating::Unit`]) or [`softmax_weights`].
    pub fn weights(&self, scores: &[f32], experts: &[usize]) -> Vec<f32> {
        match self.gating {
            Gating::Unit => vec![1.0; experts.len()],
            Gating::Softmax => softmax_weights(scores, experts),
            Gating::SoftmaxShare => softmax_share_weights(scores, experts),
        }
    }

    /// The FFN output of `x` through the neurons of `experts` only, expert `experts[j]` weighted
    /// `weights[j]`: `out = sum_j weights[j] sum_{n in experts[j]} silu(Wgate[n] x) (Wup[n] x)
    /// Wdown[:, n]`.
    pub fn forward(&self, lw: &LayerWeights, x: &[f32], experts: &[usize], weights: &[f32], out: &mut [f32]) {
        out.fill(0.0);
        for (&e, &w) in experts.iter().zip(weights) {
            for &n in self.expert(e) {
                let n = n as usize;
                let a = silu(dot(lw.gate.row(n), x)) * dot(lw.up.row(n), x) * w;
                axpy(out, a, &self.down_t[n * self.hidden..(n + 1) * self.hidden]);
            }
        }
    }

    /// A MoE file's layer as it was trained: the router `ffn_gate_inp`, expert `e` the file's
    /// neurons `e * ffn .. (e + 1) * ffn`, weighted by `gating` ([`Gating::Softmax`] or
    /// [`Gating::SoftmaxShare`]; [`Gating::Unit`] for a MoEfied model written as a MoE file).
    pub fn native(lw: &LayerWeights, layer: usize, gating: Gating) -> Result<Self> {
        let Some(router) = &lw.router else {
            return Err(Error::Model(format!("layer {layer} has no router (`ffn_gate_inp`): not a MoE file")));
        };
        let (e, hidden, neurons) = (router.rows, router.cols, lw.gate.rows);
        if e == 0 || !neurons.is_multiple_of(e) || router.f32.len() != e * hidden || lw.down.f32.len() != neurons * hidden {
            return Err(Error::Model(format!(
                "layer {layer}: {neurons} expert neurons do not split into {e} experts of hidden {hidden} (f32 weights needed)"
            )));
        }
        let size = (neurons / e) as u32;
        Ok(MoeLayer {
            hidden,
            gating,
            centroids: router.f32.clone(),
            expert_from_neuron: (0..neurons as u32).map(|n| n / size).collect(),
            neurons: (0..neurons as u32).collect(),
            offsets: (0..=e as u32).map(|x| x * size).collect(),
            down_t: transpose(&lw.down),
        })
    }

    /// Clusters `lw`'s neurons (see the module docs).
    pub fn from_layer(lw: &LayerWeights, config: &MoeConfig, layer: usize) -> Result<Self> {
        let (ffn, hidden) = (lw.gate.rows, lw.gate.cols);
        config.validate(ffn)?;
        if lw.gate.f32.len() != ffn * hidden || lw.down.f32.len() != ffn * hidden || (lw.down.rows, lw.down.cols) != (hidden, ffn) {
            return Err(Error::Input(format!("MoEfication of layer {layer} needs f32 gate [{ffn}][{hidden}] and down [{hidden}][{ffn}]")));
        }
        let (centroids, assignment) = spherical_kmeans(&lw.gate, config, layer);
        Ok(Self::from_assignment(lw, centroids, assignment, config.experts))
    }

    /// The layer whose router is `centroids` and whose neuron `n` belongs to expert
    /// `assignment[n]` (every entry below `e`).
    fn from_assignment(lw: &LayerWeights, centroids: Vec<f32>, assignment: Vec<u32>, e: usize) -> Self {
        let mut offsets = vec![0u32; e + 1];
        for &a in &assignment {
            offsets[a as usize + 1] += 1;
        }
        for j in 0..e {
            offsets[j + 1] += offsets[j];
        }
        let mut fill = offsets.clone();
        let mut neurons = vec![0u32; assignment.len()];
        for (n, &a) in assignment.iter().enumerate() {
            neurons[fill[a as usize] as usize] = n as u32;
            fill[a as usize] += 1;
        }
        MoeLayer {
            hidden: lw.gate.cols,
            gating: Gating::Unit,
            centroids,
            expert_from_neuron: assignment,
            neurons,
            offsets,
            down_t: transpose(&lw.down),
        }
    }
}

/// `m` (`[rows][cols]` f32) transposed, `[cols][rows]`.
fn transpose(m: &Matrix) -> Vec<f32> {
    let mut t = vec![0f32; m.rows * m.cols];
    for o in 0..m.rows {
        for (n, &w) in m.row(o).iter().enumerate() {
            t[n * m.rows + o] = w;
        }
    }
    t
}

/// The softmax of the chosen experts' logits: `w_j = exp(s[e_j] - m) / sum_i exp(s[e_i] - m)`,
/// `m` their largest. (A softmax over all `E` logits, kept for the chosen and renormalised, is
/// the same.)
pub fn softmax_weights(scores: &[f32], experts: &[usize]) -> Vec<f32> {
    let m = experts.iter().map(|&e| scores[e]).fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f32> = experts.iter().map(|&e| (scores[e] - m).exp()).collect();
    let sum: f32 = w.iter().sum();
    w.into_iter().map(|x| x / sum).collect()
}

/// The chosen experts' shares of the softmax over all `E` logits, not renormalised:
/// `w_j = exp(s[e_j] - m) / sum_e exp(s[e] - m)`, `m` the largest logit (llama.cpp's
/// `build_moe_ffn` without `norm_w`).
pub fn softmax_share_weights(scores: &[f32], experts: &[usize]) -> Vec<f32> {
    let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = scores.iter().map(|&s| (s - m).exp()).sum();
    experts.iter().map(|&e| (scores[e] - m).exp() / sum).collect()
}

/// A MoEfied model: one [`MoeLayer`] per transformer layer.
#[derive(Clone, Debug)]
pub struct Moefication {
    /// The settings it was made with (a MoE file's own experts: `llama.expert_count`,
    /// `llama.expert_used_count`, seed and iterations 0).
    pub config: MoeConfig,
    /// The experts and router of each transformer layer, in order.
    pub layers: Vec<MoeLayer>,
    /// Calibration tokens the routers were fitted on ([`Moefication::fit_router`]); `None`: the
    /// centroid routers (or a MoE file's own).
    pub fitted: Option<usize>,
    /// A MoE file's own experts ([`Moefication::native`]), not clustered here.
    pub native: bool,
}

impl Moefication {
    /// Clusters every layer of `w` (f32 weights needed), layers split over threads on native
    /// targets.
    pub fn from_weights(w: &LlamaWeights, config: &MoeConfig) -> Result<Self> {
        if w.is_moe() {
            return Err(Error::config(
                "experts",
                config.experts,
                format!(
                    "the file is a Mixture-of-Experts model with {} experts and its own router; MoEfication splits dense FFNs only",
                    w.config.expert_count
                ),
            ));
        }
        config.validate(w.config.feed_forward_length as usize)?;
        #[cfg(not(target_arch = "wasm32"))]
        let layers: Vec<Result<MoeLayer>> = {
            let n = w.layers.len();
            let threads = std::thread::available_parallelism().map_or(1, |t| t.get()).clamp(1, n.max(1));
            let mut slots: Vec<Option<Result<MoeLayer>>> = (0..n).map(|_| None).collect();
            std::thread::scope(|s| {
                for (t, chunk) in slots.chunks_mut(n.div_ceil(threads).max(1)).enumerate() {
                    let first = t * n.div_ceil(threads).max(1);
                    s.spawn(move || {
                        for (i, slot) in chunk.iter_mut().enumerate() {
                            *slot = Some(MoeLayer::from_layer(&w.layers[first + i], config, first + i));
                        }
                    });
                }
            });
            slots.into_iter().map(|s| s.unwrap_or_else(|| Err(Error::Input("a clustering thread did not finish".into())))).collect()
        };
        #[cfg(target_arch = "wasm32")]
        let layers: Vec<Result<MoeLayer>> = w.layers.iter().enumerate().map(|(l, lw)| MoeLayer::from_layer(lw, config, l)).collect();
        Ok(Moefication { config: config.clone(), layers: layers.into_iter().collect::<Result<_>>()?, fitted: None, native: false })
    }

    /// Replace every layer's centroid router with a linear router fitted to the experts' actual
    /// activation mass on calibration tokens (`calib`, the dense model's FFN inputs over them,
    /// [`crate::CpuModel::calibration`]; one collection serves every (E, k)): per layer a ridge
    /// regression maps each FFN input `x_t` to its experts' masses
    /// `m_e = sum_{n in e} |silu(Wgate[n] x) (Wup[n] x)|` (`w`: the same model's weights):
    /// `W = argmin sum_t |W x_t - m(x_t)|^2 + lambda |W|^2` with
    /// `lambda = ridge * tr(X^T X) / hidden`. No intercept, so the ranking of the scores is
    /// unchanged by the token's scale, and the GPU scores it like the centroids. Returns the
    /// seconds taken.
    pub fn fit_router(&mut self, w: &LlamaWeights, calib: &Calibration, ridge: f64) -> Result<f64> {
        let t0 = std::time::Instant::now();
        if ridge.is_nan() || ridge < 0.0 {
            return Err(Error::Input(format!("fit_router: the ridge must be >= 0, not {ridge}")));
        }
        self.check_fits(w)?;
        let n_layers = self.layers.len();
        let (xs, n) = (&calib.xs, calib.tokens);
        let hidden = w.layers.first().map_or(0, |l| l.attn_norm.len());
        if xs.len() != n_layers || xs.iter().any(|x| x.len() != n * hidden) {
            return Err(Error::Input(format!(
                "fit_router: the calibration holds {} layers of {n} tokens, not {n_layers} layers of {hidden} features",
                xs.len()
            )));
        }
        let fit = |l: usize, layer: &mut MoeLayer| {
            fit_layer(layer, &w.layers[l], &xs[l], n, ridge).map_err(|m| Error::Input(format!("fit_router: layer {l}: {m}")))
        };
        #[cfg(not(target_arch = "wasm32"))]
        {
            let threads = std::thread::available_parallelism().map_or(1, |t| t.get()).clamp(1, n_layers.max(1));
            let per = n_layers.div_ceil(threads).max(1);
            let results: Vec<Result<()>> = std::thread::scope(|sc| {
                let handles: Vec<_> = self
                    .layers
                    .chunks_mut(per)
                    .enumerate()
                    .map(|(c, chunk)| sc.spawn(move || chunk.iter_mut().enumerate().try_for_each(|(i, layer)| fit(c * per + i, layer))))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|_| Err(Error::Input("fit_router: a thread panicked".into()))))
                    .collect()
            });
            results.into_iter().collect::<Result<()>>()?;
        }
        #[cfg(target_arch = "wasm32")]
        for (l, layer) in self.layers.iter_mut().enumerate() {
            fit(l, layer)?;
        }
        self.fitted = Some(n);
        Ok(t0.elapsed().as_secs_f64())
    }

    /// The MoEfication as bytes, for a disk cache: the settings, the fitted flag and per layer
    /// the routers and every neuron's expert (Wdown comes back from the weights,
    /// [`Moefication::from_bytes`]). Not for a MoE file's own experts (read from the file).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        if self.is_native() {
            return Err(Error::Input("a MoE file's own experts are read from the file, not cached".into()));
        }
        let c = &self.config;
        let hidden = self.layers.first().map_or(0, |l| l.hidden);
        let ffn = self.layers.first().map_or(0, |l| l.neurons.len());
        let mut out = CACHE_MAGIC.to_vec();
        let u32s = |v: &[u32], out: &mut Vec<u8>| v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
        let fitted = self.fitted.map_or(u32::MAX, |n| n as u32);
        let head = [
            c.experts as u32,
            c.top_k as u32,
            c.iterations as u32,
            u32::from(c.balanced),
            fitted,
            self.layers.len() as u32,
            hidden as u32,
            ffn as u32,
        ];
        u32s(&head, &mut out);
        out.extend_from_slice(&c.seed.to_le_bytes());
        for l in &self.layers {
            l.centroids.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
            u32s(&l.expert_from_neuron, &mut out);
        }
        Ok(out)
    }

    /// Back from [`Moefication::to_bytes`], against the weights it was made from (their Wdown);
    /// anything amiss (another format, another shape, a truncated or damaged file) is an error,
    /// never a panic.
    pub fn from_bytes(bytes: &[u8], w: &LlamaWeights) -> Result<Self> {
        let bad = |what: &str| Error::Input(format!("MoE cache: {what}"));
        let rest = bytes.strip_prefix(CACHE_MAGIC).ok_or_else(|| bad("not an expertkv MoE cache of this version"))?;
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<&[u8]> {
            let end = at.checked_add(n).ok_or_else(|| bad("size overflows"))?;
            let s = rest.get(at..end).ok_or_else(|| bad("truncated"))?;
            at = end;
            Ok(s)
        };
        let mut head = [0u32; 8];
        for h in &mut head {
            let b = take(4)?;
            *h = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        let [experts, top_k, iterations, balanced, fitted, n_layers, hidden, ffn] = head;
        let sb = take(8)?;
        let seed = u64::from_le_bytes([sb[0], sb[1], sb[2], sb[3], sb[4], sb[5], sb[6], sb[7]]);
        if balanced > 1 {
            return Err(bad("damaged (the balanced flag)"));
        }
        let c = &w.config;
        if w.is_moe() || n_layers as usize != w.layers.len() || hidden != c.embedding_length || ffn != c.feed_forward_length {
            return Err(bad("made for another model shape"));
        }
        let config =
            MoeConfig { experts: experts as usize, top_k: top_k as usize, seed, iterations: iterations as usize, balanced: balanced != 0 };
        config.validate(ffn as usize)?;
        let (h, f, e) = (hidden as usize, ffn as usize, experts as usize);
        let mut layers = Vec::with_capacity(w.layers.len());
        for lw in &w.layers {
            let centroids: Vec<f32> = take(4 * e * h)?.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            let assignment: Vec<u32> = take(4 * f)?.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            if centroids.iter().any(|x| !x.is_finite()) || assignment.iter().any(|&a| a >= experts) {
                return Err(bad("damaged (a router weight not finite or a neuron's expert out of range)"));
            }
            layers.push(MoeLayer::from_assignment(lw, centroids, assignment, e));
        }
        if at != rest.len() {
            return Err(bad("trailing bytes"));
        }
        Ok(Moefication { config, layers, fitted: (fitted != u32::MAX).then_some(fitted as usize), native: false })
    }

    /// A MoE file's own experts and routers ([`MoeLayer::native`]), `k` = its
    /// `llama.expert_used_count`.
    pub fn native(w: &LlamaWeights) -> Result<Self> {
        let c = &w.config;
        if !w.is_moe() {
            return Err(Error::Model("the file has no experts of its own (`llama.expert_count` is 0)".into()));
        }
        let gating = c.expert_gating();
        let layers = w.layers.iter().enumerate().map(|(l, lw)| MoeLayer::native(lw, l, gating)).collect::<Result<Vec<_>>>()?;
        let config =
            MoeConfig { experts: c.expert_count as usize, top_k: c.expert_used_count as usize, seed: 0, iterations: 0, balanced: true };
        Ok(Moefication { config, layers, fitted: None, native: true })
    }

    /// Whether these are a MoE file's own experts ([`Moefication::native`]).
    pub fn is_native(&self) -> bool {
        self.native
    }

    /// Whether these experts were made for a model of `w`'s shape: MoEfication for a dense model,
    /// a file's own experts for that MoE file.
    pub fn check_fits(&self, w: &LlamaWeights) -> Result<()> {
        let c = &w.config;
        if self.is_native() != w.is_moe() {
            return Err(Error::Input(if w.is_moe() {
                "the file's FFNs are already experts with a trained router; MoEfication splits dense FFNs only".into()
            } else {
                "these experts are another file's own (a MoE GGUF), not a MoEfication of this model".into()
            }));
        }
        let ok = self.layers.len() == w.layers.len()
            && self.layers.iter().zip(&w.layers).all(|(l, lw)| l.hidden == c.embedding_length as usize && l.neurons.len() == lw.gate.rows);
        if !ok {
            return Err(Error::Input(format!(
                "MoEfication of {} layers does not fit a model of {} layers, hidden {}, FFN {}",
                self.layers.len(),
                w.layers.len(),
                c.embedding_length,
                c.feed_forward_length
            )));
        }
        Ok(())
    }

    /// The fraction of FFN neurons a token evaluates (`k / E` when balanced).
    pub fn fraction_evaluated(&self) -> f64 {
        let (e, k) = (self.config.experts, self.config.top_k);
        self.layers
            .iter()
            .map(|l| {
                let mut sizes: Vec<usize> = (0..e).map(|j| l.expert(j).len()).collect();
                sizes.sort_unstable_by(|a, b| b.cmp(a));
                sizes.iter().take(k).sum::<usize>() as f64 / l.neurons.len() as f64
            })
            .fold(0.0, f64::max)
    }
}

/// The `k` highest scores' indices, highest first; ties go to the lower index.
pub fn top_k(scores: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// A dense model's FFN inputs (the normed residual stream each layer's FFN reads) over
/// calibration tokens, per layer: what [`Moefication::fit_router`] fits to.
pub struct Calibration {
    /// Per layer, `tokens` rows of `hidden` features.
    xs: Vec<Vec<f32>>,
    tokens: usize,
}

impl Calibration {
    /// Calibration of `tokens` tokens from every layer's FFN inputs (`tokens` rows of `hidden`
    /// features per layer), as [`crate::CpuModel::calibration`] collects them.
    pub(crate) fn from_layers(xs: Vec<Vec<f32>>, tokens: usize) -> Calibration {
        Calibration { xs, tokens }
    }

    /// Calibration tokens.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
}

/// One layer of [`Moefication::fit_router`]: `x` holds `n` FFN inputs.
fn fit_layer(layer: &mut MoeLayer, lw: &LayerWeights, x: &[f32], n: usize, ridge: f64) -> std::result::Result<(), String> {
    let (h, e) = (layer.hidden, layer.experts());
    // Gram matrix (lower triangle) and right-hand sides in f64.
    let mut gram = vec![0f64; h * h];
    let mut rhs = vec![0f64; h * e];
    let mut g = vec![0f32; lw.gate.rows];
    let mut u = vec![0f32; lw.up.rows];
    for t in 0..n {
        let xt = &x[t * h..(t + 1) * h];
        matvec(&lw.gate, xt, &mut g, 1);
        matvec(&lw.up, xt, &mut u, 1);
        for j in 0..e {
            let m: f64 = layer.expert(j).iter().map(|&nn| f64::from((silu(g[nn as usize]) * u[nn as usize]).abs())).sum();
            for (i, &xi) in xt.iter().enumerate() {
                rhs[i * e + j] += f64::from(xi) * m;
            }
        }
        for i in 0..h {
            let xi = f64::from(xt[i]);
            for k in 0..=i {
                gram[i * h + k] += xi * f64::from(xt[k]);
            }
        }
    }
    let trace: f64 = (0..h).map(|i| gram[i * h + i]).sum();
    for i in 0..h {
        gram[i * h + i] += ridge * trace / h as f64 + 1e-12;
    }
    let sol = cholesky_solve(&mut gram, &rhs, h, e).ok_or("the regression's system is not positive definite")?;
    for j in 0..e {
        for i in 0..h {
            layer.centroids[j * h + i] = sol[i * e + j] as f32;
        }
    }
    Ok(())
}

/// Solve `A X = B` for symmetric positive definite `a` (`[n][n]`, only its lower triangle read,
/// overwritten by its Cholesky factor) and `b` (`[n][m]`); `None` when `a` is not positive
/// definite.
fn cholesky_solve(a: &mut [f64], b: &[f64], n: usize, m: usize) -> Option<Vec<f64>> {
    for j in 0..n {
        let mut d = a[j * n + j];
        for k in 0..j {
            d -= a[j * n + k] * a[j * n + k];
        }
        if d <= 0.0 || !d.is_finite() {
            return None;
        }
        let d = d.sqrt();
        a[j * n + j] = d;
        for i in j + 1..n {
            let mut s = a[i * n + j];
            for k in 0..j {
                s -= a[i * n + k] * a[j * n + k];
            }
            a[i * n + j] = s / d;
        }
    }
    let mut x = b.to_vec();
    for c in 0..m {
        for i in 0..n {
            let mut s = x[i * m + c];
            for k in 0..i {
                s -= a[i * n + k] * x[k * m + c];
            }
            x[i * m + c] = s / a[i * n + i];
        }
        for i in (0..n).rev() {
            let mut s = x[i * m + c];
            for k in i + 1..n {
                s -= a[k * n + i] * x[k * m + c];
            }
            x[i * m + c] = s / a[i * n + i];
        }
    }
    Some(x)
}

fn normalise(v: &mut [f32]) {
    let n = dot(v, v).sqrt();
    if n > 0.0 {
        v.iter_mut().for_each(|x| *x /= n);
    }
}

/// Spherical k-means over the unit rows of `m`: (centroids `[E][cols]`, the group of each row).
fn spherical_kmeans(m: &Matrix, config: &MoeConfig, layer: usize) -> (Vec<f32>, Vec<u32>) {
    let (n, d, e) = (m.rows, m.cols, config.experts);
    let mut x = m.f32.clone();
    for row in x.chunks_exact_mut(d) {
        normalise(row);
    }
    let row = |i: usize| &x[i * d..(i + 1) * d];
    let mut rng = Rng::new(config.seed ^ (layer as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    // Greedy k-means++ (as scikit-learn's): each next centroid is the best, by the resulting
    // potential, of `2 + ln E` rows drawn with probability proportional to their squared distance
    // (`2 - 2 cos` for unit rows) from the nearest centroid so far. The extra draws make seeding
    // two centroids inside one tight cluster, which Lloyd rounds cannot undo, rare.
    let dist = |i: usize, c: &[f32]| f64::from((2.0 - 2.0 * dot(row(i), c)).max(0.0));
    let trials = 2 + (e as f64).ln() as usize;
    let mut centroids = Vec::with_capacity(e * d);
    centroids.extend_from_slice(row(rng.below(n as u32) as usize));
    let mut d2: Vec<f64> = (0..n).map(|i| dist(i, &centroids[..d])).collect();
    for _ in 1..e {
        let total: f64 = d2.iter().sum();
        let mut best: Option<(f64, Vec<f64>, usize)> = None;
        for _ in 0..trials {
            let pick = if total > 0.0 {
                let mut r = rng.uniform() * total;
                d2.iter()
                    .position(|&w| {
                        let hit = r < w;
                        r -= w;
                        hit
                    })
                    // Rounding can leave r just above the last weight: take the last row with any.
                    .unwrap_or_else(|| d2.iter().rposition(|&w| w > 0.0).unwrap_or(n - 1))
            } else {
                rng.below(n as u32) as usize
            };
            let cand: Vec<f64> = (0..n).map(|i| d2[i].min(dist(i, row(pick)))).collect();
            let potential: f64 = cand.iter().sum();
            if best.as_ref().is_none_or(|b| potential < b.0) {
                best = Some((potential, cand, pick));
            }
        }
        if let Some((_, cand, pick)) = best {
            centroids.extend_from_slice(row(pick));
            d2 = cand;
        }
    }
    let mut assignment = vec![0u32; n];
    let mut sims = vec![0f32; n * e];
    for _ in 0..config.iterations.max(1) {
        for i in 0..n {
            for j in 0..e {
                sims[i * e + j] = dot(row(i), &centroids[j * d..(j + 1) * d]);
            }
        }
        if config.balanced {
            assign_balanced(&sims, n, e, &mut assignment);
        } else {
            for (i, a) in assignment.iter_mut().enumerate() {
                let s = &sims[i * e..(i + 1) * e];
                *a = argmax(s);
            }
            // Refill any emptied group with the row least similar to its own centroid.
            for j in 0..e as u32 {
                if !assignment.contains(&j) {
                    let worst = (0..n)
                        .filter(|&i| assignment.iter().filter(|&&a| a == assignment[i]).count() > 1)
                        .min_by(|&a, &b| sims[a * e + assignment[a] as usize].total_cmp(&sims[b * e + assignment[b] as usize]));
                    if let Some(i) = worst {
                        assignment[i] = j;
                    }
                }
            }
        }
        centroids.fill(0.0);
        for (i, &a) in assignment.iter().enumerate() {
            let a = a as usize;
            for (c, v) in centroids[a * d..(a + 1) * d].iter_mut().zip(row(i)) {
                *c += v;
            }
        }
        for c in centroids.chunks_exact_mut(d) {
            normalise(c);
        }
    }
    (centroids, assignment)
}

/// Greedy capacity-constrained assignment: pairs by decreasing similarity, each row to the first
/// group of its pairs that still has room. Group `j` holds `n / e` rows, plus one for `j < n % e`.
fn assign_balanced(sims: &[f32], n: usize, e: usize, assignment: &mut [u32]) {
    let mut room: Vec<usize> = (0..e).map(|j| n / e + usize::from(j < n % e)).collect();
    let mut pairs: Vec<(u32, u32)> = (0..n as u32).flat_map(|i| (0..e as u32).map(move |j| (i, j))).collect();
    let sim = |&(i, j): &(u32, u32)| sims[i as usize * e + j as usize];
    pairs.sort_by(|a, b| sim(b).total_cmp(&sim(a)).then(a.cmp(b)));
    let mut done = vec![false; n];
    for (i, j) in pairs {
        let (i, j) = (i as usize, j as usize);
        if !done[i] && room[j] > 0 {
            done[i] = true;
            room[j] -= 1;
            assignment[i] = j as u32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuModel;
    use crate::gguf::GgmlType;
    use crate::math::matvec;
    use crate::test_fixtures::{PERPLEXITY_TEXT, PROMPT, prompt_ids, test_model};
    use std::sync::Arc;
    use std::time::Instant;

    fn matrix(name: &str, rows: usize, cols: usize, f: impl FnMut(usize) -> f32) -> Matrix {
        Matrix { name: name.into(), rows, cols, f32: (0..rows * cols).map(f).collect(), ggml_type: GgmlType::F32, raw: Vec::new() }
    }

    /// A random layer whose gate rows are `clusters` planted directions plus noise, neuron `n` in
    /// cluster `n % clusters`.
    fn planted_layer(seed: u64, ffn: usize, hidden: usize, clusters: usize) -> LayerWeights {
        let mut rng = Rng::new(seed);
        let dirs: Vec<f32> = (0..clusters * hidden).map(|_| rng.normal() as f32).collect();
        let gate: Vec<f32> = (0..ffn * hidden)
            .map(|i| {
                let (n, c) = (i / hidden, i % hidden);
                dirs[(n % clusters) * hidden + c] + 0.3 * rng.normal() as f32
            })
            .collect();
        let mut r = || rng.normal() as f32 * 0.2;
        LayerWeights {
            attn_norm: vec![1.0; hidden],
            wq: matrix("q", hidden, hidden, |_| r()),
            wk: matrix("k", hidden, hidden, |_| r()),
            wv: matrix("v", hidden, hidden, |_| r()),
            wo: matrix("o", hidden, hidden, |_| r()),
            ffn_norm: vec![1.0; hidden],
            gate: matrix("gate", ffn, hidden, |i| gate[i]),
            up: matrix("up", ffn, hidden, |_| r()),
            down: matrix("down", hidden, ffn, |_| r()),
            router: None,
            qkv_bias: None,
            qk_norm: None,
            shared: None,
        }
    }

    fn dense_ffn(lw: &LayerWeights, x: &[f32]) -> Vec<f32> {
        let mut g = vec![0.0; lw.gate.rows];
        let mut u = vec![0.0; lw.up.rows];
        matvec(&lw.gate, x, &mut g, 1);
        matvec(&lw.up, x, &mut u, 1);
        let a: Vec<f32> = g.iter().zip(&u).map(|(&g, &u)| silu(g) * u).collect();
        let mut y = vec![0.0; lw.down.rows];
        matvec(&lw.down, &a, &mut y, 1);
        y
    }

    /// Planted clusters are found exactly, in balanced groups, the same way for the same seed.
    #[test]
    fn moe_kmeans_finds_planted_groups_cpu() {
        let lw = planted_layer(3, 256, 48, 8);
        for (balanced, seed) in [true, false].into_iter().flat_map(|b| (1..6).map(move |s| (b, s))) {
            let cfg = MoeConfig { balanced, seed, ..MoeConfig::new(8, 2) };
            let m = MoeLayer::from_layer(&lw, &cfg, 0).unwrap();
            for e in 0..8 {
                let members = m.expert(e);
                assert_eq!(members.len(), 32, "balanced {balanced}, seed {seed}, expert {e}");
                let c = members[0] % 8;
                assert!(members.iter().all(|&n| n % 8 == c), "seed {seed}: expert {e} mixes planted clusters: {members:?}");
                assert!(members.windows(2).all(|w| w[0] < w[1]));
                assert!(members.iter().all(|&n| m.expert_from_neuron[n as usize] == e as u32));
                assert!((dot(m.centroid(e), m.centroid(e)) - 1.0).abs() < 1e-5);
            }
            let again = MoeLayer::from_layer(&lw, &cfg, 0).unwrap();
            assert_eq!((again.neurons, again.centroids), (m.neurons.clone(), m.centroids.clone()));
            // A token along one planted direction routes to that cluster's expert first.
            let x: Vec<f32> = lw.gate.row(13).to_vec();
            let mut s = vec![0.0; 8];
            m.scores(&x, &mut s);
            assert_eq!(m.expert_from_neuron[13] as usize, top_k(&s, 1)[0]);
        }
    }

    /// A MoEfication survives its bytes exactly; damaged or foreign bytes are refused, never a
    /// panic (every truncation, every single-byte change of the header).
    #[test]
    fn moe_cache_bytes_round_trip_and_refuse_damage_cpu() {
        let w = synthetic_weights(&crate::SyntheticModel::dense(4));
        let mut m = Moefication::from_weights(&w, &MoeConfig::new(6, 2)).unwrap();
        m.fitted = Some(33);
        let bytes = m.to_bytes().unwrap();
        let back = Moefication::from_bytes(&bytes, &w).unwrap();
        assert_eq!((&back.config, back.fitted), (&m.config, m.fitted));
        for (a, b) in back.layers.iter().zip(&m.layers) {
            assert_eq!(
                (&a.centroids, &a.expert_from_neuron, &a.neurons, &a.offsets, &a.down_t),
                (&b.centroids, &b.expert_from_neuron, &b.neurons, &b.offsets, &b.down_t)
            );
        }
        for cut in 0..bytes.len() {
            assert!(Moefication::from_bytes(&bytes[..cut], &w).is_err(), "truncated at {cut}");
        }
        // Header bytes: the magic, 8 u32 fields, the seed. Only the iterations (field 2), the
        // calibration count (4) and the seed may change and still describe a valid MoEfication of
        // this shape.
        for at in 0..8 + 8 * 4 + 8 {
            let mut d = bytes.clone();
            d[at] ^= 0x5a;
            if let Ok(x) = Moefication::from_bytes(&d, &w) {
                let field = (at >= 8).then(|| (at - 8) / 4);
                assert!(matches!(field, Some(2) | Some(4) | Some(8) | Some(9)), "byte {at} changed and was accepted: {:?}", x.config);
            }
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(Moefication::from_bytes(&long, &w).is_err());
        let mut nan = bytes.clone();
        let first_centroid = 8 + 8 * 4 + 8;
        nan[first_centroid..first_centroid + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        assert!(Moefication::from_bytes(&nan, &w).unwrap_err().to_string().contains("damaged"));
        let other = synthetic_weights(&crate::SyntheticModel { ffn: 64, ..crate::SyntheticModel::dense(4) });
        assert!(Moefication::from_bytes(&bytes, &other).unwrap_err().to_string().contains("another model shape"));
        let own = synthetic_weights(&crate::SyntheticModel::moe(4, 4, 2));
        assert!(Moefication::native(&own).unwrap().to_bytes().is_err());
    }

    /// Balanced groups have sizes that differ by at most one even when E does not divide the FFN.
    #[test]
    fn moe_balanced_sizes_cpu() {
        let lw = planted_layer(5, 100, 16, 3);
        let m = MoeLayer::from_layer(&lw, &MoeConfig::new(7, 3), 0).unwrap();
        let sizes: Vec<usize> = (0..7).map(|e| m.expert(e).len()).collect();
        assert_eq!(sizes, [15, 15, 14, 14, 14, 14, 14]);
        let mut all = m.neurons.clone();
        all.sort_unstable();
        assert_eq!(all, (0..100).collect::<Vec<u32>>());
    }

    #[test]
    fn moe_top_k_and_config_errors_cpu() {
        assert_eq!(top_k(&[0.1, 0.5, 0.5, -1.0, 0.7], 3), [4, 1, 2]);
        assert!(MoeConfig::new(0, 1).validate(8).is_err());
        assert!(MoeConfig::new(4, 5).validate(8).is_err());
        assert!(MoeConfig::new(9, 1).validate(8).is_err());
        MoeConfig::new(8, 8).validate(8).unwrap();
    }

    /// E = 1, and k = E, evaluate every neuron: the dense FFN up to summation order. Fewer
    /// experts evaluate exactly their neurons.
    #[test]
    fn moe_all_experts_equal_dense_ffn_cpu() {
        let lw = planted_layer(9, 192, 64, 6);
        let mut rng = Rng::new(10);
        let x: Vec<f32> = (0..64).map(|_| rng.normal() as f32).collect();
        let dense = dense_ffn(&lw, &x);
        let scale = dense.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (e, k) in [(1, 1), (6, 6), (5, 5)] {
            let m = MoeLayer::from_layer(&lw, &MoeConfig::new(e, k), 0).unwrap();
            let mut y = vec![f32::NAN; 64];
            m.forward(&lw, &x, &(0..k).collect::<Vec<_>>(), &vec![1.0; k], &mut y);
            for (a, b) in y.iter().zip(&dense) {
                assert!((a - b).abs() <= 1e-5 * scale, "E={e} k={k}: {a} vs {b}");
            }
        }
        // Two of six experts: the dense FFN with the other neurons' activations zeroed.
        let m = MoeLayer::from_layer(&lw, &MoeConfig::new(6, 2), 0).unwrap();
        let mut y = vec![f32::NAN; 64];
        m.forward(&lw, &x, &[4, 1], &[1.0, 1.0], &mut y);
        let mut masked = lw.clone();
        for n in 0..192 {
            if ![1, 4].contains(&m.expert_from_neuron[n]) {
                masked.up.f32[n * 64..(n + 1) * 64].fill(0.0);
            }
        }
        for (a, b) in y.iter().zip(dense_ffn(&masked, &x)) {
            assert!((a - b).abs() <= 1e-5 * scale, "{a} vs {b}");
        }
    }

    /// One calibration run serves several (E, k): fitting from a shared collection equals
    /// fitting from a fresh one, bit for bit; a calibration of another shape (layers or
    /// features), a MoE model, no tokens or a negative ridge are refused.
    #[test]
    fn moe_calibration_is_collected_once_and_checked_cpu() {
        let w = synthetic_weights(&crate::SyntheticModel::dense(5));
        let dense = CpuModel::new(w.clone()).unwrap();
        let ids: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % 64).collect();
        let shared = dense.calibration(&ids).unwrap();
        assert_eq!(shared.tokens(), ids.len());
        for (e, k) in [(6, 2), (4, 3)] {
            let mut a = Moefication::from_weights(&w, &MoeConfig::new(e, k)).unwrap();
            let mut b = a.clone();
            a.fit_router(&w, &shared, DEFAULT_RIDGE).unwrap();
            b.fit_router(&w, &dense.calibration(&ids).unwrap(), DEFAULT_RIDGE).unwrap();
            assert_eq!(a.fitted, Some(ids.len()));
            for (la, lb) in a.layers.iter().zip(&b.layers) {
                assert_eq!(la.centroids, lb.centroids, "E={e} k={k}");
            }
            let fresh = Moefication::from_weights(&w, &MoeConfig::new(e, k)).unwrap();
            assert_ne!(a.layers[0].centroids, fresh.layers[0].centroids, "E={e} k={k}: the routers changed");
        }
        let mut m = Moefication::from_weights(&w, &MoeConfig::new(6, 2)).unwrap();
        assert!(m.fit_router(&w, &shared, -1.0).is_err(), "negative ridge");
        assert!(m.fit_router(&w, &shared, f64::NAN).is_err(), "NaN ridge");
        let other = synthetic_weights(&crate::SyntheticModel { layers: 3, ..crate::SyntheticModel::dense(5) });
        let other_calib = CpuModel::new(other).unwrap().calibration(&ids).unwrap();
        assert!(m.fit_router(&w, &other_calib, DEFAULT_RIDGE).is_err(), "a calibration of another shape");
        assert!(dense.calibration(&[]).is_err(), "no tokens");
        let moe_file = CpuModel::new(synthetic_weights(&crate::SyntheticModel::moe(5, 4, 2))).unwrap();
        assert!(moe_file.calibration(&ids).is_err(), "a MoE model");
    }

    fn synthetic_weights(m: &crate::SyntheticModel) -> Arc<LlamaWeights> {
        let file = m.gguf();
        let g = crate::gguf::Gguf::parse(&file).unwrap();
        let c = crate::config::LlamaConfig::from_gguf(&g).unwrap();
        Arc::new(LlamaWeights::from_gguf(&g, &c).unwrap())
    }

    /// The weights of the chosen experts are Mixtral's gating: a softmax over all E logits, the
    /// top k kept and renormalised (computed here that way, in f64).
    #[test]
    fn moe_softmax_weights_are_mixtral_gating_cpu() {
        for seed in 0..50u64 {
            let mut rng = Rng::new(seed);
            let e = 1 + rng.below(16) as usize;
            let k = 1 + rng.below(e as u32) as usize;
            let scores: Vec<f32> = (0..e).map(|_| (rng.normal() * 4.0) as f32).collect();
            let chosen = top_k(&scores, k);
            let all: Vec<f64> = scores.iter().map(|&s| f64::from(s).exp()).collect();
            let total: f64 = all.iter().sum();
            let kept: f64 = chosen.iter().map(|&c| all[c] / total).sum();
            let got = softmax_weights(&scores, &chosen);
            for (j, &c) in chosen.iter().enumerate() {
                let want = all[c] / total / kept;
                assert!((f64::from(got[j]) - want).abs() < 1e-6, "seed {seed}: E={e} k={k} weight {j}: {} vs {want}", got[j]);
            }
        }
    }

    /// A MoE file's layer: the FFN the CPU model computes (its probe) against the experts and
    /// router read straight from the file's stacked tensors, in f64: gated as Mixtral is (llama:
    /// the top k's softmax renormalised), as OLMoE is (their shares of the whole softmax), and
    /// as Qwen2-MoE is (OLMoE's gating plus the shared expert scaled by its sigmoid gate).
    #[test]
    fn moe_file_experts_and_router_cpu() {
        use crate::config::Arch;
        for arch in [Arch::Llama, Arch::Olmoe, Arch::Qwen2Moe] {
            let spec = crate::SyntheticModel { arch, ..crate::SyntheticModel::moe(7, 4, 2) };
            let file = spec.gguf();
            let g = crate::gguf::Gguf::parse(&file).unwrap();
            let model = CpuModel::new(synthetic_weights(&spec)).unwrap();
            let moe = model.moe().expect("a MoE file runs its own experts");
            assert!(moe.is_native() && moe.config.experts == 4 && moe.config.top_k == 2);
            let (h, f, e, fs) = (128usize, 96usize, 4usize, spec.shared_ffn() as usize);
            let tensor = |name: &str| g.tensor_f32(name).unwrap();
            let mut cache = model.new_cache();
            for (pos, token) in [17u32, 200, 3].into_iter().enumerate() {
                let (mut xn, mut ffn) = (Vec::new(), Vec::new());
                let mut probe = |p: crate::Probe<'_>| {
                    if p.layer == 1 && p.stage == crate::Stage::FfnNorm {
                        xn = p.values.to_vec();
                    }
                    if p.layer == 1 && p.stage == crate::Stage::Ffn {
                        ffn = p.values.to_vec();
                    }
                };
                model.forward_probed(token, pos as u32, &mut cache, 2, true, &mut probe).unwrap();
                let (router, gate, up, down) = (
                    tensor("blk.1.ffn_gate_inp.weight"),
                    tensor("blk.1.ffn_gate_exps.weight"),
                    tensor("blk.1.ffn_up_exps.weight"),
                    tensor("blk.1.ffn_down_exps.weight"),
                );
                let dot = |m: &[f32], row: usize| -> f64 { (0..h).map(|i| f64::from(m[row * h + i]) * f64::from(xn[i])).sum() };
                let silu = |v: f64| v / (1.0 + (-v).exp());
                let logits: Vec<f64> = (0..e).map(|x| dot(&router, x)).collect();
                let mut order: Vec<usize> = (0..e).collect();
                order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
                let total: f64 = logits.iter().map(|l| l.exp()).sum();
                let kept: f64 = order[..2].iter().map(|&x| logits[x].exp() / total).sum();
                let mut want = vec![0f64; h];
                let mut scale = vec![0f64; h];
                for &x in &order[..2] {
                    let wt = logits[x].exp() / total / if arch == Arch::Llama { kept } else { 1.0 };
                    for n in 0..f {
                        let a = silu(dot(&gate, x * f + n)) * dot(&up, x * f + n) * wt;
                        for o in 0..h {
                            let d = f64::from(down[(x * h + o) * f + n]);
                            want[o] += a * d;
                            scale[o] += (a * d).abs();
                        }
                    }
                }
                if arch == Arch::Qwen2Moe {
                    let (sg, sgate, sup, sdown) = (
                        tensor("blk.1.ffn_gate_inp_shexp.weight"),
                        tensor("blk.1.ffn_gate_shexp.weight"),
                        tensor("blk.1.ffn_up_shexp.weight"),
                        tensor("blk.1.ffn_down_shexp.weight"),
                    );
                    let wt = 1.0 / (1.0 + (-dot(&sg, 0)).exp());
                    assert!(wt > 0.01 && wt < 0.99, "{arch:?}: the shared gate {wt} should be neither shut nor open");
                    for n in 0..fs {
                        let a = silu(dot(&sgate, n)) * dot(&sup, n) * wt;
                        for o in 0..h {
                            let d = f64::from(sdown[o * fs + n]);
                            want[o] += a * d;
                            scale[o] += (a * d).abs();
                        }
                    }
                }
                for o in 0..h {
                    assert!(
                        (f64::from(ffn[o]) - want[o]).abs() <= 1e-5 * scale[o] + 1e-6,
                        "{arch:?} token {pos}: output {o}: {} vs {}",
                        ffn[o],
                        want[o]
                    );
                }
            }
        }
        let spec = crate::SyntheticModel::moe(7, 4, 2);
        let w = synthetic_weights(&spec);
        let model = CpuModel::new(w.clone()).unwrap();
        let moe = model.moe().unwrap();
        // MoEfication is for dense FFNs; a MoE file has no dense FFN to fall back to.
        let e = Moefication::from_weights(&w, &MoeConfig::new(8, 2)).unwrap_err().to_string();
        assert!(e.contains("Mixture-of-Experts"), "{e}");
        assert!(model.with_moe(None).unwrap_err().to_string().contains("no dense FFN"));
        let dense = synthetic_weights(&crate::SyntheticModel::dense(7));
        assert!(Moefication::native(&dense).is_err());
        assert!(CpuModel::new(dense).unwrap().with_moe(Some(moe.clone())).is_err(), "a file's own experts fit that file only");
    }

    /// Experts that are all copies of one FFN, weighted by a softmax (weights summing to 1), are
    /// that FFN: a MoE file of copies gives a dense file's logits, whatever the router chooses.
    #[test]
    fn moe_file_of_identical_experts_equals_dense_cpu() {
        let dense = CpuModel::new(synthetic_weights(&crate::SyntheticModel::dense(11))).unwrap();
        let spec = crate::SyntheticModel { identical_experts: true, ..crate::SyntheticModel::moe(11, 4, 2) };
        let moe = CpuModel::new(synthetic_weights(&spec)).unwrap();
        let (mut cd, mut cm) = (dense.new_cache(), moe.new_cache());
        for (pos, token) in [5u32, 99, 250, 42, 42].into_iter().enumerate() {
            let a = dense.forward(token, pos as u32, &mut cd).unwrap();
            let b = moe.forward(token, pos as u32, &mut cm).unwrap();
            let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(scale > 0.1 && worst <= 1e-5 * scale, "token {pos}: {worst} vs scale {scale}");
        }
    }

    /// On the real model, E = 1 gives the dense logits (within 1e-4 of their largest magnitude).
    #[test]
    fn moe_smollm2_e1_equals_dense_real() {
        let Some((dense, tok)) = test_model("moe_smollm2_e1_equals_dense_real") else { return };
        let moe = Arc::new(Moefication::from_weights(dense.weights(), &MoeConfig::new(1, 1)).unwrap());
        let model = dense.with_moe(Some(moe)).unwrap();
        let ids = prompt_ids(&tok, PROMPT);
        let (a, b) = (dense.prefill(&ids, &mut dense.new_cache()).unwrap(), model.prefill(&ids, &mut model.new_cache()).unwrap());
        let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        eprintln!("E=1 vs dense: largest logit difference {worst:e} (largest logit magnitude {scale})");
        assert!(worst <= 1e-4 * scale, "{worst} vs scale {scale}");
        assert_eq!(super::argmax(&a), super::argmax(&b));
    }

    /// The centroid router and the fitted one against the best choice of the same experts (their
    /// actual activation mass, [`CpuModel::with_oracle_routing`]): where MoEfication's quality
    /// goes, the router or the sparsity. The oracle must beat both and the fitted router the
    /// centroids; all are printed.
    #[test]
    fn moe_smollm2_router_against_oracle_real() {
        let Some((dense, tok)) = test_model("moe_smollm2_router_against_oracle_real") else { return };
        let text_ids = prompt_ids(&tok, PERPLEXITY_TEXT);
        let mut report = vec![format!("dense: perplexity {:.2}", dense.perplexity(&text_ids).unwrap())];
        // The calibration text's first 160 tokens (the CPU run over all 327 took half the test's
        // time; `expertkv eval --moe E:K:fitted` fits on all of them).
        let mut calib_ids = prompt_ids(&tok, CALIBRATION_TEXT);
        calib_ids.truncate(160);
        let calib = dense.calibration(&calib_ids).unwrap();
        // Two shapes, a quarter of the experts each (the test suite's time; `expertkv eval
        // --moe` measures any others).
        for (e, k) in [(8, 2), (16, 4)] {
            let clustered = Moefication::from_weights(dense.weights(), &MoeConfig::new(e, k)).unwrap();
            let routed = dense.with_moe(Some(Arc::new(clustered.clone()))).unwrap();
            let oracle = routed.clone().with_oracle_routing(true).unwrap();
            let (r, o) = (routed.perplexity(&text_ids).unwrap(), oracle.perplexity(&text_ids).unwrap());
            let mut fitted = clustered;
            let secs = fitted.fit_router(dense.weights(), &calib, DEFAULT_RIDGE).unwrap();
            assert_eq!(fitted.fitted, Some(calib.tokens()));
            let f = dense.with_moe(Some(Arc::new(fitted))).unwrap().perplexity(&text_ids).unwrap();
            report.push(format!(
                "E={e} k={k}: centroid router {r:.2}, fitted router {f:.2} ({} tokens, {secs:.1} s), oracle {o:.2}",
                calib.tokens()
            ));
            assert!(o < r && o < f, "E={e} k={k}: the oracle ({o}) chooses worse than a router ({r}, fitted {f})");
            assert!(f < r, "E={e} k={k}: the fitted router ({f}) is no better than the centroids ({r})");
        }
        assert!(dense.clone().with_oracle_routing(true).is_err(), "no experts to choose");
        eprintln!("{} tokens of PERPLEXITY_TEXT\n{}", text_ids.len(), report.join("\n"));
    }

    /// E = 8 / k = 2: finite logits; prints the top token, greedy text and perplexity (over the
    /// text's first 96 tokens) beside the dense model's (E = 16 / k = 4 runs in
    /// `moe_smollm2_router_against_oracle_real`).
    #[test]
    fn moe_smollm2_e8_e16_real() {
        let Some((dense, tok)) = test_model("moe_smollm2_e8_e16_real") else { return };
        let ids = prompt_ids(&tok, PROMPT);
        let mut text_ids = prompt_ids(&tok, PERPLEXITY_TEXT);
        text_ids.truncate(96);
        let mut report = Vec::new();
        for (e, k) in [(0, 0), (8, 2)] {
            let (model, cluster_s) = if e == 0 {
                (dense.clone(), 0.0)
            } else {
                let t = Instant::now();
                let moe = Moefication::from_weights(dense.weights(), &MoeConfig::new(e, k)).unwrap();
                let s = t.elapsed().as_secs_f64();
                assert_eq!(moe.fraction_evaluated(), k as f64 / e as f64);
                (dense.with_moe(Some(Arc::new(moe))).unwrap(), s)
            };
            let logits = model.prefill(&ids, &mut model.new_cache()).unwrap();
            assert!(logits.iter().all(|v| v.is_finite()), "E={e} k={k}");
            let top = super::argmax(&logits);
            let greedy = model.generate_greedy(&ids, 4).unwrap();
            let ppl = model.perplexity(&text_ids).unwrap();
            let label = if e == 0 { "dense".to_string() } else { format!("E={e} k={k}") };
            report.push(format!(
                "{label:>9}: top token {top} {:?}, greedy {:?}, perplexity {ppl:.2}, clustering {cluster_s:.2} s",
                tok.decode(&[top]).unwrap(),
                tok.decode(&greedy).unwrap()
            ));
            assert!(ppl.is_finite() && ppl > 1.0);
        }
        eprintln!("{PROMPT:?}\n{}", report.join("\n"));
    }
}
