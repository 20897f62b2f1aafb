//! Routing on the GPU: the seven routers as bias + top-k kernels, and the statistics they read
//! (per-(layer, expert) load, miss rate from the KV pool, the adaptive router's learned bias),
//! all updated by kernels so that no host round trip sits between steps.

pub mod config;

use expertkv_shaders::Kernel;

use crate::append::KvPool;
use crate::error::{Error, Result};
use crate::gpu_data::{ExpertStats, RouteParams, RouteSummary};
use crate::route::config::RouterConfig;
use crate::runtime::dispatch::CountedDispatch;
use crate::runtime::{Runtime, grid, split_workgroups};

/// Shape of the routing problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteShape {
    /// Experts per layer, in 1..=256.
    pub n_experts: u32,
    /// Experts chosen per token, in 1..=min(8, n_experts); a bound pool must keep the same.
    pub top_k: u32,
    /// Layers routed, each with its own rows, parameter block and statistics.
    pub layers: u32,
    /// Most tokens routed per call.
    pub max_tokens: u32,
}

/// Tokens per workgroup of the gradient pass (`route/adaptive.wgsl`).
const GRAD_BLOCK: u32 = 64;

/// One router on the GPU for every layer: its kernels, their buffers (rows of layer l start at
/// token `l * max_tokens`) and the per-(layer, expert) statistics it routes by.
pub struct Router {
    /// Which router, with its parameters.
    pub cfg: RouterConfig,
    /// Experts, top-k, layers and tokens per call.
    pub shape: RouteShape,
    /// Weight of the newest step in the moving-average load.
    pub ema: f32,
    bias_pipe: wgpu::ComputePipeline,
    topk_pipe: wgpu::ComputePipeline,
    count_pipe: wgpu::ComputePipeline,
    stats_pipe: wgpu::ComputePipeline,
    grad_pipe: Option<wgpu::ComputePipeline>,
    update_pipe: Option<wgpu::ComputePipeline>,
    miss_count_pipe: wgpu::ComputePipeline,
    miss_finish_pipe: wgpu::ComputePipeline,
    /// One parameter block per layer, so every layer can be routed in one submission.
    params: Vec<wgpu::Buffer>,
    /// Router logits, f32 `[layer][token][expert]`, `max_tokens` tokens per layer.
    pub logits: wgpu::Buffer,
    /// f32 score bias per expert, rewritten by each call's bias pass: the last routed layer's.
    pub bias: wgpu::Buffer,
    /// Chosen experts, u32 `[layer][token][k]`, best first, `max_tokens` tokens per layer.
    pub experts: wgpu::Buffer,
    /// Gate weights of the chosen experts, f32 `[layer][token][k]` (the model's softmax
    /// renormalised over the k).
    pub gates: wgpu::Buffer,
    _counts: wgpu::Buffer,
    /// [`ExpertStats`] per (layer, expert), layer-major: load, miss rate, learned bias.
    pub stats: wgpu::Buffer,
    /// One [`RouteSummary`] per layer: entropy and cost of its last step.
    pub summary: wgpu::Buffer,
    resident: wgpu::Buffer,
    _partials: wgpu::Buffer,
    groups: Vec<LayerBinds>,
    miss_binds: Option<(wgpu::BindGroup, wgpu::BindGroup, u32)>,
}

struct LayerBinds {
    bias: wgpu::BindGroup,
    topk: wgpu::BindGroup,
    count: wgpu::BindGroup,
    stats: wgpu::BindGroup,
    grad: Option<wgpu::BindGroup>,
    update: Option<wgpu::BindGroup>,
}

impl Router {
    /// Build the router's kernels and buffers. `ema` (in [0, 1]) weighs the newest step in the
    /// moving-average load; every expert's load starts at 1 / n_experts.
    pub async fn new(rt: &Runtime, cfg: RouterConfig, shape: RouteShape, ema: f32) -> Result<Router> {
        cfg.validate(shape.n_experts, shape.top_k)?;
        if !(0.0..=1.0).contains(&ema) {
            return Err(Error::config("ema", ema, "must be in [0, 1]"));
        }
        if shape.max_tokens == 0 || shape.layers == 0 {
            return Err(Error::config("max_tokens", shape.max_tokens, "tokens and layers must be at least 1"));
        }
        let (e, k, l) = (u64::from(shape.n_experts), u64::from(shape.top_k), u64::from(shape.layers));
        // Logits, experts and gates hold every layer's tokens: layer l's start at l * max_tokens.
        let t = u64::from(shape.max_tokens) * l;
        rt.fits_binding("router logits", t * e * 4)?;
        let adaptive = matches!(cfg, RouterConfig::Adaptive { .. });
        let bias_pipe = rt.pipeline(Kernel::RouteBias, &[]).await?;
        let topk_groups = match cfg {
            RouterConfig::Hierarchical { topk_groups, .. } => topk_groups,
            _ => 1,
        };
        let topk_pipe = rt
            .pipeline_with(
                Kernel::RouteTopk,
                &[
                    ("K", format!("{}u", shape.top_k)),
                    ("TOPK_GROUPS", format!("{topk_groups}u")),
                    ("E_VEC4", shape.n_experts.is_multiple_of(4).to_string()),
                ],
                &[],
            )
            .await?;
        let count_pipe = rt.pipeline(Kernel::RouteCount, &[]).await?;
        let stats_pipe = rt.pipeline(Kernel::RouteStats, &[]).await?;
        let grad_pipe = if adaptive { Some(rt.pipeline(Kernel::RouteAdaptiveGrad, &[]).await?) } else { None };
        let update_pipe = if adaptive { Some(rt.pipeline(Kernel::RouteAdaptiveUpdate, &[]).await?) } else { None };
        let miss_count_pipe = rt.pipeline(Kernel::RouteMissCount, &[]).await?;
        let miss_finish_pipe = rt.pipeline(Kernel::RouteMissFinish, &[]).await?;

        let params: Vec<wgpu::Buffer> =
            (0..shape.layers).map(|l| rt.uniform(&format!("route params[{l}]"), &RouteParams::default())).collect();
        let logits = rt.storage("route logits", t * e * 4);
        let bias = rt.storage("route bias", e * 4);
        let experts = rt.storage("route experts", t * k * 4);
        let gates = rt.storage("route gates", t * k * 4);
        let counts = rt.storage("route counts", e * 4);
        let init = ExpertStats { load: 1.0 / shape.n_experts as f32, ..Default::default() };
        let stats = rt.storage_init("route stats", &vec![init; (l * e) as usize]);
        let summary = rt.storage_init("route summary", &vec![RouteSummary::default(); l as usize]);
        let resident = rt.storage("route resident", l * e * 4);
        let n_partials = shape.max_tokens.div_ceil(GRAD_BLOCK);
        let partials = rt.storage("route/adaptive partials", if adaptive { u64::from(n_partials) * (e + 2) * 4 } else { 4 });
        let groups = params
            .iter()
            .map(|p| LayerBinds {
                bias: rt.bind(Kernel::RouteBias.label(), &bias_pipe, &[p, &stats, &bias]),
                topk: rt.bind(Kernel::RouteTopk.label(), &topk_pipe, &[p, &logits, &bias, &experts, &gates, &logits]),
                count: rt.bind(Kernel::RouteCount.label(), &count_pipe, &[p, &experts, &counts]),
                stats: rt.bind(Kernel::RouteStats.label(), &stats_pipe, &[p, &counts, &stats, &summary]),
                grad: grad_pipe.as_ref().map(|g| {
                    rt.bind_at(Kernel::RouteAdaptiveGrad.label(), g, &[(0, p), (1, &logits), (2, &bias), (3, &stats), (4, &partials)])
                }),
                update: update_pipe
                    .as_ref()
                    .map(|u| rt.bind_at(Kernel::RouteAdaptiveUpdate.label(), u, &[(0, p), (3, &stats), (4, &partials), (5, &summary)])),
            })
            .collect();
        rt.check("router setup")?;
        Ok(Router {
            cfg,
            shape,
            ema,
            bias_pipe,
            topk_pipe,
            count_pipe,
            stats_pipe,
            grad_pipe,
            update_pipe,
            miss_count_pipe,
            miss_finish_pipe,
            params,
            logits,
            bias,
            experts,
            gates,
            _counts: counts,
            stats,
            summary,
            resident,
            _partials: partials,
            groups,
            miss_binds: None,
        })
    }

    /// The parameter block of one call.
    pub fn params(&self, layer: u32, n_tokens: u32, token_offset: u32) -> RouteParams {
        let mut p = RouteParams {
            n_tokens,
            n_experts: self.shape.n_experts,
            top_k: self.shape.top_k,
            token_offset,
            n_partials: n_tokens.div_ceil(GRAD_BLOCK),
            ema: self.ema,
            layer,
            token_base: layer * self.shape.max_tokens,
            ..Default::default()
        };
        self.cfg.fill(&mut p);
        p
    }

    /// Upload router logits of `first_layer` and the layers after it, `[layer][token][expert]`
    /// with `max_tokens` tokens per layer (the last layer given may hold fewer); non-finite
    /// values are refused.
    pub fn set_logits(&self, rt: &Runtime, first_layer: u32, logits: &[f32]) -> Result<()> {
        let e = self.shape.n_experts as usize;
        let room = (self.shape.layers.saturating_sub(first_layer) * self.shape.max_tokens) as usize;
        if !logits.len().is_multiple_of(e) || logits.len() / e > room {
            return Err(Error::Input(format!(
                "router logits: {} values is not a whole number of tokens of {e} experts, or more than the {room} tokens from layer {first_layer} on",
                logits.len(),
            )));
        }
        if let Some(i) = logits.iter().position(|v| !v.is_finite()) {
            return Err(Error::Input(format!("router logits: value {i} (token {}, expert {}) is {}", i / e, i % e, logits[i])));
        }
        let offset = u64::from(first_layer * self.shape.max_tokens) * e as u64 * 4;
        rt.queue.write_buffer(&self.logits, offset, bytemuck::cast_slice(logits));
        Ok(())
    }

    /// Stage the parameters of `layer` for the next submission (one call per layer per submission).
    pub fn prepare(&self, rt: &Runtime, layer: u32, n_tokens: u32, token_offset: u32) -> Result<()> {
        if layer >= self.shape.layers || n_tokens == 0 || n_tokens > self.shape.max_tokens {
            return Err(Error::Input(format!(
                "route call: layer {layer} of {}, {n_tokens} tokens of at most {}",
                self.shape.layers, self.shape.max_tokens
            )));
        }
        let p = self.params(layer, n_tokens, token_offset);
        rt.queue.write_buffer(&self.params[layer as usize], 0, bytemuck::bytes_of(&p));
        Ok(())
    }

    /// Bias and top-k only (what `bench route` times).
    pub fn encode_select(&self, pass: &mut wgpu::ComputePass<'_>, layer: u32, n_tokens: u32) {
        let b = &self.groups[layer as usize];
        pass.set_pipeline(&self.bias_pipe);
        pass.set_bind_group(0, &b.bias, &[]);
        pass.dispatch_counted(1, 1, 1);
        pass.set_pipeline(&self.topk_pipe);
        pass.set_bind_group(0, &b.topk, &[]);
        let (x, y) = grid(n_tokens);
        pass.dispatch_counted(x, y, 1);
    }

    /// A whole routing step of `layer`: bias, top-k, statistics, and the adaptive router's update.
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>, layer: u32, n_tokens: u32) {
        self.encode_select(pass, layer, n_tokens);
        let b = &self.groups[layer as usize];
        let (x, y) = grid(n_tokens);
        pass.set_pipeline(&self.count_pipe);
        pass.set_bind_group(0, &b.count, &[]);
        pass.dispatch_counted(x, y, 1);
        pass.set_pipeline(&self.stats_pipe);
        pass.set_bind_group(0, &b.stats, &[]);
        pass.dispatch_counted(1, 1, 1);
        if let (Some(g), Some(u), Some(gb), Some(ub)) = (&self.grad_pipe, &self.update_pipe, &b.grad, &b.update) {
            pass.set_pipeline(g);
            pass.set_bind_group(0, gb, &[]);
            pass.dispatch_counted(n_tokens.div_ceil(GRAD_BLOCK), 1, 1);
            pass.set_pipeline(u);
            pass.set_bind_group(0, ub, &[]);
            pass.dispatch_counted(1, 1, 1);
        }
    }

    /// Route `n_tokens` tokens of `layer` whose logits were set, in its own submission.
    pub fn run(&self, rt: &Runtime, layer: u32, n_tokens: u32, token_offset: u32) -> Result<()> {
        self.prepare(rt, layer, n_tokens, token_offset)?;
        let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("route") });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("route"), timestamp_writes: None });
            self.encode(&mut pass, layer, n_tokens);
        }
        rt.queue.submit([enc.finish()]);
        rt.check("route")
    }

    /// Bind the KV pool whose slots the miss-rate pass counts (its top_k must be the router's).
    pub fn bind_pool(&mut self, rt: &Runtime, pool: &KvPool) -> Result<()> {
        if pool.cfg.top_k != self.shape.top_k || pool.cfg.layers != self.shape.layers {
            return Err(Error::config(
                "top_k",
                pool.cfg.top_k,
                format!(
                    "the pool keeps top_k = {} over {} layers, the router routes top_k = {} over {}",
                    pool.cfg.top_k, pool.cfg.layers, self.shape.top_k, self.shape.layers
                ),
            ));
        }
        let p = &self.params[0];
        let a = rt.bind_at(
            Kernel::RouteMissCount.label(),
            &self.miss_count_pipe,
            &[
                (0, &pool.geometry),
                (1, p),
                (2, &pool.page_meta),
                (3, &pool.slot_meta),
                (4, &self.resident),
                (6, &pool.rings),
                (7, &pool.ring_pages),
            ],
        );
        let b = rt.bind_at(
            Kernel::RouteMissFinish.label(),
            &self.miss_finish_pipe,
            &[(0, &pool.geometry), (1, p), (4, &self.resident), (5, &self.stats)],
        );
        self.miss_binds = Some((a, b, pool.cfg.n_keys()));
        Ok(())
    }

    /// Recount each (layer, expert)'s tokens still in the pool and set its miss rate. Reads the
    /// layer-0 parameter block for n_experts (prepare any layer first).
    pub fn encode_miss(&self, pass: &mut wgpu::ComputePass<'_>) -> Result<()> {
        let Some((a, b, keys)) = &self.miss_binds else {
            return Err(Error::Input("the router has no pool bound: call bind_pool first".into()));
        };
        pass.set_pipeline(&self.miss_count_pipe);
        pass.set_bind_group(0, a, &[]);
        // One workgroup per shard ring.
        let keys = *keys;
        let [x, y] = split_workgroups(keys);
        pass.dispatch_counted(x, y, 1);
        pass.set_pipeline(&self.miss_finish_pipe);
        pass.set_bind_group(0, b, &[]);
        pass.dispatch_counted((self.shape.layers * self.shape.n_experts).div_ceil(64), 1, 1);
        Ok(())
    }

    /// Update miss rates from the pool in its own submission.
    pub fn update_miss(&self, rt: &Runtime) -> Result<()> {
        // n_experts comes from the layer-0 block; make sure it is written.
        let p = self.params(0, 1, 0);
        rt.queue.write_buffer(&self.params[0], 0, bytemuck::bytes_of(&p));
        let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("route/miss") });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("route/miss"), timestamp_writes: None });
            self.encode_miss(&mut pass)?;
        }
        rt.queue.submit([enc.finish()]);
        rt.check("route/miss")
    }

    /// Chosen experts of the first `n_tokens` tokens of `layer`, `[token][k]`.
    pub async fn read_experts(&self, rt: &Runtime, layer: u32, n_tokens: u32) -> Result<Vec<u32>> {
        let k = u64::from(self.shape.top_k);
        rt.read(&self.experts, u64::from(layer * self.shape.max_tokens) * k, u64::from(n_tokens) * k).await
    }

    /// Gate weights of the first `n_tokens` tokens of `layer`, `[token][k]`.
    pub async fn read_gates(&self, rt: &Runtime, layer: u32, n_tokens: u32) -> Result<Vec<f32>> {
        let k = u64::from(self.shape.top_k);
        rt.read(&self.gates, u64::from(layer * self.shape.max_tokens) * k, u64::from(n_tokens) * k).await
    }

    /// The last routed layer's bias, and the chosen experts and gates of the first `n_tokens`
    /// tokens of `layer` (that layer, when checking what it just routed): one readback for
    /// [`Router::read_bias`], [`Router::read_experts`] and [`Router::read_gates`].
    pub async fn read_choice(&self, rt: &Runtime, layer: u32, n_tokens: u32) -> Result<(Vec<f32>, Vec<u32>, Vec<f32>)> {
        let k = u64::from(self.shape.top_k);
        let at = u64::from(layer * self.shape.max_tokens) * k;
        let n = u64::from(n_tokens) * k;
        let mut r =
            rt.read_many::<u32>(&[(&self.bias, 0, u64::from(self.shape.n_experts)), (&self.experts, at, n), (&self.gates, at, n)]).await?;
        let f = |w: Vec<u32>| w.into_iter().map(f32::from_bits).collect::<Vec<f32>>();
        let gates = f(r.pop().unwrap_or_default());
        let experts = r.pop().unwrap_or_default();
        Ok((f(r.pop().unwrap_or_default()), experts, gates))
    }

    /// The per-expert score bias of the last routed layer.
    pub async fn read_bias(&self, rt: &Runtime) -> Result<Vec<f32>> {
        rt.read(&self.bias, 0, u64::from(self.shape.n_experts)).await
    }

    /// Statistics of every (layer, expert), layer-major.
    pub async fn read_stats(&self, rt: &Runtime) -> Result<Vec<ExpertStats>> {
        rt.read_all(&self.stats).await
    }

    /// The routing summary of every layer.
    pub async fn read_summary(&self, rt: &Runtime) -> Result<Vec<RouteSummary>> {
        rt.read_all(&self.summary).await
    }

    /// Overwrite the statistics (tests and what-if runs).
    pub fn write_stats(&self, rt: &Runtime, stats: &[ExpertStats]) -> Result<()> {
        if stats.len() != (self.shape.layers * self.shape.n_experts) as usize {
            return Err(Error::Input(format!(
                "stats: {} entries, expected layers x experts = {}",
                stats.len(),
                self.shape.layers * self.shape.n_experts
            )));
        }
        rt.queue.write_buffer(&self.stats, 0, bytemuck::cast_slice(stats));
        Ok(())
    }
}
