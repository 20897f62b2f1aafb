//! A Llama-family (llama, qwen2, qwen3, qwen3moe, olmoe, qwen2moe) forward pass on the GPU whose K/V live in the expertkv pool: every
//! matrix product reads the GGUF's quantised weights in-kernel (`ops`), every token's keys and
//! values are appended to the paged pool and attention reads them back through the same
//! `attend_decode` kernels the pipeline uses. Prompts go in token by token (each a decode step,
//! so prefill and decode share one path).
//!
//! A step is one submission ([`GpuLlama::forward`]): nothing of a layer crosses to the host;
//! the host writes the token ids, positions and the append's records, and reads the logits (and,
//! MoEfied, the experts chosen). Sequences decode together (one token each per step, up to
//! [`MAX_SEQS`]).

use crate::experts::{ExpertCache, ExpertPolicy, ExpertPrefetch, ReuseCurve};
use crate::labels::{KvLabels, LabelSource, ScoreInputs};
use crate::moe::{Gating, Moefication};
use crate::ops::{GpuMatrix, ModelKernels, MoeFfn, Recorded, WeightFormat, same_format, tensor_format};
use crate::{Error, Result};
use crate::{config::LlamaConfig, gguf::Gguf};
use expertkv_core::append::format::NewToken;
use expertkv_core::config::KvDtype;
use expertkv_core::gpu_data::ExpertStats;
use expertkv_core::pipeline::{ReportParts, StepReport};
use expertkv_core::route::config::RouterConfig;
use expertkv_core::route::{RouteShape, Router};
use expertkv_core::runtime::Runtime;
use expertkv_core::runtime::dispatch::dispatches_encoded;
use expertkv_core::step::{self, Attend, Checks, KvSide, Recorder, Run, Segment};

mod options;
mod prefill;
mod prefix;
mod products;
mod reconfigure;
mod schedule;
mod timing;
pub mod trace;
use options::check_options;
pub use options::{ModelOptions, kept_per_list, pool_config};
use prefill::Prefill;
use products::Products;
use schedule::Pause;
pub use schedule::{Moved, Part, Stage, Transfer, TransferTotals};
pub use timing::StageTimer;

/// Slots per page of the model's K/V pool.
pub const MODEL_PAGE_SIZE: u32 = 16;

/// Positions per sequence the low-rank codecs' basis is fitted on (their calibration window):
/// every (layer, KV head)'s K and V subspace from the model's own first tokens.
pub const LOW_RANK_CALIBRATION_TOKENS: u32 = 64;

struct Layer {
    attn_norm: wgpu::Buffer,
    /// The Q, K and V projections: stacked `[Wq; Wk; Wv]` (one product, the attention norm
    /// folded in) when the file stores them in one format, else each on its own.
    qkv: Qkv,
    wo: GpuMatrix,
    ffn_norm: wgpu::Buffer,
    /// Q, K and V biases (`qwen2`), each repeated for every sequence of a step (added to the
    /// projections with the residual kernel).
    qkv_bias: Option<[wgpu::Buffer; 3]>,
    /// RMSNorm gains of queries and keys: per head (`qwen3`, `[head_dim]` each) or over the
    /// whole projection (`olmoe`, `[heads * head_dim]` and `[kv_heads * head_dim]`).
    qk_norm: Option<[wgpu::Buffer; 2]>,
    /// The shared expert (`qwen2moe`): its gate `[1][hidden]` f32, gate rows then up rows, and
    /// the down projection.
    shared: Option<[GpuMatrix; 3]>,
    /// The dense FFN: gate rows then up rows (one product gives SwiGLU's [gate; up] per token),
    /// and the down projection. `None` in a MoE file (its experts are [`GpuMoe`]'s).
    ffn: Option<(GpuMatrix, GpuMatrix)>,
}

/// A layer's Q, K and V projections as uploaded.
enum Qkv {
    /// `[Wq; Wk; Wv]` in one matrix.
    Stacked(GpuMatrix),
    /// Wq, Wk, Wv (their formats differ, as in K-quant mixes that keep V at higher precision).
    Separate([GpuMatrix; 3]),
}

/// Scratch buffers of one step (sized for `max_seqs` tokens).
struct Scratch {
    tokens: wgpu::Buffer,
    positions: wgpu::Buffer,
    h: wgpu::Buffer,
    xn: wgpu::Buffer,
    k: wgpu::Buffer,
    v: wgpu::Buffer,
    /// Queries and keys before their per-head RMSNorm (`qwen3`).
    q_raw: wgpu::Buffer,
    k_raw: wgpu::Buffer,
    /// K then V of each token in the pool's storage words (`ModelKernels::kv_pack`).
    kv_words: wgpu::Buffer,
    gu: wgpu::Buffer,
    act: wgpu::Buffer,
    /// The shared expert's gate logit per token (`qwen2moe`).
    shared_gate: wgpu::Buffer,
    logits: wgpu::Buffer,
}

impl Scratch {
    /// Neurons of the dense-FFN scratch: a MoE file's serves its shared expert only.
    fn ffn(cfg: &LlamaConfig) -> u32 {
        if cfg.expert_count == 0 { cfg.feed_forward_length } else { cfg.shared_feed_forward_length.max(1) }
    }

    /// Floats a token takes in the widest of [`Scratch::new`]'s buffers but the logits (the FFN's
    /// gate and up products, K and V packed, the queries or the hidden state).
    fn widest_per_token(cfg: &LlamaConfig) -> u32 {
        let (h, kv, q) = (cfg.embedding_length, cfg.head_count_kv * cfg.head_dim, cfg.head_count * cfg.head_dim);
        [h, 2 * kv, q, 2 * Scratch::ffn(cfg)].into_iter().max().unwrap_or(1)
    }

    /// Buffers for `n_tokens` tokens a pass (the decode step's sequences, or a prefill chunk),
    /// logits for `logits_tokens` of them.
    fn new(rt: &Runtime, cfg: &LlamaConfig, n_tokens: u32, logits_tokens: u32) -> Scratch {
        let (h, kv, vocab) = (cfg.embedding_length, cfg.head_count_kv * cfg.head_dim, cfg.vocab_size);
        let f = Scratch::ffn(cfg);
        let buf = |label: &str, floats: u32| rt.storage(label, u64::from(n_tokens) * u64::from(floats) * 4);
        Scratch {
            tokens: buf("model tokens", 1),
            positions: buf("model positions", 1),
            h: buf("model h", h),
            xn: buf("model xn", h),
            k: buf("model k", kv),
            v: buf("model v", kv),
            q_raw: buf("model q before its norm", if cfg.arch.qk_norm() { cfg.head_count * cfg.head_dim } else { 1 }),
            k_raw: buf("model k before its norm", if cfg.arch.qk_norm() { kv } else { 1 }),
            kv_words: buf("model kv words", 2 * kv),
            gu: buf("model gate_up", 2 * f),
            act: buf("model act", f),
            shared_gate: buf("model shared expert gate", 1),
            logits: rt.storage("model logits", u64::from(logits_tokens.max(1)) * u64::from(vocab) * 4),
        }
    }
}

/// Every model kernel's dispatch of a step, recorded once at load (the buffers, shapes and
/// therefore uniforms and bind groups are the same every step) and replayed by
/// [`GpuLlama::forward`] between the pool's and attention's own passes.
struct Recording {
    embed: Recorded,
    /// Per layer: RMSNorm, Q/K/V projections, RoPE, K/V packed for the append.
    attention_inputs: Vec<Recorded>,
    /// Per layer: output projection added to the residual, RMSNorm, the dense FFN (its down
    /// projection added to the residual).
    ffn: Vec<Recorded>,
    head: Recorded,
}

/// The expert FFNs, recorded per layer: the router's weights (`[E][hidden]`, f32, scored with
/// the matrix-vector kernel), its top-k, the chosen experts' weights, and the experts' FFN (the
/// recorded bind groups hold the buffers). Either MoEfied ([`GpuLlama::set_moe`]: centroids,
/// weights 1) or a MoE file's own ([`GpuLlama::load`]: `ffn_gate_inp`, softmax weights).
struct GpuMoe {
    top_k: u32,
    n_experts: u32,
    /// A MoE file's own experts: the chosen experts' weights are the softmax of their scores.
    native: bool,
    /// Per layer: the router's weights and the experts' FFN.
    layers: Vec<(GpuMatrix, MoeFfn)>,
    /// The router's scores `[seq][E]`, the chosen experts `[seq][k]`, their weights `[seq][k]`
    /// (all 1 when MoEfied), the experts' activations.
    scores: wgpu::Buffer,
    sel: wgpu::Buffer,
    wts: wgpu::Buffer,
    act: wgpu::Buffer,
    /// The experts every layer chose in this step, `[layer][seq][k]`, read back once per step.
    log: wgpu::Buffer,
    /// Those choices as the host last read them (for a trace).
    last_chosen: Vec<u32>,
    /// Tokens routed to each (layer, expert) so far, `layer * E + e`.
    counts: Vec<u64>,
    /// The decode steps' routing as LRU stack distances: every cache size's hits.
    reuse: ReuseCurve,
    /// Per layer: output projection, residual, RMSNorm, router, top-k, the chosen experts,
    /// residual (replacing [`Recording::ffn`]).
    recorded: Vec<Recorded>,
    /// One of the pipeline's routers over the centroid scores ([`GpuLlama::set_moe_router`]).
    routed: Option<RoutedMoe>,
    /// A MoE file's experts in tiers ([`ModelOptions::experts`]): `recorded` ends at the
    /// layer's top-k and `experts` holds the experts' recording.
    cache: Option<ExpertCache>,
    experts: Vec<Recorded>,
    /// With pre-gating prefetch: each layer's FFN input scored by the next layer's router
    /// (`[seq][E]`), its top k (scratch), and that prediction per layer, `[layer][seq][k]`.
    pregate: Option<Pregate>,
    /// With an expert cache, per layer: what the host reads after the layer's top k
    /// ([`GpuMoe::sync_ranges`]), copied there by the layer's own segment.
    sync: Vec<wgpu::Buffer>,
}

impl GpuMoe {
    /// What the host reads after layer `l`'s top k, in order (buffer, first word, words): the
    /// layer's choices; its router scores under the score policy; with pre-gating (not after
    /// the last layer) the next layer's predicted choices and, under the score policy, scores.
    fn sync_ranges(&self, l: usize, n_seqs: u32) -> Vec<(&wgpu::Buffer, u64, u64)> {
        let Some(cache) = &self.cache else { return Vec::new() };
        let per = u64::from(n_seqs * self.top_k);
        let n_scores = u64::from(n_seqs * self.n_experts);
        let by_score = cache.cfg.policy == ExpertPolicy::Score;
        let mut r = vec![(&self.log, l as u64 * per, per)];
        if by_score {
            r.push((&self.scores, 0, n_scores));
        }
        if let Some(pg) = self.pregate.as_ref().filter(|_| l + 1 < self.layers.len()) {
            r.push((&pg.log, (l as u64 + 1) * per, per));
            if by_score {
                r.push((&pg.scores, 0, n_scores));
            }
        }
        r
    }
}

/// The buffers of pre-gating (see [`GpuMoe::pregate`]).
impl GpuMoe {
    /// Add a pass's choices (`[layer][per_layer]` expert ids) to the (layer, expert) counts.
    fn count(&mut self, chosen: &[u32], per_layer: usize) {
        let e = self.n_experts as usize;
        for (l, sel) in chosen.chunks(per_layer).enumerate() {
            for &x in sel {
                self.counts[l * e + x as usize] += 1;
            }
        }
    }
}

struct Pregate {
    scores: wgpu::Buffer,
    sel: wgpu::Buffer,
    log: wgpu::Buffer,
}

/// The expert FFN with the pipeline's router choosing the experts: per layer the part before
/// the router (output projection, RMSNorm, router scores) and after it (the chosen experts'
/// weights when native, the experts).
struct RoutedMoe {
    router: Router,
    before: Vec<Recorded>,
    after: Vec<Recorded>,
}

/// A Llama-family model on the GPU whose K/V live in an expertkv [`KvPool`](expertkv_core::append::KvPool): the weights as
/// stored in the GGUF file, the model kernels with every step's dispatches recorded at load, and
/// the pool's scheduler, codec and route stage as [`ModelOptions`] set them up. It decodes
/// [`GpuLlama::n_seqs`] sequences together, one token each per [`GpuLlama::forward`].
pub struct GpuLlama {
    /// The model's hyper-parameters, read from the GGUF metadata at load.
    pub cfg: LlamaConfig,
    kernels: ModelKernels,
    /// Each layer's matrices (the MoEfied FFN's recording takes its attention output from here;
    /// the recorded bind groups keep every other buffer alive).
    layers: Vec<Layer>,
    /// The K/V side of the step ([`KvSide`], configured from [`ModelOptions`]): the paged pool
    /// (pages of [`MODEL_PAGE_SIZE`] slots, a page list per (layer, sequence, KV head), K/V in
    /// [`ModelOptions::dtype`], compressed pages under a codec), its attention, the route stage
    /// and the policy over the pool: an evicting scheduler (run after every step down to its
    /// budget, tokens per layer x sequence x KV head), QUEST (attention reads only the pages whose
    /// key bounds score highest for its queries) or FlexGen's host tier (each layer's best host
    /// pages fetched before its attention, the coldest pages past the budget moved out after
    /// the step).
    pub kv: KvSide,
    /// The pool holds this many tokens per list, the scheduler's budget ([`kept_per_list`]);
    /// positions then run past the pool's pages, up to `max_context`.
    kept_per_list: Option<u32>,
    /// The route stage's scores ([`ModelOptions::routing`]): every layer's tokens scored by a
    /// routing source's router before the route stage routes them and their append.
    labels: Option<KvLabels>,
    /// Tokens whose first label matched the FFN's first expert, and tokens compared (a sparse
    /// FFN with labels: see [`GpuLlama::label_agreement`]).
    agreement: (u64, u64),
    /// Check every eviction against the CPU reference: the pool is read back before the
    /// scheduler runs (a CPU pool model starts from it), the utilities, budgets, victims and
    /// list counts are compared, and the whole pool after. Slow (the pool crosses to the host
    /// twice a step); for tests and audits.
    pub verify_evictions: bool,
    /// The pool the last checked eviction left (the reference's, equal to the GPU's then), which
    /// the next checked step compares with the GPU's pool before its eviction; dropped by any
    /// step or call that changes the pool unchecked.
    carried_pool: Option<expertkv_core::reference::PoolModel>,
    s: Scratch,
    recorded: Recording,
    moe: Option<GpuMoe>,
    /// Sequences decoded together (1 to [`MAX_SEQS`]): [`GpuLlama::forward`] takes exactly
    /// this many tokens, one per sequence.
    pub n_seqs: u32,
    /// Next position of every sequence.
    pub positions: Vec<u32>,
    /// Tokens per sequence the pool was sized for ([`ModelOptions::max_context`]).
    max_context: u32,
    step: u32,
    /// Low-rank codecs: positions per sequence before the basis is fitted, and the most the raw
    /// pages were sized for.
    calibration_tokens: u32,
    calibration_max: u32,
    /// Compute dispatches the last [`GpuLlama::forward`] encoded, every stage and the
    /// scheduler's included.
    dispatches: u64,
    /// The token embeddings, the separate LM head if any, and the final norm's gain.
    io: Io,
    /// Chunked prefill's attention and scratch, made by the first [`GpuLlama::prefill`].
    prefill: Option<Prefill>,
    /// Prompt tokens a prefill pass takes at most ([`ModelOptions::prefill_chunk`]).
    prefill_chunk: u32,
    /// Timestamps between the passes of every step and prefill chunk, while timing them
    /// ([`GpuLlama::time_stages`], [`GpuLlama::time_steps`]).
    timer: Option<StageTimer>,
    /// Where each pass's record goes while recording ([`GpuLlama::record_trace`]).
    trace: Option<trace::TraceSink>,
    /// The last step's host-to-GPU transfers ([`GpuLlama::last_transfers`]) and every step's
    /// summed.
    transfers: Vec<Transfer>,
    transfer_totals: TransferTotals,
}

/// Sequences one model decodes together at most (the matrix-vector kernel takes them in
/// groups of [`crate::ops::MATVEC_MAX_TOKENS`]).
pub const MAX_SEQS: u32 = 64;

/// Tokens of a prompt one [`GpuLlama::prefill`] pass takes at most, by default
/// ([`ModelOptions::prefill_chunk`]): the tiled products fill the GPU from about 256 tokens (a
/// chunk of 64 makes a 4096-row product only 64 workgroups).
pub const PREFILL_CHUNK: u32 = 256;

/// The largest [`ModelOptions::prefill_chunk`].
pub const MAX_PREFILL_CHUNK: u32 = 1024;

fn norm_buffer(rt: &Runtime, g: &Gguf<'_>, name: &str) -> Result<wgpu::Buffer> {
    Ok(rt.storage_init(name, &g.tensor_f32(name)?))
}

fn matrix(rt: &Runtime, g: &Gguf<'_>, names: &[&str]) -> Result<GpuMatrix> {
    let mut bytes = Vec::new();
    let (mut rows, mut cols, mut format) = (0u32, 0u32, None);
    for name in names {
        let t = g.tensor(name).ok_or_else(|| Error::Model(format!("tensor `{name}` is missing")))?;
        let f = WeightFormat::from_ggml(t.ggml_type())?;
        if format.is_some_and(|x| x != f) || (cols != 0 && cols as u64 != t.dims()[0]) {
            return Err(Error::Model(format!("{names:?}: the matrices to stack differ in format or width")));
        }
        format = Some(f);
        cols = t.dims()[0] as u32;
        rows += t.dims()[1] as u32;
        bytes.extend_from_slice(g.tensor_data(name)?);
    }
    let format = format.ok_or_else(|| Error::Model("no matrix named".into()))?;
    GpuMatrix::upload(rt, names[0], format, rows, cols, &bytes)
}

/// Record every model kernel's dispatch of a step (see [`Recording`]).
#[allow(clippy::too_many_arguments)]
fn record(
    rt: &Runtime,
    k: &ModelKernels,
    c: &LlamaConfig,
    layers: &[Layer],
    (embed, output, out_norm): (&GpuMatrix, Option<&GpuMatrix>, &wgpu::Buffer),
    s: &Scratch,
    (queries, attn_out): (&wgpu::Buffer, &wgpu::Buffer),
    n: u32,
    f16: bool,
    with_head: bool,
) -> Result<Recording> {
    let (hq, hkv, d) = (c.head_count, c.head_count_kv, c.head_dim);
    let mut rec = Recording { embed: Recorded::default(), attention_inputs: Vec::new(), ffn: Vec::new(), head: Recorded::default() };
    k.embed(rt, &mut rec.embed, embed, &s.tokens, &s.h, n)?;
    for w in layers {
        let mut p = Recorded::default();
        // With per-head norms (qwen3) the projections land in scratch and the norm writes them.
        let (q_out, k_out) = if w.qk_norm.is_some() { (&s.q_raw, &s.k_raw) } else { (queries, &s.k) };
        // The attention norm is folded into the projections (each token's RMS computed in the
        // product's workgroups).
        let (eps, g) = (c.rms_norm_eps, &w.attn_norm);
        match &w.qkv {
            Qkv::Stacked(m) => k.matvec_norm(rt, &mut p, m, &s.h, g, eps, &[(q_out, hq * d), (k_out, hkv * d), (&s.v, hkv * d)], n)?,
            Qkv::Separate([wq, wk, wv]) => {
                k.matvec_norm(rt, &mut p, wq, &s.h, g, eps, &[(q_out, hq * d)], n)?;
                k.matvec_norm(rt, &mut p, wk, &s.h, g, eps, &[(k_out, hkv * d)], n)?;
                k.matvec_norm(rt, &mut p, wv, &s.h, g, eps, &[(&s.v, hkv * d)], n)?;
            }
        }
        if let Some([bq, bk, bv]) = &w.qkv_bias {
            k.residual(rt, &mut p, bq, q_out, n * hq * d);
            k.residual(rt, &mut p, bk, k_out, n * hkv * d);
            k.residual(rt, &mut p, bv, &s.v, n * hkv * d);
        }
        if let Some([gq, gk]) = &w.qk_norm {
            if c.arch.qk_norm_whole() {
                k.rmsnorm(rt, &mut p, &s.q_raw, gq, queries, n, hq * d, c.rms_norm_eps);
                k.rmsnorm(rt, &mut p, &s.k_raw, gk, &s.k, n, hkv * d, c.rms_norm_eps);
            } else {
                k.rmsnorm(rt, &mut p, &s.q_raw, gq, queries, n * hq, d, c.rms_norm_eps);
                k.rmsnorm(rt, &mut p, &s.k_raw, gk, &s.k, n * hkv, d, c.rms_norm_eps);
            }
        }
        let neox = c.arch.rope_neox();
        k.rope_qk(rt, &mut p, queries, &s.k, &s.positions, n, (hq, hkv), d, c.rope_freq_base, neox);
        k.kv_pack(rt, &mut p, &s.k, &s.v, &s.kv_words, n, hkv * d, f16)?;
        rec.attention_inputs.push(p);
        let mut p = Recorded::default();
        // A MoE file's layer has no dense FFN: its experts are recorded by `install_moe`.
        if let Some((gate_up, down)) = &w.ffn {
            // The FFN norm folded into the gate/up product, SwiGLU into the down product.
            k.matvec_add(rt, &mut p, &w.wo, attn_out, &s.h, n)?;
            k.matvec_norm(rt, &mut p, gate_up, &s.h, &w.ffn_norm, c.rms_norm_eps, &[(&s.gu, 2 * c.feed_forward_length)], n)?;
            k.matvec_swiglu_add(rt, &mut p, down, &s.gu, &s.h, n)?;
        }
        rec.ffn.push(p);
    }
    if with_head {
        let head = output.unwrap_or(embed);
        k.matvec_norm(rt, &mut rec.head, head, &s.h, out_norm, c.rms_norm_eps, &[(&s.logits, head.rows)], n)?;
    }
    Ok(rec)
}

/// A layer's shared expert (`qwen2moe`), when it has one, added to the residual stream:
/// `h += sigmoid(gate . xn) * down(silu(gate_proj xn) * up xn)`, after the routed experts.
fn shared_expert(rt: &Runtime, k: &ModelKernels, c: &LlamaConfig, w: &Layer, s: &Scratch, n: u32, p: &mut Recorded) -> Result<()> {
    if let Some([gate, gate_up, down]) = &w.shared {
        k.matvec(rt, p, gate, &s.xn, &s.shared_gate, n)?;
        k.matvec(rt, p, gate_up, &s.xn, &s.gu, n)?;
        k.swiglu_gated(rt, p, &s.gu, &s.shared_gate, &s.act, n, c.shared_feed_forward_length);
        k.matvec_add(rt, p, down, &s.act, &s.h, n)?;
    }
    Ok(())
}

/// The output projection added to the residual stream, and the FFN's RMSNorm (the FFN input
/// lands in `s.xn`).
#[allow(clippy::too_many_arguments)]
fn attention_output(
    rt: &Runtime,
    k: &ModelKernels,
    c: &LlamaConfig,
    w: &Layer,
    s: &Scratch,
    attn_out: &wgpu::Buffer,
    n: u32,
    p: &mut Recorded,
) -> Result<()> {
    k.matvec_add(rt, p, &w.wo, attn_out, &s.h, n)?;
    k.rmsnorm(rt, p, &s.h, &w.ffn_norm, &s.xn, n, c.embedding_length, c.rms_norm_eps);
    Ok(())
}

/// The K/V side of a model ([`KvSide`]) and what binds it: the route stage's scores and the
/// step's scratch and recording (its bind groups hold the pool's and the attention's buffers).
/// [`GpuLlama::load`] builds it after the weights; [`GpuLlama::reconfigure`] builds it again.
struct KvParts {
    kept_per_list: Option<u32>,
    kv: KvSide,
    labels: Option<KvLabels>,
    s: Scratch,
    recorded: Recording,
}

/// Build the K/V side `o` asks for (its `experts` aside) beside the model's weights.
async fn kv_side(
    rt: &Runtime,
    cfg: &LlamaConfig,
    kernels: &ModelKernels,
    layers: &[Layer],
    io: (&GpuMatrix, Option<&GpuMatrix>, &wgpu::Buffer),
    o: &ModelOptions,
) -> Result<KvParts> {
    let kept_per_list = kept_per_list(o.scheduler.as_ref(), o.pyramid, o.routing.as_ref());
    let kv = KvSide::new(rt, &o.kv_side_config(cfg)).await?;
    let labels = match &o.routing {
        Some(r) => Some(KvLabels::new(rt, r, o.n_seqs, cfg.embedding_length)?),
        None => None,
    };
    let s = Scratch::new(rt, cfg, o.n_seqs, o.n_seqs);
    let f16 = kv.pool.cfg.dtype == KvDtype::F16;
    let recorded = record(rt, kernels, cfg, layers, io, &s, (&kv.attn.queries, kv.attn.output()), o.n_seqs, f16, true)?;
    Ok(KvParts { kept_per_list, kv, labels, s, recorded })
}

/// Tensors shared by [`GpuLlama::load`] and [`GpuLlama::reconfigure`]: the token embeddings, the
/// separate LM head if any, and the final norm's gain.
type Io = (GpuMatrix, Option<GpuMatrix>, wgpu::Buffer);

impl GpuLlama {
    /// A model of these weights and K/V side, no experts installed yet, at step 0 with every
    /// sequence at position 0.
    fn assemble(cfg: LlamaConfig, kernels: ModelKernels, layers: Vec<Layer>, io: Io, kv: KvParts, opts: &ModelOptions) -> GpuLlama {
        let ModelOptions { n_seqs, max_context, prefill_chunk, .. } = *opts;
        let KvParts { kept_per_list, kv, labels, s, recorded } = kv;
        GpuLlama {
            kept_per_list,
            cfg,
            kernels,
            recorded,
            layers,
            kv,
            labels,
            agreement: (0, 0),
            verify_evictions: false,
            carried_pool: None,
            s,
            moe: None,
            n_seqs,
            positions: vec![0; n_seqs as usize],
            max_context,
            step: 0,
            calibration_tokens: LOW_RANK_CALIBRATION_TOKENS.min(max_context),
            calibration_max: LOW_RANK_CALIBRATION_TOKENS.min(max_context),
            dispatches: 0,
            timer: None,
            trace: None,
            io,
            prefill: None,
            prefill_chunk,
            transfers: Vec::new(),
            transfer_totals: TransferTotals::default(),
        }
    }
}

impl GpuLlama {
    /// Upload the model's weights and build its K/V pool as `opts` says: `n_seqs` sequences of
    /// up to `max_context` tokens each, K/V in `dtype`; with an evicting scheduler and its budget
    /// (tokens per layer x sequence x KV head), which after every step evicts down to the budget
    /// using the model's own attention mass; or with a page codec: every page that leaves its
    /// ring's head is compressed on the GPU right after the step's append, and attention decodes
    /// compressed pages in-kernel. The low-rank codecs first fit their basis on the model's own
    /// K/V of the first [`LOW_RANK_CALIBRATION_TOKENS`] positions (the calibration window, kept
    /// raw; see [`GpuLlama::set_calibration_tokens`]), then compress those pages and every later
    /// one. With both, an eviction first decodes the compressed pages it touches into raw ones
    /// (`compress::Thaw`), and the next step's compress pass re-encodes them.
    pub async fn load(rt: &Runtime, g: &Gguf<'_>, opts: ModelOptions) -> Result<GpuLlama> {
        let cfg = LlamaConfig::from_gguf(g)?;
        cfg.check_tensors(g)?;
        check_options(&cfg, &opts)?;
        let ModelOptions { n_seqs, experts, .. } = opts.clone();
        // The weight formats of the file's tensors (the norms and the rest are F32 or converted).
        let mut formats = vec![WeightFormat::F32];
        formats.extend(g.tensors().iter().filter_map(|t| WeightFormat::from_ggml(t.ggml_type()).ok()));
        let kernels = ModelKernels::new(rt, &formats).await?;
        let mut layers = Vec::new();
        for l in 0..cfg.block_count {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            layers.push(Layer {
                attn_norm: norm_buffer(rt, g, &n("attn_norm"))?,
                qkv: if same_format(g, &n("attn_q"), &n("attn_k")).is_ok() && same_format(g, &n("attn_q"), &n("attn_v")).is_ok() {
                    Qkv::Stacked(matrix(rt, g, &[&n("attn_q"), &n("attn_k"), &n("attn_v")])?)
                } else {
                    Qkv::Separate([matrix(rt, g, &[&n("attn_q")])?, matrix(rt, g, &[&n("attn_k")])?, matrix(rt, g, &[&n("attn_v")])?])
                },
                wo: matrix(rt, g, &[&n("attn_output")])?,
                ffn_norm: norm_buffer(rt, g, &n("ffn_norm"))?,
                qkv_bias: if cfg.arch.qkv_bias() {
                    let b = |name: &str| -> Result<wgpu::Buffer> {
                        let v = g.tensor_f32(&format!("blk.{l}.{name}.bias"))?;
                        // Repeated for every token of a step or a prefill chunk.
                        let copies = MAX_SEQS.max(opts.prefill_chunk) as usize;
                        Ok(rt.storage_init(&format!("blk.{l}.{name}.bias x tokens"), &v.repeat(copies)))
                    };
                    Some([b("attn_q")?, b("attn_k")?, b("attn_v")?])
                } else {
                    None
                },
                qk_norm: if cfg.arch.qk_norm() {
                    Some([norm_buffer(rt, g, &n("attn_q_norm"))?, norm_buffer(rt, g, &n("attn_k_norm"))?])
                } else {
                    None
                },
                shared: if cfg.arch.shared_expert() {
                    let gate = f32_matrix(rt, &n("ffn_gate_inp_shexp"), 1, cfg.embedding_length, &g.tensor_f32(&n("ffn_gate_inp_shexp"))?)?;
                    Some([gate, matrix(rt, g, &[&n("ffn_gate_shexp"), &n("ffn_up_shexp")])?, matrix(rt, g, &[&n("ffn_down_shexp")])?])
                } else {
                    None
                },
                ffn: if cfg.expert_count == 0 {
                    Some((matrix(rt, g, &[&n("ffn_gate"), &n("ffn_up")])?, matrix(rt, g, &[&n("ffn_down")])?))
                } else {
                    None
                },
            });
        }
        let embed = matrix(rt, g, &["token_embd.weight"])?;
        let output = if g.tensor("output.weight").is_some() { Some(matrix(rt, g, &["output.weight"])?) } else { None };
        let out_norm = norm_buffer(rt, g, "output_norm.weight")?;
        let kv = kv_side(rt, &cfg, &kernels, &layers, (&embed, output.as_ref(), &out_norm), &opts).await?;
        rt.check("model upload")?;
        let (native, cache) = match (cfg.expert_count > 0, experts) {
            (true, None) => (Some(native_experts(rt, g, &cfg)?), None),
            (true, Some(ec)) => {
                let (cache, ffns) = ExpertCache::load(rt, g, &cfg, ec, n_seqs)?;
                (Some(native_routers(rt, g, &cfg)?.into_iter().zip(ffns).collect()), Some(cache))
            }
            (false, None) => (None, None),
            (false, Some(_)) => return Err(Error::Input("an expert cache needs a MoE file (this model has a dense FFN)".into())),
        };
        let mut model = GpuLlama::assemble(cfg, kernels, layers, (embed, output, out_norm), kv, &opts);
        if let Some(layers) = native {
            let (e, k) = (model.cfg.expert_count, model.cfg.expert_used_count);
            model.install_moe(rt, layers, e, k, true, cache)?;
            if model.labels.is_some() {
                let routers = (0..model.cfg.block_count)
                    .map(|l| g.tensor_f32(&format!("blk.{l}.ffn_gate_inp.weight")))
                    .collect::<Result<Vec<_>>>()?;
                model.install_labels(rt, LabelSource::MoeFile, &routers)?;
            }
        }
        Ok(model)
    }

    /// Replace every layer's dense FFN with `moe`'s experts (clustered from this model's weights,
    /// [`Moefication::from_weights`]): the router scores each token's FFN input against the
    /// centroids on the GPU, picks the top k there (as the CPU reference does), and only those
    /// experts' neurons are read and evaluated. The dense FFN matrices stay loaded. Refused for a
    /// MoE file (it runs its own experts from the start).
    pub fn set_moe(&mut self, rt: &Runtime, g: &Gguf<'_>, moe: &Moefication) -> Result<()> {
        let c = &self.cfg;
        let (hidden, ffn) = (c.embedding_length, c.feed_forward_length);
        if c.expert_count > 0 || moe.is_native() {
            return Err(Error::config(
                "experts",
                moe.config.experts,
                "MoEfication splits a dense model's FFNs; a MoE file runs its own experts and router",
            ));
        }
        if moe.layers.len() != c.block_count as usize {
            return Err(Error::Model(format!("{} MoEfied layers for a model of {}", moe.layers.len(), c.block_count)));
        }
        let e = moe.config.experts as u32;
        let k = moe.config.top_k as u32;
        let mut layers = Vec::new();
        for (l, ml) in moe.layers.iter().enumerate() {
            if ml.neurons.len() != ffn as usize || ml.centroids.len() != (e * hidden) as usize {
                return Err(Error::Model(format!("layer {l}: the experts were made for another model shape")));
            }
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            let format = same_format(g, &n("ffn_gate"), &n("ffn_up"))?;
            let down_f = g.tensor_f32(&n("ffn_down"))?;
            let ffn_l = MoeFfn::upload(
                rt,
                &format!("blk.{l} moe"),
                format,
                hidden,
                g.tensor_data(&n("ffn_gate"))?,
                g.tensor_data(&n("ffn_up"))?,
                &down_f,
                &ml.neurons,
                &ml.offsets,
            )?;
            let centroids = f32_matrix(rt, &format!("blk.{l} router"), e, hidden, &ml.centroids)?;
            layers.push((centroids, ffn_l));
        }
        self.install_moe(rt, layers, e, k, false, None)?;
        if self.labels.is_some() {
            self.check_label_shape(moe)?;
            let routers: Vec<Vec<f32>> = moe.layers.iter().map(|ml| ml.centroids.clone()).collect();
            self.install_labels(rt, LabelSource::Moefied, &routers)?;
        }
        Ok(())
    }

    /// Label every layer's tokens with `moe`'s router (its centroids, or fitted router) while the
    /// FFN stays dense: the K/V carry a trained routing structure and quality stays the dense
    /// model's. Needs [`ModelOptions::routing`] with `moe`'s experts and top k; refused for a MoE
    /// file (its own router labels its tokens) and after [`GpuLlama::set_moe`].
    pub fn set_labels(&mut self, rt: &Runtime, moe: &Moefication) -> Result<()> {
        if self.cfg.expert_count > 0 || moe.is_native() {
            return Err(Error::config("labels", moe.config.experts, "a MoE file's own router labels its tokens"));
        }
        if self.moe.is_some() {
            return Err(Error::config("labels", moe.config.experts, "the FFN is MoEfied: its router already labels the tokens"));
        }
        if moe.layers.len() != self.cfg.block_count as usize
            || moe.layers.iter().any(|ml| ml.centroids.len() != (moe.config.experts as u32 * self.cfg.embedding_length) as usize)
        {
            return Err(Error::Model("the MoEfication was made for another model shape".into()));
        }
        self.check_label_shape(moe)?;
        let routers: Vec<Vec<f32>> = moe.layers.iter().map(|ml| ml.centroids.clone()).collect();
        self.install_labels(rt, LabelSource::LabelsOnly, &routers)
    }

    /// The route stage was set up for `moe`'s experts and top k.
    fn check_label_shape(&self, moe: &Moefication) -> Result<()> {
        let Some(router) = self.label_router_stage() else {
            return Err(Error::config("labels", moe.config.experts, "load the model with ModelOptions::routing to route its tokens"));
        };
        let (e, k) = (router.shape.n_experts, router.shape.top_k);
        if (e, k) != (moe.config.experts as u32, moe.config.top_k as u32) {
            return Err(Error::config(
                "routing",
                format!("E{e} k{k}"),
                format!("the MoEfication has {} experts, top {}", moe.config.experts, moe.config.top_k),
            ));
        }
        Ok(())
    }

    /// Install the route stage's scoring over `routers` (per layer `[E][hidden]` f32).
    fn install_labels(&mut self, rt: &Runtime, source: LabelSource, routers: &[Vec<f32>]) -> Result<()> {
        let (Some(labels), Some(route)) = (&mut self.labels, &self.kv.route) else { return Ok(()) };
        let inputs = ScoreInputs {
            h: &self.s.h,
            ffn_norms: self.layers.iter().map(|w| &w.ffn_norm).collect(),
            hidden: self.cfg.embedding_length,
            eps: self.cfg.rms_norm_eps,
        };
        labels.install(rt, &self.kernels, (source, &route.router), routers, inputs)
    }

    /// The route stage's router, when the tokens are routed.
    fn label_router_stage(&self) -> Option<&Router> {
        self.labels.as_ref().and(self.kv.route.as_ref()).map(|r| &r.router)
    }

    /// Where the tokens' routing labels come from, once a source is installed.
    pub fn label_source(&self) -> Option<LabelSource> {
        self.labels.as_ref().and_then(|l| l.source)
    }

    /// The route stage's router configuration.
    pub fn label_router(&self) -> Option<&RouterConfig> {
        self.label_router_stage().map(|r| &r.cfg)
    }

    /// The route stage's statistics per (layer, expert), `layer * E + e`: tokens routed (ever
    /// appended), resident in the pool, load and miss rate.
    pub async fn label_stats(&self, rt: &Runtime) -> Result<Vec<ExpertStats>> {
        match self.label_router_stage() {
            Some(r) => Ok(r.read_stats(rt).await?),
            None => Ok(Vec::new()),
        }
    }

    /// The experts the route stage chose for the last step's tokens and their gates, both
    /// `[layer][seq][k]` (empty without the route stage).
    pub async fn step_labels(&self, rt: &Runtime) -> Result<(Vec<u32>, Vec<f32>)> {
        let Some(r) = self.label_router_stage() else { return Ok((Vec::new(), Vec::new())) };
        Ok((crate::labels::routed_experts(rt, r).await?, crate::labels::routed_gates(rt, r).await?))
    }

    /// The last step's report, as the synthetic pipeline's ([`StepReport::collect`]): pool
    /// occupancy by tier and shard, the route stage's per-expert statistics, evictions and kept
    /// attention, EKVA's split, QUEST's bytes read. No GPU times (`gpu: None`).
    pub async fn step_report(&self, rt: &Runtime) -> Result<StepReport> {
        let kv = &self.kv;
        let parts =
            ReportParts { pool: &kv.pool, router: self.label_router_stage(), scheduler: kv.scheduler.as_ref(), quest: kv.quest.as_ref() };
        let ctl = kv.pool.read_ctl(rt).await?;
        let context = self.positions.first().copied().unwrap_or(0);
        let mut report = StepReport::collect(rt, parts, ctl, (self.step.saturating_sub(1), context), None, f64::NAN).await?;
        if let Some((fg, _)) = &self.kv.flexgen {
            report.host_kv_bytes = fg.stats.host_bytes;
            report.tier_bytes_moved = fg.stats.bytes_to_host + fg.stats.bytes_to_gpu;
        }
        Ok(report)
    }

    /// With a sparse FFN and the route stage: (tokens whose first label is the FFN's first
    /// expert, tokens compared) over every layer and step so far. The labels are chosen one
    /// attention block before the FFN routes (pre-gating), so they can differ.
    pub fn label_agreement(&self) -> (u64, u64) {
        self.agreement
    }

    /// Record the expert FFN of every layer in place of the dense one (see [`GpuMoe`]).
    fn install_moe(
        &mut self,
        rt: &Runtime,
        layers: Vec<(GpuMatrix, MoeFfn)>,
        e: u32,
        k: u32,
        native: bool,
        cache: Option<ExpertCache>,
    ) -> Result<()> {
        let c = &self.cfg;
        let max_size = layers.iter().map(|(_, f)| f.max_size).max().unwrap_or(1).max(1);
        let n = self.n_seqs;
        let scores = rt.storage("moe scores", u64::from(n * e) * 4);
        let sel = rt.storage("moe sel", u64::from(n * k) * 4);
        // MoEfied experts weigh 1 each; a MoE file's weights are written every layer.
        let wts = rt.storage_init("moe weights", &vec![1f32; (n * k) as usize]);
        let log = rt.storage("moe choices", u64::from(c.block_count * n * k) * 4);
        let act = rt.storage("moe act", u64::from(n * k * max_size) * 4);
        let pregate = cache.as_ref().filter(|c| c.cfg.prefetch == ExpertPrefetch::Pregate).map(|_| Pregate {
            scores: rt.storage("moe pre-gate scores", u64::from(n * e) * 4),
            sel: rt.storage("moe pre-gate sel", u64::from(n * k) * 4),
            log: rt.storage("moe pre-gate choices", u64::from(c.block_count * n * k) * 4),
        });
        let (kern, s) = (&self.kernels, &self.s);
        let share = softmax_share(c, native);
        let (mut recorded, mut experts) = (Vec::new(), Vec::new());
        for (l, ((router, ffn_l), w)) in layers.iter().zip(&self.layers).enumerate() {
            // Score the FFN input with the router, take the top k on the GPU, weight the chosen,
            // then evaluate only those experts' neurons.
            let mut p = Recorded::default();
            attention_output(rt, kern, c, w, s, self.kv.attn.output(), n, &mut p)?;
            kern.matvec(rt, &mut p, router, &s.xn, &scores, n)?;
            kern.moe_topk(rt, &mut p, &scores, &sel, &log, l as u32 * n * k, n, e, k)?;
            if let (Some(pg), Some((next, _))) = (&pregate, layers.get(l + 1)) {
                // Pre-gating: the next layer's router over this layer's FFN input.
                kern.matvec(rt, &mut p, next, &s.xn, &pg.scores, n)?;
                kern.moe_topk(rt, &mut p, &pg.scores, &pg.sel, &pg.log, (l as u32 + 1) * n * k, n, e, k)?;
            }
            if let Some(share) = share {
                kern.moe_weights(rt, &mut p, &scores, &sel, &wts, n, e, k, share)?;
            }
            // With an expert cache the experts are a recording of their own: the host fetches
            // the missing ones between the two.
            let mut q = Recorded::default();
            let after = if cache.is_some() { &mut q } else { &mut p };
            kern.moe_ffn(rt, after, ffn_l, &s.xn, &sel, &wts, &act, &s.h, n, k, true)?;
            shared_expert(rt, kern, c, w, s, n, after)?;
            recorded.push(p);
            experts.push(q);
        }
        self.moe = Some(GpuMoe {
            top_k: k,
            n_experts: e,
            native,
            layers,
            scores,
            sel,
            wts,
            act,
            log,
            last_chosen: Vec::new(),
            counts: vec![0; (c.block_count * e) as usize],
            reuse: ReuseCurve::new(c.block_count, e),
            recorded,
            routed: None,
            cache,
            experts,
            pregate,
            sync: Vec::new(),
        });
        if let Some(moe) = &mut self.moe {
            moe.sync = (0..moe.layers.len())
                .map(|l| {
                    let words: u64 = moe.sync_ranges(l, n).iter().map(|r| r.2).sum();
                    rt.staging(&format!("blk.{l} expert choices (host)"), words * 4)
                })
                .filter(|_| moe.cache.is_some())
                .collect();
        }
        rt.check("moe upload")
    }

    /// Let one of the pipeline's routers (`route/bias.wgsl`, `route/topk.wgsl`, its load
    /// statistics and, for the adaptive router, its online update) choose the experts from the
    /// router's scores, instead of their plain top k: MoEfied experts ([`GpuLlama::set_moe`]
    /// first) or a MoE file's own (weighted by the softmax of the chosen experts' scores). The
    /// cache-aware router is refused: the model's pool is not sharded by expert, so there are no
    /// per-expert cache misses for it to read.
    pub async fn set_moe_router(&mut self, rt: &Runtime, cfg: RouterConfig) -> Result<()> {
        let Some(moe) = &mut self.moe else {
            return Err(Error::config("router", cfg.name(), "routes experts: MoEfy the dense model first (set_moe), or load a MoE file"));
        };
        if moe.cache.is_some() {
            return Err(Error::config(
                "router",
                cfg.name(),
                "the experts are in an expert cache, which fetches the router's plain top k: load without one",
            ));
        }
        if matches!(cfg, RouterConfig::CacheAware { .. }) {
            return Err(Error::config(
                "router",
                cfg.name(),
                "the model's pool is not sharded by expert, so there are no per-expert cache misses: use hash, topk, load-balance, entropy, adaptive or hierarchical",
            ));
        }
        let (c, n, e, k) = (&self.cfg, self.n_seqs, moe.n_experts, moe.top_k);
        let shape = RouteShape { n_experts: e, top_k: k, layers: c.block_count, max_tokens: n };
        let router = Router::new(rt, cfg, shape, 0.1).await?;
        let (kern, s) = (&self.kernels, &self.s);
        let (mut before, mut after) = (Vec::new(), Vec::new());
        for ((centroids, ffn_l), w) in moe.layers.iter().zip(&self.layers) {
            let mut p = Recorded::default();
            attention_output(rt, kern, c, w, s, self.kv.attn.output(), n, &mut p)?;
            kern.matvec(rt, &mut p, centroids, &s.xn, &moe.scores, n)?;
            before.push(p);
            let mut p = Recorded::default();
            if let Some(share) = softmax_share(c, moe.native) {
                kern.moe_weights(rt, &mut p, &moe.scores, &moe.sel, &moe.wts, n, e, k, share)?;
            }
            kern.moe_ffn(rt, &mut p, ffn_l, &s.xn, &moe.sel, &moe.wts, &moe.act, &s.h, n, k, true)?;
            shared_expert(rt, kern, c, w, s, n, &mut p)?;
            after.push(p);
        }
        moe.routed = Some(RoutedMoe { router, before, after });
        rt.check("moe router")
    }

    /// Bytes of the K/V pool's pages and tables ([`KvPool::pool_bytes_allocated`](expertkv_core::append::KvPool::pool_bytes_allocated)) and of QUEST's
    /// page bounds and lists where QUEST or FlexGen selects pages ([`Quest::bytes_allocated`](expertkv_core::evict::quest::Quest::bytes_allocated)):
    /// what [`ModelOptions::kv_bytes`] predicts.
    pub fn kv_bytes_allocated(&self) -> u64 {
        self.kv.pool.pool_bytes_allocated() + self.kv.side_bytes_allocated()
    }

    /// Bytes a MoE file's experts take on the GPU ([`MoeFfn::gpu_bytes`] of every layer: every
    /// expert, or the cache's slots); 0 for a dense FFN or MoEfied experts.
    pub fn expert_bytes_allocated(&self) -> u64 {
        self.moe.as_ref().filter(|m| m.native).map_or(0, |m| m.layers.iter().map(|(_, ffn)| ffn.gpu_bytes()).sum())
    }

    /// Empty the expert cache's slots, if the experts are cached: the next step fetches every
    /// expert it chooses, as after a load (to start runs alike).
    pub fn empty_expert_slots(&mut self, rt: &Runtime) {
        if let Some(m) = &mut self.moe
            && let Some(c) = &mut m.cache
        {
            let ffns: Vec<&MoeFfn> = m.layers.iter().map(|(_, f)| f).collect();
            c.empty(rt, &ffns);
        }
    }

    /// The expert tiers, when the experts are cached ([`ModelOptions::experts`]): slots, traffic.
    pub fn expert_cache(&self) -> Option<&ExpertCache> {
        self.moe.as_ref().and_then(|m| m.cache.as_ref())
    }

    /// The router choosing the MoEfied experts, when one was set.
    pub fn moe_router(&self) -> Option<&RouterConfig> {
        self.moe.as_ref().and_then(|m| m.routed.as_ref()).map(|r| &r.router.cfg)
    }

    /// Tokens per sequence the pool was sized for ([`ModelOptions::max_context`]).
    pub fn max_context(&self) -> u32 {
        self.max_context
    }

    /// Bytes of the pool's pages in use (raw pages and compressed pages), as allocated.
    pub async fn kv_bytes_in_use(&self, rt: &Runtime) -> Result<u64> {
        let c = &self.kv.pool.cfg;
        let ctl = self.kv.pool.read_ctl(rt).await?;
        let raw = u64::from(c.n_pages - ctl.free_top);
        let codec = u64::from((c.n_ids() - c.n_pages) - ctl.codec_free_top);
        Ok(raw * c.page_bytes() + codec * c.codec_page_bytes() + self.codec_basis_bytes())
    }

    /// Bytes of the low-rank codecs' basis (part of [`GpuLlama::kv_bytes_in_use`]); 0 otherwise.
    pub fn codec_basis_bytes(&self) -> u64 {
        let pool = &self.kv.pool;
        if pool.cfg.codec.is_low_rank() { pool.codec_basis.size() } else { 0 }
    }

    /// Fit the low-rank basis after `tokens` positions instead of [`LOW_RANK_CALIBRATION_TOKENS`]
    /// (at most that many: the raw pages were sized for it), before the first step.
    pub fn set_calibration_tokens(&mut self, tokens: u32) -> Result<()> {
        let max = self.calibration_max;
        if tokens == 0 || tokens > max || self.step > 0 {
            return Err(Error::config("calibration", tokens, format!("must be in 1..={max}, set before the first step")));
        }
        self.calibration_tokens = tokens;
        Ok(())
    }

    /// `(E, k)` of the expert FFNs (MoEfied, or a MoE file's own), `None` for a dense FFN.
    pub fn moe_shape(&self) -> Option<(u32, u32)> {
        self.moe.as_ref().map(|m| (m.n_experts, m.top_k))
    }

    /// The decode steps' routing as LRU stack distances ([`ReuseCurve`]: the hits an
    /// on-demand LRU expert cache of any size would have had); `None` for the dense model.
    /// Prefill chunks are not in it (an expert cache prefills a token a step).
    pub fn expert_reuse(&self) -> Option<&ReuseCurve> {
        self.moe.as_ref().map(|m| &m.reuse)
    }

    /// Tokens routed to each (layer, expert) so far (`layer * E + e`); empty for the dense model.
    pub fn expert_counts(&self) -> &[u64] {
        self.moe.as_ref().map_or(&[], |m| &m.counts)
    }

    /// One token per sequence at its next position; returns the logits, `[seq][vocab]`.
    ///
    /// The step runs the decode step's stage sequence ([`expertkv_core::step::record()`]) with the
    /// model's products as its source: per layer the projections, RoPE and the K/V packed into
    /// the pool's layout ([`ModelKernels::kv_pack`]; the Q projection and RoPE write the
    /// attention's query buffer), the route stage, the pool's append of the layer's tokens,
    /// compression of pages that left their ring's head, the layer's page lists, attention, and
    /// the FFN (dense, or the router's top-k on the GPU then only the chosen experts; the output
    /// projection reads the attention's output buffer); after the last layer the LM head, the
    /// scheduler's eviction and the route stage's miss recount. One submission, unless the host
    /// tier or an expert cache acts between layers. The host reads the logits back, and the
    /// experts chosen in every layer once at the end.
    pub async fn forward(&mut self, rt: &Runtime, tokens: &[u32]) -> Result<Vec<f32>> {
        if let Some(p) = self.positions.iter().find(|&&p| p >= self.max_context) {
            return Err(Error::Input(format!(
                "a sequence is at position {p}: the pool holds {} tokens per sequence (ModelOptions::max_context)",
                self.max_context
            )));
        }
        let d0 = dispatches_encoded();
        let segments = self.encode_step(rt, tokens)?;
        // With an expert cache, every layer's choices as the host read them between segments.
        let cached_choices = self.submit_step(rt, segments).await?;
        rt.check("model forward")?;
        if let Some(t) = &mut self.timer {
            t.collect(rt, "decode").await?;
        }
        let c = self.cfg.clone();
        let n = self.n_seqs;
        self.kv.pool.check_errors(rt, n * c.block_count).await?;
        let labels = self.label_router_stage();
        let routed = match (&self.moe, labels) {
            (Some(_), Some(r)) => Some(crate::labels::routed_experts(rt, r).await?),
            _ => None,
        };
        if let Some(moe) = &mut self.moe {
            let per_layer = (n * moe.top_k) as usize;
            let log = moe.routed.as_ref().map_or(&moe.log, |r| &r.router.experts);
            let chosen: Vec<u32> = match cached_choices {
                Some(read) => read,
                None => rt.read(log, 0, (per_layer * c.block_count as usize) as u64).await?,
            };
            moe.count(&chosen, per_layer);
            for (l, sel) in chosen.chunks(per_layer).enumerate() {
                moe.reuse.record(l as u32, sel, u64::from(self.step));
            }
            if self.trace.is_some() {
                moe.last_chosen = chosen.clone();
            }
            if let Some(routed) = routed {
                let k = moe.top_k as usize;
                let same = routed.chunks(k).zip(chosen.chunks(k)).filter(|(a, b)| a[0] == b[0]).count();
                self.agreement.0 += same as u64;
                self.agreement.1 += (routed.len() / k) as u64;
            }
        }
        for p in &mut self.positions {
            *p += 1;
        }
        self.step += 1;
        self.dispatches = dispatches_encoded() - d0;
        if self.trace.is_some() {
            self.trace_pass(rt, tokens.len() as u32, Some(tokens), None).await?;
        }
        rt.read(&self.s.logits, 0, u64::from(n * c.vocab_size)).await
    }

    /// End sequence `seq`: every page of it (all layers, KV heads and shards) back to the free
    /// stacks, its host-tier pages dropped, its position back to 0, so a new prompt can take
    /// its place (continuous batching, [`crate::batch`]). The other sequences are untouched.
    pub fn release_sequence(&mut self, rt: &Runtime, seq: u32) -> Result<()> {
        if seq >= self.n_seqs {
            return Err(Error::Input(format!("sequence {seq}: the model decodes {} sequences", self.n_seqs)));
        }
        self.kv.release_sequence(rt, seq)?;
        self.carried_pool = None;
        if let Some((fg, _)) = &mut self.kv.flexgen {
            fg.release_sequence(&self.kv.pool.cfg, seq);
        }
        self.positions[seq as usize] = 0;
        Ok(())
    }

    /// Compute dispatches the last [`GpuLlama::forward`] encoded: the model's kernels, the
    /// pool's append, attention, and the scheduler's, route stage's and host tier's passes (0
    /// before the first step). One step decodes a token of every sequence.
    pub fn dispatches_per_step(&self) -> u64 {
        self.dispatches
    }

    /// Validate a step's tokens, fit a low-rank basis when its window is in, stage the step's
    /// inputs and record the step (see [`GpuLlama::forward`]).
    fn encode_step(&mut self, rt: &Runtime, tokens: &[u32]) -> Result<Vec<Segment<Pause>>> {
        let n = self.n_seqs;
        if tokens.len() != n as usize {
            return Err(Error::Input(format!("{} tokens for {n} sequences", tokens.len())));
        }
        if let Some(t) = tokens.iter().find(|&&t| t >= self.cfg.vocab_size) {
            return Err(Error::Input(format!("token id {t} is outside the vocabulary ({})", self.cfg.vocab_size)));
        }
        // A pool for the whole context holds its positions; one for a budget evicts down to it
        // after every step, so positions run on to `max_context` (checked in `forward`).
        let pc = &self.kv.pool.cfg;
        let cap = (pc.ring_capacity - 1) * pc.page_size - pc.page_size;
        if let Some(p) = self.positions.iter().find(|&&p| p >= cap && self.kept_per_list.is_none()) {
            return Err(Error::Input(format!("position {p} is past the context this model was loaded for ({cap} tokens)")));
        }
        // A low-rank codec fits its basis once the calibration window is in (its pages stayed
        // raw); this step then compresses them.
        self.kv.calibrate_if_due(rt, &self.positions, self.calibration_tokens, expertkv_core::compress::DEFAULT_BASIS_ITERS)?;
        if self.labels.as_ref().is_some_and(|l| l.source.is_none()) {
            return Err(Error::Input(
                "the model was loaded to route its tokens (ModelOptions::routing) but has no routing source: a MoE file, set_moe or set_labels".into(),
            ));
        }
        let c = self.cfg.clone();
        let k = self.kv.pool.cfg.top_k as usize;
        rt.queue.write_buffer(&self.s.tokens, 0, bytemuck::cast_slice(tokens));
        rt.queue.write_buffer(&self.s.positions, 0, bytemuck::cast_slice(&self.positions));
        let new: Vec<NewToken> = (0..c.block_count)
            .flat_map(|l| {
                self.positions.iter().enumerate().map(move |(seq, &position)| NewToken {
                    layer: l,
                    seq: seq as u32,
                    position,
                    // The route stage's choice replaces these on the GPU when it runs.
                    experts: (0..k as u32).collect(),
                    gates: vec![1.0; k],
                })
            })
            .collect();
        // The scheduler evicts with every sequence's length after the step. Tokens are
        // numbered consecutively over the steps and layers (the hash router's ids).
        let lens: Vec<u32> = self.positions.iter().map(|p| p + 1).collect();
        let token_offset = self.step.wrapping_mul(n * c.block_count);
        self.kv.prepare(rt, &new, n, self.step, token_offset, Some(&lens))?;
        if let Some(r) = self.moe.as_ref().and_then(|m| m.routed.as_ref()) {
            // Tokens are numbered consecutively over the steps (the hash router's ids).
            for l in 0..c.block_count {
                r.router.prepare(rt, l, n, self.step.wrapping_mul(n))?;
            }
        }
        let source = Products {
            rec: &self.recorded,
            s: &self.s,
            moe: self.moe.as_ref(),
            labels: self.labels.as_ref().zip(self.kv.route.as_ref()).map(|(l, r)| (l, &r.router)),
            n,
        };
        let run = Run {
            per_layer: n,
            attend: Attend::Decode,
            evict: true,
            miss: true,
            checks: Checks { layers: false, evict: self.verify_evictions },
        };
        let mut rec = Recorder::new(rt, "model forward", self.timer.as_mut().map(|t| &mut t.timer));
        step::record(&self.kv, &source, &mut rec, run)?;
        Ok(rec.finish())
    }

    /// Greedy decoding of one sequence (the model must be loaded for one): feeds `prompt`, then
    /// `n` tokens of its own choosing; returns those.
    pub async fn generate_greedy(&mut self, rt: &Runtime, prompt: &[u32], n: u32) -> Result<Vec<u32>> {
        if self.n_seqs != 1 {
            return Err(Error::Input("generate_greedy decodes one sequence".into()));
        }
        if prompt.is_empty() {
            return Err(Error::Input("an empty prompt".into()));
        }
        let mut logits = Vec::new();
        for &t in prompt {
            logits = self.forward(rt, &[t]).await?;
        }
        let mut out = Vec::new();
        for i in 0..n {
            let next = argmax(&logits);
            out.push(next);
            if i + 1 < n {
                logits = self.forward(rt, &[next]).await?;
            }
        }
        Ok(out)
    }
}

fn f32_matrix(rt: &Runtime, label: &str, rows: u32, cols: u32, v: &[f32]) -> Result<GpuMatrix> {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    GpuMatrix::upload(rt, label, WeightFormat::F32, rows, cols, &bytes)
}

/// Whether the chosen experts are weighted by a kernel, and how: `Some(share)` for a MoE file's
/// softmax (`share`: [`Gating::SoftmaxShare`]), `None` when they weigh 1 (MoEfied experts, or
/// a MoEfied model written as a MoE file: the weights buffer keeps its 1s).
pub(crate) fn softmax_share(c: &LlamaConfig, native: bool) -> Option<bool> {
    match c.expert_gating() {
        _ if !native => None,
        Gating::Unit => None,
        Gating::Softmax => Some(false),
        Gating::SoftmaxShare => Some(true),
    }
}

/// Every layer's router of a MoE file (`ffn_gate_inp`, `[E][hidden]` f32).
fn native_routers(rt: &Runtime, g: &Gguf<'_>, c: &LlamaConfig) -> Result<Vec<GpuMatrix>> {
    (0..c.block_count)
        .map(|l| {
            f32_matrix(
                rt,
                &format!("blk.{l} router"),
                c.expert_count,
                c.embedding_length,
                &g.tensor_f32(&format!("blk.{l}.ffn_gate_inp.weight"))?,
            )
        })
        .collect()
}

/// A MoE file's experts and routers (shapes checked by [`LlamaConfig::check_tensors`]): expert
/// `e` is neurons `e * ffn .. (e + 1) * ffn` of the stacked `ffn_gate_exps` / `ffn_up_exps`, every
/// expert matrix as the file stores it ([`MoeFfn::upload_experts`]), and the router
/// `ffn_gate_inp` as f32.
fn native_experts(rt: &Runtime, g: &Gguf<'_>, c: &LlamaConfig) -> Result<Vec<(GpuMatrix, MoeFfn)>> {
    let (e, h, f) = (c.expert_count, c.embedding_length, c.feed_forward_length);
    let mut layers = Vec::new();
    for l in 0..c.block_count {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        let format = same_format(g, &n("ffn_gate_exps"), &n("ffn_up_exps"))?;
        let down = n("ffn_down_exps");
        let down_format = tensor_format(g, &down)?;
        let experts = MoeFfn::upload_experts(
            rt,
            &format!("blk.{l} experts"),
            (format, g.tensor_data(&n("ffn_gate_exps"))?, g.tensor_data(&n("ffn_up_exps"))?),
            (down_format, g.tensor_data(&down)?),
            h,
            e,
            f,
        )?;
        let router = f32_matrix(rt, &format!("blk.{l} router"), e, h, &g.tensor_f32(&n("ffn_gate_inp"))?)?;
        layers.push((router, experts));
    }
    Ok(layers)
}

/// Index of the largest value (the first of equals; NaNs lose to any number), as the CPU
/// reference's [`crate::math::argmax`].
pub fn argmax(v: &[f32]) -> u32 {
    crate::math::argmax(v)
}
