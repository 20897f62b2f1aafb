//! The CPU f32 reference of a Llama-family forward pass, one token at a time, with its own
//! f32 KV cache: what the WGSL forward pass is checked against, stage by stage ([`Probe`]) and
//! layer by layer ([`CpuModel::forward_layers`]).
//!
//! One layer, as llama.cpp computes it for `LLM_ARCH_LLAMA`:
//! `xn = rmsnorm(x) * attn_norm`; `q, k, v = Wq xn, Wk xn, Wv xn`; RoPE on `q` and `k`
//! ([`rope_norm`]); `k, v` appended to the cache; grouped-query causal attention over every cached
//! position with scale `1/sqrt(head_dim)` (query head `h` reads KV head `h / (heads / kv_heads)`);
//! `x += Wo attn`; `xn = rmsnorm(x) * ffn_norm`; `x += Wdown (silu(Wgate xn) * Wup xn)` (or the
//! MoEfied FFN or a MoE file's own experts, [`super::moe`]). Then `logits = lm_head(rmsnorm(x) * output_norm)`.
//! `qwen2` adds biases to `q, k, v`; `qwen3` RMS-norms each head of `q` and `k` with its own
//! gain (`attn_q_norm`, `attn_k_norm`); both rotate pairs half a head apart
//! ([`crate::math::rope_neox`], llama.cpp's NeoX RoPE).
//!
//! Matrix-vector products walk the rows of the row-major `[out][in]` weights (contiguous dot
//! products with eight partial sums, which the compiler vectorises); the large ones are split
//! over threads by rows on native targets (never on wasm, which has no threads).

use std::sync::Arc;

use crate::config::LlamaConfig;
pub use crate::math::{argmax, axpy, dot, matvec, nll, rms_norm, rope_norm, silu};
use crate::moe::{Calibration, Moefication};
use crate::weights::LlamaWeights;
use crate::{Error, Result};

fn input_err(what: impl Into<String>) -> Error {
    Error::Input(what.into())
}

/// One layer's cached keys and values, each `[pos][kv_head][head_dim]` (keys after RoPE).
#[derive(Clone, Debug, Default)]
pub struct LayerKv {
    /// Keys after RoPE, `[pos][kv_head][head_dim]` flattened: `kv_heads * head_dim` floats per
    /// cached position.
    pub k: Vec<f32>,
    /// Values (`Wv xn`, no RoPE), laid out as `k`: `[pos][kv_head][head_dim]`.
    pub v: Vec<f32>,
}

/// The f32 KV cache of the CPU reference. Every forward step appends one position to the layers
/// it runs; attention reads every position cached in its layer.
#[derive(Clone, Debug)]
pub struct KvCache {
    layers: Vec<LayerKv>,
    /// `kv_heads * head_dim`: floats per position per layer in `k` (and in `v`).
    kv_dim: usize,
    /// Whether K/V are rounded to f16 as they are cached (as a pool of f16 pages stores them).
    f16: bool,
}

impl KvCache {
    /// An empty cache for `config`: one [`LayerKv`] per layer, `head_count_kv * head_dim` floats
    /// per position.
    pub fn new(config: &LlamaConfig) -> Self {
        KvCache {
            layers: vec![LayerKv::default(); config.block_count as usize],
            kv_dim: (config.head_count_kv * config.head_dim) as usize,
            f16: false,
        }
    }

    /// The same cache storing K/V rounded to f16 (to nearest, as the GPU's f16 pages hold them),
    /// so a reference of an f16 pool differs from the GPU by f32 arithmetic only.
    pub fn rounding_to_f16(self) -> Self {
        KvCache { f16: true, ..self }
    }

    /// Positions cached in layer 0 (every layer, after full forward steps).
    pub fn len(&self) -> usize {
        self.layer_len(0)
    }

    /// Whether layer 0 holds no position (see [`KvCache::len`]).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Positions cached in layer `l` (0 for layers past the model's).
    pub fn layer_len(&self, l: usize) -> usize {
        self.layers.get(l).map_or(0, |kv| kv.k.len() / self.kv_dim)
    }

    /// Floats per position per layer: `kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// Layer `l`'s keys and values (panics when `l` is not a layer of the model).
    pub fn layer(&self, l: usize) -> &LayerKv {
        &self.layers[l]
    }

    /// Layer `l`'s keys and values to rewrite in place (a test applying a page codec's round
    /// trip, say; panics when `l` is not a layer of the model).
    pub fn layer_mut(&mut self, l: usize) -> &mut LayerKv {
        &mut self.layers[l]
    }

    /// Keeps the first `n` positions of every layer (a rewind).
    pub fn truncate(&mut self, n: usize) {
        let d = self.kv_dim;
        for kv in &mut self.layers {
            kv.k.truncate(n * d);
            kv.v.truncate(n * d);
        }
    }

    /// Drops every cached position of every layer; the layers and `kv_dim` stay.
    pub fn clear(&mut self) {
        self.truncate(0);
    }
}

/// Where in the forward pass a [`Probe`] looks. Vectors are per token; `Q`/`K` are
/// `[heads][head_dim]` / `[kv_heads][head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// The token's embedding row (layer 0).
    Embedding,
    /// `rmsnorm(x) * attn_norm`.
    AttnNorm,
    /// `Wq xn`, before RoPE.
    QProj,
    /// `Wk xn`, before RoPE.
    KProj,
    /// `q` after RoPE.
    Q,
    /// `k` after RoPE (as cached).
    K,
    /// `Wv xn` (as cached).
    V,
    /// The heads' attention outputs, concatenated, before `Wo`.
    Attention,
    /// The residual stream after the attention block.
    AttnResidual,
    /// `rmsnorm(x) * ffn_norm`.
    FfnNorm,
    /// MoE only: the router's score of each expert.
    RouterScores,
    /// The FFN's output, before the residual add.
    Ffn,
    /// The residual stream after the layer (its output).
    Output,
    /// `rmsnorm(x) * output_norm` (layer = the number of layers).
    FinalNorm,
    /// The logits (layer = the number of layers).
    Logits,
}

/// One intermediate vector of a forward step.
#[derive(Clone, Copy, Debug)]
pub struct Probe<'a> {
    /// The layer, from 0; [`Stage::Embedding`] reports 0, [`Stage::FinalNorm`] and
    /// [`Stage::Logits`] the number of layers.
    pub layer: usize,
    /// Where in the step `values` was taken.
    pub stage: Stage,
    /// The vector, borrowed for the probe call only: `[hidden]` for the residual stream and the
    /// norms, `[heads * head_dim]` for `QProj`, `Q` and `Attention`, `[kv_heads * head_dim]` for
    /// `KProj`, `K` and `V`, `[E]` for the router scores, `[vocab]` for the logits.
    pub values: &'a [f32],
}

/// The CPU reference model: shared weights, optionally MoEfied FFNs.
#[derive(Clone, Debug)]
pub struct CpuModel {
    weights: Arc<LlamaWeights>,
    moe: Option<Arc<Moefication>>,
    threads: usize,
    /// MoEfied: choose the experts by their actual activation mass ([`CpuModel::with_oracle_routing`]).
    oracle_routing: bool,
}

/// Scratch vectors of one forward step.
struct Scratch {
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    scores: Vec<f32>,
}

impl CpuModel {
    /// The model over weights loaded with f32 ([`super::weights::LoadOptions::f32`]): dense, or
    /// for a MoE file its own experts and routers ([`Moefication::native`]).
    pub fn new(weights: Arc<LlamaWeights>) -> Result<Self> {
        if !weights.has_f32() {
            return Err(input_err("the CPU model needs f32 weights; load them with LoadOptions { f32: true, .. }"));
        }
        #[cfg(not(target_arch = "wasm32"))]
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
        #[cfg(target_arch = "wasm32")]
        let threads = 1;
        let moe = if weights.is_moe() { Some(Arc::new(Moefication::native(&weights)?)) } else { None };
        Ok(CpuModel { weights, moe, threads, oracle_routing: false })
    }

    /// This model with its FFNs replaced by `moe` (`None`: dense), sharing the weights. A MoE
    /// file keeps its own experts: it takes only those ([`Moefication::native`]).
    pub fn with_moe(&self, moe: Option<Arc<Moefication>>) -> Result<Self> {
        match &moe {
            Some(m) => m.check_fits(&self.weights)?,
            None if self.weights.is_moe() => {
                return Err(input_err("a MoE file has no dense FFN to fall back to; it keeps its own experts"));
            }
            None => {}
        }
        Ok(CpuModel { moe, ..self.clone() })
    }

    /// MoEfied: choose each token's top-k experts by their actual activation mass,
    /// `sum_{n in e} |silu(Wgate[n] x) (Wup[n] x)|`, instead of the router's scores. It computes
    /// the whole dense FFN to choose, so it saves nothing: a diagnostic, the bound any router of
    /// these experts could reach (CPU only). A MoE file's own experts are not MoEfied: refused.
    pub fn with_oracle_routing(mut self, on: bool) -> Result<Self> {
        if on && self.moe.as_ref().is_none_or(|m| m.is_native()) {
            return Err(input_err("oracle routing chooses among MoEfied experts: MoEfy the dense model first (with_moe)"));
        }
        self.oracle_routing = on;
        Ok(self)
    }

    /// This model splitting large products over `threads` threads (1: none).
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads.max(1);
        self
    }

    /// The model's hyper-parameters (those of its weights).
    pub fn config(&self) -> &LlamaConfig {
        &self.weights.config
    }

    /// The weights, shared (one `Arc`) with every model made from this one by
    /// [`CpuModel::with_moe`].
    pub fn weights(&self) -> &Arc<LlamaWeights> {
        &self.weights
    }

    /// Run this dense model (one without experts) over `ids` and keep every layer's FFN inputs:
    /// the calibration MoEfication fits its routers to ([`crate::Moefication::fit_router`]).
    pub fn calibration(&self, ids: &[u32]) -> Result<Calibration> {
        if self.moe().is_some() || ids.is_empty() {
            return Err(Error::Input("calibration: a dense model and some tokens".into()));
        }
        let n_layers = self.weights().layers.len();
        let mut xs: Vec<Vec<f32>> = vec![Vec::new(); n_layers];
        let mut cache = self.new_cache();
        for (pos, &t) in ids.iter().enumerate() {
            self.forward_probed(t, pos as u32, &mut cache, n_layers, false, &mut |p| {
                if p.stage == Stage::FfnNorm {
                    xs[p.layer].extend_from_slice(p.values);
                }
            })?;
        }
        Ok(Calibration::from_layers(xs, ids.len()))
    }

    /// The experts in place of the dense FFN (a MoEfication, or a MoE file's own,
    /// [`Moefication::native`]); `None` when the FFN is dense.
    pub fn moe(&self) -> Option<&Arc<Moefication>> {
        self.moe.as_ref()
    }

    /// An empty [`KvCache`] shaped for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.config())
    }

    /// One decode step: embeds `token`, runs every layer with RoPE at `position`, appends its K/V
    /// to `cache` and returns the logits (`[vocab]`). `position` is only RoPE's: the step attends
    /// to everything already cached, so the caller keeps positions and cache consistent (normally
    /// `position == cache.len()`).
    pub fn forward(&self, token: u32, position: u32, cache: &mut KvCache) -> Result<Vec<f32>> {
        self.forward_probed(token, position, cache, self.weights.layers.len(), true, &mut |_| {})
    }

    /// The residual stream after the first `n_layers` layers (no final norm), appending K/V to
    /// those layers of `cache` only: for checking a partial GPU forward pass.
    pub fn forward_layers(&self, token: u32, position: u32, cache: &mut KvCache, n_layers: usize) -> Result<Vec<f32>> {
        self.forward_probed(token, position, cache, n_layers, false, &mut |_| {})
    }

    /// [`CpuModel::forward`] or [`CpuModel::forward_layers`] (`logits` false), calling `probe`
    /// with every intermediate vector (see [`Stage`]) in computation order.
    pub fn forward_probed(
        &self,
        token: u32,
        position: u32,
        cache: &mut KvCache,
        n_layers: usize,
        logits: bool,
        probe: &mut dyn FnMut(Probe<'_>),
    ) -> Result<Vec<f32>> {
        let w = &*self.weights;
        let c = &w.config;
        let (h, hd) = (c.embedding_length as usize, c.head_dim as usize);
        let (heads, kv_heads) = (c.head_count as usize, c.head_count_kv as usize);
        let group = heads / kv_heads;
        let kv_dim = kv_heads * hd;
        if token >= c.vocab_size {
            return Err(input_err(format!("token {token} is outside the vocabulary of {}", c.vocab_size)));
        }
        if n_layers > w.layers.len() || (logits && n_layers != w.layers.len()) {
            return Err(input_err(format!("{n_layers} layers asked of a model of {} (logits need all)", w.layers.len())));
        }
        if cache.layers.len() != w.layers.len() || cache.kv_dim != kv_dim {
            return Err(input_err(format!(
                "the KV cache has {} layers of {} floats per position; the model needs {} of {kv_dim}",
                cache.layers.len(),
                cache.kv_dim,
                w.layers.len()
            )));
        }
        let mut x = w.token_embd.row(token as usize).to_vec();
        probe(Probe { layer: 0, stage: Stage::Embedding, values: &x });
        let n_experts = self.moe.as_ref().map_or(0, |m| m.config.experts);
        let mut s = Scratch {
            xn: vec![0.0; h],
            q: vec![0.0; heads * hd],
            k: vec![0.0; kv_dim],
            v: vec![0.0; kv_dim],
            att: vec![0.0; heads * hd],
            proj: vec![0.0; h],
            gate: vec![0.0; c.feed_forward_length as usize],
            up: vec![0.0; c.feed_forward_length as usize],
            scores: vec![0.0; n_experts],
        };
        let scale = 1.0 / (hd as f32).sqrt();
        let rope_dims = c.rope_dimension_count as usize;
        for (l, lw) in w.layers.iter().enumerate().take(n_layers) {
            let p = |stage, values: &[f32], probe: &mut dyn FnMut(Probe<'_>)| probe(Probe { layer: l, stage, values });
            rms_norm(&x, &lw.attn_norm, c.rms_norm_eps, &mut s.xn);
            p(Stage::AttnNorm, &s.xn, probe);
            matvec(&lw.wq, &s.xn, &mut s.q, self.threads);
            matvec(&lw.wk, &s.xn, &mut s.k, self.threads);
            matvec(&lw.wv, &s.xn, &mut s.v, self.threads);
            if let Some([bq, bk, bv]) = &lw.qkv_bias {
                for (x, b) in [(&mut s.q, bq), (&mut s.k, bk), (&mut s.v, bv)] {
                    x.iter_mut().zip(b).for_each(|(x, b)| *x += b);
                }
            }
            if let Some([gq, gk]) = &lw.qk_norm {
                // Each head on its own (qwen3), or the whole projection at once (olmoe).
                for (x, g) in [(&mut s.q, gq), (&mut s.k, gk)] {
                    let span = g.len();
                    let mut out = vec![0.0; span];
                    for part in x.chunks_exact_mut(span) {
                        rms_norm(part, g, c.rms_norm_eps, &mut out);
                        part.copy_from_slice(&out);
                    }
                }
            }
            p(Stage::QProj, &s.q, probe);
            p(Stage::KProj, &s.k, probe);
            let rope = if c.arch.rope_neox() { crate::math::rope_neox } else { rope_norm };
            rope(&mut s.q, hd, rope_dims, position, c.rope_freq_base);
            rope(&mut s.k, hd, rope_dims, position, c.rope_freq_base);
            p(Stage::Q, &s.q, probe);
            p(Stage::K, &s.k, probe);
            p(Stage::V, &s.v, probe);
            let f16 = cache.f16;
            let kv = &mut cache.layers[l];
            if f16 {
                let round = |x: &f32| half::f16::from_f32(*x).to_f32();
                kv.k.extend(s.k.iter().map(round));
                kv.v.extend(s.v.iter().map(round));
            } else {
                kv.k.extend_from_slice(&s.k);
                kv.v.extend_from_slice(&s.v);
            }
            let n_pos = kv.k.len() / kv_dim;
            let mut weights = vec![0f32; n_pos];
            for head in 0..heads {
                let qh = &s.q[head * hd..(head + 1) * hd];
                let kvh = head / group;
                for (t, wt) in weights.iter_mut().enumerate() {
                    let o = t * kv_dim + kvh * hd;
                    *wt = dot(qh, &kv.k[o..o + hd]) * scale;
                }
                let max = weights.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let mut sum = 0f32;
                for wt in &mut weights {
                    *wt = (*wt - max).exp();
                    sum += *wt;
                }
                let out = &mut s.att[head * hd..(head + 1) * hd];
                out.fill(0.0);
                for (t, &wt) in weights.iter().enumerate() {
                    let o = t * kv_dim + kvh * hd;
                    axpy(out, wt / sum, &kv.v[o..o + hd]);
                }
            }
            p(Stage::Attention, &s.att, probe);
            matvec(&lw.wo, &s.att, &mut s.proj, self.threads);
            for (x, y) in x.iter_mut().zip(&s.proj) {
                *x += y;
            }
            p(Stage::AttnResidual, &x, probe);
            rms_norm(&x, &lw.ffn_norm, c.rms_norm_eps, &mut s.xn);
            p(Stage::FfnNorm, &s.xn, probe);
            match &self.moe {
                None => {
                    matvec(&lw.gate, &s.xn, &mut s.gate, self.threads);
                    matvec(&lw.up, &s.xn, &mut s.up, self.threads);
                    for (g, u) in s.gate.iter_mut().zip(&s.up) {
                        *g = silu(*g) * u;
                    }
                    matvec(&lw.down, &s.gate, &mut s.proj, self.threads);
                }
                Some(moe) => {
                    let ml = &moe.layers[l];
                    s.scores.resize(ml.experts(), 0.0);
                    ml.scores(&s.xn, &mut s.scores);
                    if self.oracle_routing {
                        // The experts' actual activation mass, from the whole dense FFN.
                        matvec(&lw.gate, &s.xn, &mut s.gate, self.threads);
                        matvec(&lw.up, &s.xn, &mut s.up, self.threads);
                        for (e, sc) in s.scores.iter_mut().enumerate() {
                            *sc = ml.expert(e).iter().map(|&n| (silu(s.gate[n as usize]) * s.up[n as usize]).abs()).sum();
                        }
                    }
                    p(Stage::RouterScores, &s.scores, probe);
                    let chosen = super::moe::top_k(&s.scores, moe.config.top_k);
                    ml.forward(lw, &s.xn, &chosen, &ml.weights(&s.scores, &chosen), &mut s.proj);
                    if let Some(sh) = &lw.shared {
                        shared_expert(sh, &s.xn, &mut s.proj, self.threads);
                    }
                }
            }
            p(Stage::Ffn, &s.proj, probe);
            for (x, y) in x.iter_mut().zip(&s.proj) {
                *x += y;
            }
            p(Stage::Output, &x, probe);
        }
        if !logits {
            return Ok(x);
        }
        let top = w.layers.len();
        rms_norm(&x, &w.output_norm, c.rms_norm_eps, &mut s.xn);
        probe(Probe { layer: top, stage: Stage::FinalNorm, values: &s.xn });
        let mut out = vec![0f32; c.vocab_size as usize];
        matvec(w.lm_head(), &s.xn, &mut out, self.threads);
        probe(Probe { layer: top, stage: Stage::Logits, values: &out });
        Ok(out)
    }

    /// Runs `ids` at positions `cache.len()..` and returns the last token's logits.
    pub fn prefill(&self, ids: &[u32], cache: &mut KvCache) -> Result<Vec<f32>> {
        let Some((&last, rest)) = ids.split_last() else { return Err(input_err("prefill of an empty prompt")) };
        let start = cache.len();
        for (i, &t) in rest.iter().enumerate() {
            // The logits of all but the last token are not needed: skip the LM head.
            self.forward_layers(t, position(start + i)?, cache, self.weights.layers.len())?;
        }
        self.forward(last, position(start + rest.len())?, cache)
    }

    /// Greedy decoding: prefills `prompt` into a fresh cache, then appends the argmax token `n`
    /// times (ties: lowest id; no stop at end-of-sequence). Returns the `n` new tokens.
    pub fn generate_greedy(&self, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
        let mut cache = self.new_cache();
        let mut logits = self.prefill(prompt, &mut cache)?;
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let t = argmax(&logits);
            out.push(t);
            if i + 1 < n {
                logits = self.forward(t, position(cache.len())?, &mut cache)?;
            }
        }
        Ok(out)
    }

    /// The negative log-likelihood (nats) of each of `ids[1..]` given the tokens before it, from
    /// a fresh cache.
    pub fn token_nlls(&self, ids: &[u32]) -> Result<Vec<f64>> {
        if ids.len() < 2 {
            return Err(input_err(format!("a likelihood needs at least 2 tokens, got {}", ids.len())));
        }
        let mut cache = self.new_cache();
        let mut out = Vec::with_capacity(ids.len() - 1);
        for (i, pair) in ids.windows(2).enumerate() {
            let logits = self.forward(pair[0], position(i)?, &mut cache)?;
            out.push(nll(&logits, pair[1]));
        }
        Ok(out)
    }

    /// `exp(mean NLL)` of `ids[1..]` (the first token is context only).
    pub fn perplexity(&self, ids: &[u32]) -> Result<f64> {
        let nlls = self.token_nlls(ids)?;
        Ok((nlls.iter().sum::<f64>() / nlls.len() as f64).exp())
    }
}

/// `out += sigmoid(gate_inp . x) * down(silu(gate x) * up x)`: a shared expert's output
/// (`qwen2moe`), added to the routed experts'.
fn shared_expert(sh: &crate::weights::SharedExpert, x: &[f32], out: &mut [f32], threads: usize) {
    let mut g = vec![0f32; sh.gate.rows];
    let mut u = vec![0f32; sh.up.rows];
    matvec(&sh.gate, x, &mut g, threads);
    matvec(&sh.up, x, &mut u, threads);
    for (g, u) in g.iter_mut().zip(&u) {
        *g = silu(*g) * u;
    }
    let mut y = vec![0f32; sh.down.rows];
    matvec(&sh.down, &g, &mut y, threads);
    let scale = 1.0 / (1.0 + (-dot(&sh.gate_inp, x)).exp());
    for (o, y) in out.iter_mut().zip(&y) {
        *o += scale * y;
    }
}

fn position(i: usize) -> Result<u32> {
    u32::try_from(i).map_err(|_| input_err(format!("position {i} does not fit in u32")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::{PERPLEXITY_TEXT, PROMPT, prompt_ids, shuffle_words, test_model};
    use crate::weights::Matrix;
    use std::time::Instant;

    #[test]
    fn cpu_dot_and_helpers_cpu() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.25 - 3.0).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32 * 0.7).sin()).collect();
        let want: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
        assert!((f64::from(dot(&a, &b)) - want).abs() < 1e-4, "{} vs {want}", dot(&a, &b));
        assert_eq!(argmax(&[1.0, 3.0, 3.0, f32::NAN, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0]), 1);
        let logits = [1.0f32, 2.0, 3.0];
        let z: f64 = logits.iter().map(|&x| f64::from(x).exp()).sum();
        assert!((nll(&logits, 0) - (z.ln() - 1.0)).abs() < 1e-12);
        let mut out = [0f32; 4];
        rms_norm(&[1.0, -2.0, 3.0, -4.0], &[1.0, 1.0, 2.0, 0.5], 0.0, &mut out);
        let r = (30f32 / 4.0).sqrt();
        for (o, want) in out.iter().zip([1.0 / r, -2.0 / r, 6.0 / r, -2.0 / r]) {
            assert!((o - want).abs() < 1e-6, "{out:?}");
        }
    }

    /// The rotation of adjacent pairs, against the closed form; position 0 is the identity and
    /// dimensions past `rope_dims` pass through.
    #[test]
    fn cpu_rope_norm_rotates_adjacent_pairs_cpu() {
        let (hd, heads, base) = (8, 2, 100.0f32);
        let x: Vec<f32> = (0..hd * heads).map(|i| (i as f32 * 0.37).cos() + 0.1).collect();
        let mut y = x.clone();
        rope_norm(&mut y, hd, hd, 0, base);
        assert_eq!(x, y);
        let pos = 5u32;
        let mut y = x.clone();
        rope_norm(&mut y, hd, 6, pos, base);
        for h in 0..heads {
            for i in 0..hd / 2 {
                let (a, b) = (x[h * hd + 2 * i], x[h * hd + 2 * i + 1]);
                let (ya, yb) = (y[h * hd + 2 * i], y[h * hd + 2 * i + 1]);
                if 2 * i >= 6 {
                    assert_eq!((ya, yb), (a, b));
                    continue;
                }
                let th = pos as f32 * base.powf(-((2 * i) as f32) / 6.0);
                assert!((ya - (a * th.cos() - b * th.sin())).abs() < 1e-5 && (yb - (a * th.sin() + b * th.cos())).abs() < 1e-5);
                // A rotation keeps the pair's length.
                assert!(((ya * ya + yb * yb) - (a * a + b * b)).abs() < 1e-5);
            }
        }
    }

    /// Threads split rows only: the result is bitwise the single-threaded one.
    #[test]
    fn cpu_matvec_threads_agree_cpu() {
        let (rows, cols) = (1030, 520);
        let mut rng = expertkv_core::rng::Rng::new(11);
        let m = Matrix {
            name: "m".into(),
            rows,
            cols,
            f32: (0..rows * cols).map(|_| rng.normal() as f32).collect(),
            ggml_type: crate::gguf::GgmlType::F32,
            raw: Vec::new(),
        };
        let x: Vec<f32> = (0..cols).map(|_| rng.normal() as f32).collect();
        let (mut y1, mut y3) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
        matvec(&m, &x, &mut y1, 1);
        matvec(&m, &x, &mut y3, 3);
        assert_eq!(y1, y3);
        assert_eq!(y1[17], dot(m.row(17), &x));
    }

    /// Greedy decoding of the RECIPES.md prompt begins with " Paris".
    #[test]
    fn cpu_smollm2_greedy_paris_real() {
        let Some((model, tok)) = test_model("cpu_smollm2_greedy_paris_real") else { return };
        let ids = prompt_ids(&tok, PROMPT);
        assert!(!tok.add_bos(), "SmolLM2's GGUF does not ask for BOS");
        let t = Instant::now();
        let out = model.generate_greedy(&ids, 3).unwrap();
        let secs = t.elapsed().as_secs_f64();
        let text = tok.decode(&out).unwrap();
        eprintln!(
            "dense greedy: {PROMPT:?} {ids:?} -> {out:?} = {text:?} ({:.0} ms per token over {} tokens)",
            1e3 * secs / (ids.len() + 2) as f64,
            ids.len() + 2
        );
        assert_eq!(tok.decode(&out[..1]).unwrap(), " Paris", "{text:?}");
        assert!(text.starts_with(" Paris."), "{text:?}");
    }

    /// Layer-by-layer and stage-by-stage hooks agree with the full step; the cache holds what the
    /// probes saw.
    #[test]
    fn cpu_smollm2_forward_layers_and_probes_real() {
        let Some((model, tok)) = test_model("cpu_smollm2_forward_layers_and_probes_real") else { return };
        let ids = prompt_ids(&tok, PROMPT);
        let (mut full, mut part) = (model.new_cache(), model.new_cache());
        let mut outputs: Vec<Vec<f32>> = Vec::new();
        let mut ks: Vec<Vec<f32>> = Vec::new();
        let mut stages = 0;
        for (i, &t) in ids.iter().take(3).enumerate() {
            outputs.clear();
            ks.clear();
            let logits = model
                .forward_probed(t, i as u32, &mut full, 30, true, &mut |p| {
                    stages += 1;
                    match p.stage {
                        Stage::Output => outputs.push(p.values.to_vec()),
                        Stage::K => ks.push(p.values.to_vec()),
                        _ => {}
                    }
                })
                .unwrap();
            assert!(logits.iter().all(|v| v.is_finite()));
            let h = model.forward_layers(t, i as u32, &mut part, 2).unwrap();
            assert_eq!(h, outputs[1], "token {i}: two layers alone = the second layer's output");
        }
        assert_eq!(stages, 3 * (1 + 30 * 11 + 2));
        assert_eq!((full.len(), part.layer_len(1), part.layer_len(2)), (3, 3, 0));
        assert_eq!(&full.layer(29).k[2 * 192..], &ks[29][..]);
        assert_eq!(full.layer(1).k, part.layer(1).k);
    }

    /// The dense model's perplexity on an English sentence is low, and far below the same words
    /// shuffled.
    #[test]
    fn cpu_smollm2_perplexity_real() {
        let Some((model, tok)) = test_model("cpu_smollm2_perplexity_real") else { return };
        let ids = prompt_ids(&tok, PERPLEXITY_TEXT);
        let t = Instant::now();
        let ppl = model.perplexity(&ids).unwrap();
        let secs = t.elapsed().as_secs_f64();
        let shuffled = prompt_ids(&tok, &shuffle_words(PERPLEXITY_TEXT, 5));
        let ppl_shuffled = model.perplexity(&shuffled).unwrap();
        eprintln!(
            "dense perplexity: {ppl:.2} over {} tokens ({:.0} ms per token); shuffled words: {ppl_shuffled:.2} over {} tokens",
            ids.len() - 1,
            1e3 * secs / ids.len() as f64,
            shuffled.len() - 1
        );
        assert!(ppl < 100.0, "{ppl}");
        assert!(ppl_shuffled > 5.0 * ppl, "{ppl} vs shuffled {ppl_shuffled}");
    }
}
