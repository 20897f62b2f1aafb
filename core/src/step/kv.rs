//! The K/V side of a step, configured in one place ([`KvSide::new`]): the pool, its attention,
//! the route stage, and the policy acting on the pool (an evicting scheduler, QUEST's page
//! selection or FlexGen's host tier), for the synthetic workload and a model alike.

use crate::append::format::NewToken;
use crate::append::{KvPool, Routed, StagedRouting};
use crate::attend::{AttendOptions, Attention};
use crate::config::PoolConfig;
use crate::error::{Error, Result};
use crate::evict::config::{EkvaConfig, SchedulerConfig, Threshold};
use crate::evict::flexgen::{FlexGen, PageFetch};
use crate::evict::quest::Quest;
use crate::evict::recall::{RecallConfig, RecallTier};
use crate::evict::{AllocatorSpec, Scheduler};
use crate::route::config::RouterConfig;
use crate::route::{RouteShape, Router};
use crate::runtime::Runtime;

/// What [`KvSide::new`] builds: the pool, the policy over it and the route stage.
#[derive(Clone, Debug)]
pub struct KvSideConfig {
    /// The pool (its layers, sequences, KV heads, codec and shards).
    pub pool: PoolConfig,
    /// The policy over the pool and its budget in tokens per (layer, sequence, KV head): an
    /// evicting scheduler, QUEST (attention reads the best pages of a whole cache) or FlexGen
    /// (the rest of the context in host memory); `None` keeps the whole cache.
    pub policy: Option<(SchedulerConfig, u32)>,
    /// PyramidKV over an evicting scheduler: the first layer's budget over the last's.
    pub pyramid: Option<f32>,
    /// An evicting scheduler's utility threshold.
    pub threshold: Threshold,
    /// EKVA over an evicting scheduler: every list's budget split over expert groups (needs the
    /// route stage).
    pub allocator: Option<EkvaConfig>,
    /// Query heads per KV head.
    pub group: u32,
    /// Pages per chunk of decode attention's split pass.
    pub chunk_pages: u32,
    /// The route stage: every layer's new tokens routed to experts before their append.
    pub route: Option<RouteSpec>,
    /// The recall tier under an evicting scheduler: every victim kept, each list's best evicted
    /// pages attended at every layer ([`crate::evict::recall`]).
    pub recall: Option<RecallConfig>,
}

/// The route stage's router ([`KvSideConfig::route`]).
#[derive(Clone, Debug, PartialEq)]
pub struct RouteSpec {
    /// Which router.
    pub router: RouterConfig,
    /// Experts per layer (each token carries the pool's `top_k` of them).
    pub n_experts: u32,
    /// Most tokens one layer routes in one run of the stages (its router rows).
    pub max_tokens: u32,
    /// Weight of the newest step in the routers' moving-average load.
    pub ema: f32,
}

impl KvSideConfig {
    /// Refuse what cannot work together, naming the parts: a policy with the pool's codec, an
    /// evicting scheduler's budget, the shapes of an evicting scheduler's budget without one,
    /// EKVA without the route stage.
    pub fn validate(&self) -> Result<()> {
        self.pool.validate()?;
        let evicting = self.policy.as_ref().filter(|(s, _)| s.uses_evict_kernels());
        if let Some((s, _)) = &self.policy {
            s.check_codec(self.pool.codec)?;
        }
        if let Some((s, b)) = evicting {
            s.validate(*b)?;
        }
        if evicting.is_none() && (self.pyramid.is_some() || self.threshold != Threshold::default() || self.allocator.is_some()) {
            let what = if self.allocator.is_some() {
                "allocator"
            } else if self.pyramid.is_some() {
                "pyramid"
            } else {
                "threshold"
            };
            return Err(Error::config(
                what,
                self.policy.as_ref().map_or("none", |(s, _)| s.name()),
                "shapes an evicting scheduler's budget: give one (h2o, streaming-llm, lru, lru-plus, adakv, duo, fastv-tokens)",
            ));
        }
        if let Some(r) = &self.recall {
            if evicting.is_none() {
                return Err(Error::config(
                    "recall",
                    r.pages,
                    "recalls what an evicting scheduler removes: give one (h2o, streaming-llm, lru, lru-plus, adakv, duo, fastv-tokens)",
                ));
            }
            r.validate(self.pool.page_size, self.group, self.pool.head_dim)?;
        }
        if let Some(a) = &self.allocator {
            a.validate()?;
            if self.route.is_none() {
                return Err(Error::config(
                    "allocator",
                    "ekva",
                    "splits the budget over the experts the route stage chooses: route the tokens",
                ));
            }
        }
        Ok(())
    }
}

/// The route stage over a pool: the router, and each layer's pass copying its choice into the
/// append's token records (bound for the staged batch size).
pub struct RouteStage {
    /// The router; its `logits` rows are the step's source's to fill.
    pub router: Router,
    staged: Vec<StagedRouting>,
    per_batch: u32,
}

impl RouteStage {
    /// Layer `l`'s routing pass of the staged batch (bound by [`KvSide::prepare`]).
    pub fn staged(&self, l: u32) -> Option<&StagedRouting> {
        self.staged.get(l as usize)
    }

    /// The router's rows of `per_batch` tokens a layer, for `pool`'s staged appends: one
    /// routing pass per layer.
    pub fn bind(&self, rt: &Runtime, pool: &mut KvPool, per_batch: u32) -> Result<Vec<StagedRouting>> {
        let r = &self.router;
        let routed = Routed { experts: &r.experts, gates: &r.gates, per_layer: per_batch, row_stride: r.shape.max_tokens, first_layer: 0 };
        (0..pool.cfg.layers).map(|l| pool.bind_staged_routing(rt, routed, l, per_batch)).collect()
    }

    /// The router's rows of layer `layer`'s `per_layer` tokens, as an append takes them.
    pub fn routed(&self, layer: u32, per_layer: u32) -> Routed<'_> {
        let r = &self.router;
        Routed { experts: &r.experts, gates: &r.gates, per_layer, row_stride: r.shape.max_tokens, first_layer: layer }
    }
}

/// The K/V side of a step: what the stages between a source's products act on.
pub struct KvSide {
    /// The paged, sharded pool.
    pub pool: KvPool,
    /// Decode attention over the pool (under QUEST, over its selected pages).
    pub attn: Attention,
    /// The route stage, when tokens are routed to experts before their append.
    pub route: Option<RouteStage>,
    /// The evicting scheduler, run after every step; `None` without one and under QUEST and
    /// FlexGen, which select or place pages instead.
    pub scheduler: Option<Scheduler>,
    /// QUEST page selection before every layer's attention.
    pub quest: Option<Quest>,
    /// FlexGen's host tier, with the QUEST page bounds it scores host pages by.
    pub flexgen: Option<(FlexGen, Quest)>,
    /// The recall tier: the scheduler's victims, and each list's best of them attended.
    pub recall: Option<RecallTier>,
}

impl KvSide {
    /// Check `cfg` and build its pool, attention, route stage and policy.
    pub async fn new(rt: &Runtime, cfg: &KvSideConfig) -> Result<KvSide> {
        cfg.validate()?;
        let pool = KvPool::new(rt, cfg.pool.clone()).await?;
        let route = match &cfg.route {
            Some(r) => {
                let shape = RouteShape { n_experts: r.n_experts, top_k: cfg.pool.top_k, layers: cfg.pool.layers, max_tokens: r.max_tokens };
                let mut router = Router::new(rt, r.router.clone(), shape, r.ema).await?;
                router.bind_pool(rt, &pool)?;
                Some(RouteStage { router, staged: Vec::new(), per_batch: 0 })
            }
            None => None,
        };
        let attend_opts = AttendOptions {
            group: cfg.group,
            n_seqs: cfg.pool.max_seqs,
            chunk_pages: cfg.chunk_pages,
            // The attention mass feeds the evicting and placing policies (utilities, the host
            // tier's coldest pages); the whole cache and QUEST do without it.
            mass: cfg.policy.as_ref().is_some_and(|(s, _)| s.evicts()),
            recall: cfg.recall.is_some(),
            ..Default::default()
        };
        let (mut attn, mut quest, mut flexgen, mut scheduler) = (None, None, None, None);
        match &cfg.policy {
            Some((SchedulerConfig::Quest, budget)) => {
                let mut q = Quest::new(rt, &pool, *budget).await?;
                let a = Attention::with_lists(rt, &pool, attend_opts.clone(), Some((&q.sel_list, &q.sel_counts))).await?;
                q.bind(rt, &pool, &a);
                (attn, quest) = (Some(a), Some(q));
            }
            Some((SchedulerConfig::FlexGen, budget)) => {
                flexgen = Some((FlexGen::new(&pool, *budget)?, Quest::new(rt, &pool, *budget).await?));
            }
            Some((s, budget)) => {
                let allocator = cfg.allocator.zip(cfg.route.as_ref()).map(|(a, r)| AllocatorSpec {
                    cfg: a,
                    n_experts: r.n_experts,
                    route_stats: route.as_ref().map(|x| &x.router.stats),
                });
                scheduler = Some(Scheduler::with_allocator(rt, &pool, s.clone(), *budget, cfg.pyramid, cfg.threshold, allocator).await?);
            }
            None => {}
        }
        let attn = match attn {
            Some(a) => a,
            None => Attention::new(rt, &pool, attend_opts).await?,
        };
        let recall = match (cfg.recall, &mut scheduler) {
            (Some(rc), Some(s)) => {
                let mut tier = RecallTier::new(rt, &pool, rc, cfg.group).await?;
                s.capture_into(rt, &pool, &tier).await?;
                tier.bind_attention(rt, &pool, &attn).await?;
                Some(tier)
            }
            _ => None,
        };
        Ok(KvSide { pool, attn, route, scheduler, quest, flexgen, recall })
    }

    /// Stage a run of the stages (before it is recorded): the append of `tokens` (`[layer][token]`,
    /// `per_layer` a layer; the route stage replaces their experts and gates), the route stage's
    /// parameters (tokens numbered from `token_offset`, the hash router's ids), the attention's
    /// and QUEST's parameters of every layer, and, when `evict`, the scheduler's with the
    /// sequences' lengths after the run.
    pub fn prepare(
        &mut self,
        rt: &Runtime,
        tokens: &[NewToken],
        per_layer: u32,
        step: u32,
        token_offset: u32,
        evict_lens: Option<&[u32]>,
    ) -> Result<()> {
        let layers = self.pool.cfg.layers;
        if tokens.len() as u64 != u64::from(per_layer) * u64::from(layers) {
            return Err(Error::Input(format!(
                "a run of the stages appends {per_layer} tokens to each of {layers} layers, got {}",
                tokens.len()
            )));
        }
        self.pool.stage_append(rt, tokens, per_layer, step)?;
        if let Some(r) = &mut self.route {
            for l in 0..layers {
                r.router.prepare(rt, l, per_layer, token_offset.wrapping_add(l * per_layer))?;
            }
            let fits = r.per_batch == per_layer && r.staged.first().is_some_and(|s| self.pool.staged_routing_fits(s, per_layer));
            if !fits {
                r.staged = r.bind(rt, &mut self.pool, per_layer)?;
                r.per_batch = per_layer;
            }
        }
        self.attn.stage_params(rt, step, layers);
        if let Some(q) = &self.quest {
            for l in 0..layers {
                q.prepare(rt, l, &self.attn);
            }
        }
        if let (Some(s), Some(lens)) = (&self.scheduler, evict_lens) {
            s.prepare(rt, step, lens)?;
        }
        Ok(())
    }

    /// Fit a low-rank codec's basis once every sequence is past `window` positions (its
    /// calibration window, kept raw until then); true when it did.
    pub fn calibrate_if_due(&mut self, rt: &Runtime, positions: &[u32], window: u32, iters: u32) -> Result<bool> {
        if self.pool.cfg.codec.is_low_rank() && !self.pool.calibrated && positions.iter().all(|&p| p >= window) {
            self.pool.calibrate(rt, iters)?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Release sequence `seq`: its pages back to the pool's free stacks and its recall tier
    /// emptied (a host tier's pages are the caller's: FlexGen keeps its own).
    pub fn release_sequence(&self, rt: &Runtime, seq: u32) -> Result<()> {
        self.pool.release_sequence(rt, seq)?;
        if let Some(t) = &self.recall {
            t.release_sequence(rt, &self.pool, seq);
        }
        Ok(())
    }

    /// Bytes the K/V side holds in device memory besides the pool: QUEST's page bounds and lists
    /// (under QUEST or FlexGen), the recall tier's counters (and the tier itself where the device
    /// cannot read host memory in place).
    pub fn side_bytes_allocated(&self) -> u64 {
        let quest = self.quest.as_ref().or(self.flexgen.as_ref().map(|(_, q)| q)).map_or(0, Quest::bytes_allocated);
        quest + self.recall.as_ref().map_or(0, RecallTier::gpu_bytes)
    }

    /// FlexGen, before layer `layer`'s page lists are gathered (its tokens appended, its queries
    /// written): bring back the host pages whose bound beats the weakest resident page's. One
    /// readback of the page bounds, the queries and the ring tables, and only when the layer
    /// has pages in host memory. Returns the pages fetched and the seconds the readback took.
    pub async fn fetch_host_pages(&mut self, rt: &Runtime, layer: u32) -> Result<(Vec<PageFetch>, f64)> {
        let Some((fg, q)) = &mut self.flexgen else { return Ok((Vec::new(), 0.0)) };
        if !fg.has_host_pages(&self.pool.cfg, layer) {
            return Ok((Vec::new(), 0.0));
        }
        summarize(rt, q);
        let whole = |b: &wgpu::Buffer| b.size() / 4;
        let (qb, bb) = (&self.attn.queries, &q.bounds);
        let mut ranges = vec![(bb, 0, whole(bb)), (qb, 0, whole(qb))];
        ranges.extend(self.pool.ring_tables_ranges());
        let clock = Stopwatch::start();
        let mut read = rt.read_many::<u32>(&ranges).await?;
        let read_s = clock.seconds();
        let tables = self.pool.ring_tables_from(read.split_off(2));
        let mut read = read.into_iter().map(bytemuck::cast_vec::<u32, f32>);
        let (bounds, queries) = (read.next().unwrap_or_default(), read.next().unwrap_or_default());
        let from = fg.last_fetches.len();
        fg.fetch_with(rt, &self.pool, layer, (&queries, self.attn.opts.group), &bounds, tables).await?;
        Ok((fg.last_fetches[from..].to_vec(), read_s))
    }

    /// FlexGen, after every layer attended: the coldest pages past the budget move to host
    /// memory (this step's attention mass counts). One readback of the page bounds and the
    /// pool's tables; returns the seconds it took.
    pub async fn offload_host_pages(&mut self, rt: &Runtime) -> Result<f64> {
        let Some((fg, q)) = &mut self.flexgen else { return Ok(0.0) };
        summarize(rt, q);
        let whole = |b: &wgpu::Buffer| b.size() / 4;
        let mut ranges = vec![(&q.bounds, 0, whole(&q.bounds))];
        ranges.extend(self.pool.snapshot_ranges());
        let clock = Stopwatch::start();
        let mut read = rt.read_many::<u32>(&ranges).await?;
        let read_s = clock.seconds();
        let snapshot = self.pool.snapshot_from(read.split_off(1));
        let bounds = bytemuck::cast_vec::<u32, f32>(read.pop().unwrap_or_default());
        fg.offload_with(rt, &self.pool, &bounds, snapshot).await?;
        Ok(read_s)
    }
}

/// Seconds since it started (NaN in the browser, which has no clock the core may use).
struct Stopwatch {
    #[cfg(not(target_arch = "wasm32"))]
    t0: std::time::Instant,
}

impl Stopwatch {
    fn start() -> Self {
        Stopwatch {
            #[cfg(not(target_arch = "wasm32"))]
            t0: std::time::Instant::now(),
        }
    }

    fn seconds(&self) -> f64 {
        #[cfg(not(target_arch = "wasm32"))]
        return self.t0.elapsed().as_secs_f64();
        #[cfg(target_arch = "wasm32")]
        f64::NAN
    }
}

/// Refresh the bounds of the pages that changed, in a submission of its own.
fn summarize(rt: &Runtime, q: &Quest) {
    let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("evict/quest_summarize") });
    q.encode_summarize(
        &mut enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("evict/quest_summarize"), timestamp_writes: None }),
    );
    rt.queue.submit([enc.finish()]);
}
