//! The route stage on the model: every layer, before the layer's K/V are appended, the engine's
//! router ([`expertkv_core::route::Router`], any of the seven, its statistics on the GPU) picks
//! each token's experts, and the append writes them into the slot metadata and places the token
//! in its shard by the pool's shard map, as the synthetic pipeline does.
//!
//! The router's scores come from the layer's own expert router applied to the token's input to
//! the layer (`ffn_norm(x_l) . W_router`), one attention block before the FFN sees the token: a
//! layer's K/V are written (and attended by the token itself) before its FFN runs, so the FFN's
//! own choice is not yet known when the K/V are placed. This is pre-gating; how often its top
//! expert is the FFN's is measured ([`crate::forward::GpuLlama::label_agreement`]). Three
//! sources ([`LabelSource`]): a MoE file's router (`ffn_gate_inp`), a MoEfied model's centroids
//! (the FFN sparse), or the centroids with the FFN left dense (labels only: quality is the dense
//! model's).

use crate::math::{dot, rms_norm};
use crate::ops::{GpuMatrix, ModelKernels, Recorded};
use crate::{Error, Result};
use expertkv_core::config::ShardMap;
use expertkv_core::evict::config::EkvaConfig;
use expertkv_core::route::config::RouterConfig;
use expertkv_core::route::{RouteShape, Router};
use expertkv_core::runtime::Runtime;
use expertkv_core::step::RouteSpec;

/// Where the model's routing labels come from (named in every output that shows them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LabelSource {
    /// A MoE file's own router (`ffn_gate_inp`); the FFN runs the file's experts.
    MoeFile,
    /// A MoEfied model's router (the centroids, or a fitted router); the FFN runs the chosen
    /// experts only.
    Moefied,
    /// The MoEfication's router labels the tokens; the FFN stays dense.
    LabelsOnly,
}

impl LabelSource {
    /// The source in words, for reports and logs ("the MoE file's router", ...).
    pub fn name(self) -> &'static str {
        match self {
            LabelSource::MoeFile => "the MoE file's router",
            LabelSource::Moefied => "the MoEfied FFN's router",
            LabelSource::LabelsOnly => "the MoEfication router, labels only (dense FFN)",
        }
    }
}

/// How the model's pool is sharded and its tokens routed ([`crate::forward::ModelOptions`]).
#[derive(Clone, Debug, PartialEq)]
pub struct KvRouting {
    /// Experts per layer of the routing source (a MoE file's own, or the MoEfication's).
    pub n_experts: u32,
    /// Experts each token carries (a MoE file's own top k, or the MoEfication's).
    pub top_k: u32,
    /// The route stage's router.
    pub router: RouterConfig,
    /// Shards per (layer, sequence), and how tokens map onto them.
    pub n_shards: u32,
    /// Which of its (layer, sequence)'s shards a token goes to ([`ShardMap::ByExpert`] from
    /// [`KvRouting::new`]).
    pub shard_map: ShardMap,
    /// EKVA: split an evicting scheduler's budget across experts by importance.
    pub allocator: Option<EkvaConfig>,
}

impl KvRouting {
    /// `top_k` of `n_experts`, routed by their plain top k, one shard, no allocator.
    pub fn new(n_experts: u32, top_k: u32) -> Self {
        KvRouting { n_experts, top_k, router: RouterConfig::Topk, n_shards: 1, shard_map: ShardMap::ByExpert, allocator: None }
    }

    /// Refuse shapes that cannot work, naming both parts.
    pub fn validate(&self) -> Result<()> {
        if self.n_experts == 0 || self.top_k == 0 || self.top_k > self.n_experts {
            return Err(Error::config("top_k", self.top_k, format!("must be in 1..={} (the routing source's experts)", self.n_experts)));
        }
        if self.n_shards == 0 {
            return Err(Error::config("shards", self.n_shards, "at least one shard"));
        }
        Ok(())
    }
}

impl KvRouting {
    /// The route stage these labels need on the K/V side ([`expertkv_core::step::KvSideConfig`]):
    /// `tokens` a layer and step.
    pub fn route_spec(&self, tokens: u32) -> RouteSpec {
        RouteSpec { router: self.router.clone(), n_experts: self.n_experts, max_tokens: tokens, ema: 0.1 }
    }
}

/// The route stage's scores on the model: once a routing source is installed, each layer's
/// tokens scored by its router from the residual stream, written into the route stage's
/// logits (the router itself, with its statistics, is the K/V side's:
/// [`expertkv_core::step::KvSide::route`]).
pub(crate) struct KvLabels {
    scores: wgpu::Buffer,
    xr: wgpu::Buffer,
    /// The routing source, once installed ([`KvLabels::install`]).
    pub source: Option<LabelSource>,
    /// Per layer: `ffn_norm(x_l)` into `xr`, then the router's weights times it into `scores`.
    recorded: Vec<Recorded>,
    /// Kept alive for the recorded bind groups.
    _weights: Vec<GpuMatrix>,
}

/// The inputs of the route stage's scoring: the model's residual stream, each layer's FFN norm,
/// the hidden size and the norm's epsilon.
pub(crate) struct ScoreInputs<'a> {
    pub h: &'a wgpu::Buffer,
    pub ffn_norms: Vec<&'a wgpu::Buffer>,
    pub hidden: u32,
    pub eps: f32,
}

impl KvLabels {
    /// Scores for `n` tokens a layer and step of `routing`'s experts, with no routing source yet.
    pub(crate) fn new(rt: &Runtime, routing: &KvRouting, n: u32, hidden: u32) -> Result<KvLabels> {
        routing.validate()?;
        let xr = rt.storage("labels xr", u64::from(n * hidden) * 4);
        let scores = rt.storage("labels scores", u64::from(n * routing.n_experts) * 4);
        Ok(KvLabels { scores, xr, source: None, recorded: Vec::new(), _weights: Vec::new() })
    }

    /// Score with `weights` (per layer `[E][hidden]` f32, row-major) from now on, for `router`'s
    /// layers, experts and tokens.
    pub(crate) fn install(
        &mut self,
        rt: &Runtime,
        kernels: &ModelKernels,
        (source, router): (LabelSource, &Router),
        weights: &[Vec<f32>],
        inputs: ScoreInputs<'_>,
    ) -> Result<()> {
        let ScoreInputs { h, ffn_norms, hidden, eps } = inputs;
        let RouteShape { n_experts: e, layers, max_tokens: n, .. } = router.shape;
        if self.source.is_some() {
            return Err(Error::config(
                "labels",
                source.name(),
                format!("the tokens are already routed by {}", self.source.map_or("", |s| s.name())),
            ));
        }
        if weights.len() != layers as usize
            || ffn_norms.len() != layers as usize
            || weights.iter().any(|w| w.len() != (e * hidden) as usize)
        {
            return Err(Error::Model(format!("the routing labels need {layers} routers of {e} experts x {hidden}")));
        }
        let mut mats = Vec::new();
        let mut recorded = Vec::new();
        for (l, (w, norm)) in weights.iter().zip(&ffn_norms).enumerate() {
            let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
            let m = GpuMatrix::upload(rt, &format!("blk.{l} label router"), crate::ops::WeightFormat::F32, e, hidden, &bytes)?;
            let mut p = Recorded::default();
            kernels.rmsnorm(rt, &mut p, h, norm, &self.xr, n, hidden, eps);
            kernels.matvec(rt, &mut p, &m, &self.xr, &self.scores, n)?;
            recorded.push(p);
            mats.push(m);
        }
        (self.source, self.recorded, self._weights) = (Some(source), recorded, mats);
        rt.check("routing labels")
    }

    /// Score layer `l`'s tokens into `router`'s logits (once the layer's input is in the
    /// residual stream; the route stage routes them before the layer's append).
    pub(crate) fn encode_scores<P>(&self, rec: &mut expertkv_core::step::Recorder<'_, P>, router: &Router, l: u32) {
        let RouteShape { n_experts: e, max_tokens: n, .. } = router.shape;
        let (e, n64) = (u64::from(e), u64::from(n));
        rec.pass("route", |p| self.recorded[l as usize].encode(p));
        rec.enc().copy_buffer_to_buffer(&self.scores, 0, &router.logits, u64::from(l) * n64 * e * 4, n64 * e * 4);
    }
}

/// The experts the route stage chose in the last step, `[layer][token][k]`, in one read (the
/// router's rows per layer are exactly the step's tokens).
pub(crate) async fn routed_experts(rt: &Runtime, router: &Router) -> Result<Vec<u32>> {
    let RouteShape { layers, max_tokens, top_k, .. } = router.shape;
    rt.read(&router.experts, 0, u64::from(layers * max_tokens * top_k)).await
}

/// Their gates, laid out as [`routed_experts`].
pub(crate) async fn routed_gates(rt: &Runtime, router: &Router) -> Result<Vec<f32>> {
    let RouteShape { layers, max_tokens, top_k, .. } = router.shape;
    rt.read(&router.gates, 0, u64::from(layers * max_tokens * top_k)).await
}

/// The CPU reference of the route stage's scores: `W_router . ffn_norm(x)` for a layer input
/// `x` (the residual stream entering the layer), `[E]`.
pub fn reference_scores(x: &[f32], ffn_norm: &[f32], eps: f32, router: &[f32]) -> Vec<f32> {
    let mut xr = vec![0f32; x.len()];
    rms_norm(x, ffn_norm, eps, &mut xr);
    router.chunks(x.len()).map(|row| dot(row, &xr)).collect()
}
