//! Scheduling on the GPU: each policy's utility per cached token, per-list budgets (AdaKV and
//! DuoAttention move them between heads), exact victim selection, and compaction that frees the
//! emptied pages into the free stack, all in one compute pass with no host round trip.

pub mod config;
pub mod flexgen;
pub mod quest;
pub mod recall;

use expertkv_shaders::Kernel;

use crate::append::KvPool;
use crate::compress::{Thaw, ThawCounts};
use crate::config::Codec;
use crate::error::{Error, Result};
use crate::evict::config::{EKVA_MAX_GROUPS, EkvaConfig, SchedulerConfig, Threshold};
use crate::gpu_data::{EvictParams, ExpertStats, GroupState, ListState};
use crate::runtime::Runtime;
use crate::runtime::dispatch::CountedDispatch;
use crate::runtime::{grid, split_workgroups};

/// The EKVA allocator's state on the GPU (see `evict/ekva.wgsl`).
pub struct Ekva {
    /// The allocator's floor, importance mix and decay.
    pub cfg: EkvaConfig,
    /// Experts per layer: expert groups per page list (1..=[`EKVA_MAX_GROUPS`]).
    pub n_experts: u32,
    /// Per (list, expert): `GroupState`.
    pub groups: wgpu::Buffer,
    /// Per (layer, expert): the moving-average importance.
    pub importance: wgpu::Buffer,
    /// The router's `ExpertStats` per (layer, expert) (its moving-average load is read), or the
    /// allocator's own copy when no router was given.
    pub route_stats: wgpu::Buffer,
    experts: (wgpu::ComputePipeline, wgpu::BindGroup),
    update: (wgpu::ComputePipeline, wgpu::BindGroup),
    split: (wgpu::ComputePipeline, wgpu::BindGroup),
}

/// What an allocator over the scheduler needs: its parameters, the experts per layer, and the
/// router's statistics buffer (`None`: a zeroed buffer of its own, see
/// [`Scheduler::write_route_stats`]).
pub struct AllocatorSpec<'a> {
    /// The allocator's parameters.
    pub cfg: EkvaConfig,
    /// Experts per layer, 1..=[`EKVA_MAX_GROUPS`].
    pub n_experts: u32,
    /// The router's `ExpertStats` per (layer, expert), at least layers x `n_experts` entries
    /// ([`crate::route::Router::stats`]); `None`: a zeroed buffer of the allocator's own.
    pub route_stats: Option<&'a wgpu::Buffer>,
}

/// One dispatch of an eviction stage: (pipeline, bind group, workgroups x and y), or the thaw
/// of a pool with a codec (its decode sized on the GPU).
enum Work<'a> {
    Direct(&'a wgpu::ComputePipeline, &'a wgpu::BindGroup, [u32; 2]),
    Thaw(&'a Thaw),
    Capture(&'a recall::Capture),
}

/// One eviction stage's dispatches.
type Dispatches<'a> = Vec<Work<'a>>;

fn dispatch_all(pass: &mut wgpu::ComputePass<'_>, dispatches: &Dispatches<'_>) {
    for w in dispatches {
        match *w {
            Work::Direct(p, bg, [x, y]) => {
                pass.set_pipeline(p);
                pass.set_bind_group(0, bg, &[]);
                pass.dispatch_counted(x, y, 1);
            }
            Work::Thaw(t) => t.encode(pass),
            Work::Capture(c) => c.encode(pass),
        }
    }
}

/// An eviction scheduler over one pool on the GPU: score, budget, select, compact and free in
/// one compute pass (with the thaw of compressed pages and the EKVA allocator where configured).
pub struct Scheduler {
    /// The runtime it was made with (calls with another are refused).
    owner: crate::runtime::RuntimeId,
    /// The policy and its parameters.
    pub cfg: SchedulerConfig,
    /// Tokens each (layer, sequence, KV head) list keeps (AdaKV: on average over the heads).
    pub budget: u32,
    /// Every layer's base budget (`KEEP_ALL`: the layer keeps everything), see
    /// [`SchedulerConfig::layer_budgets`].
    pub layer_budgets: Vec<u32>,
    /// The utility threshold that evicts low-mass tokens under the budget.
    pub threshold: Threshold,
    /// `evict/select`'s invocations per list (the order it sums a list's mass in).
    pub select_wg: u32,
    params: wgpu::Buffer,
    /// Per pool slot (raw and compressed page ids): the policy's utility as an orderable u32
    /// key, higher kept longer; meaningful for cached slots only.
    pub utility: wgpu::Buffer,
    /// A [`ListState`] per (layer, seq, KV head) list: budget, tokens and evictions, threshold,
    /// hit rate, mass, Duo head kind.
    pub lists: wgpu::Buffer,
    seq_lens: wgpu::Buffer,
    /// Per shard ring, from the last eviction: (slots moved by compaction, pages freed).
    counts: wgpu::Buffer,
    _buffers: Vec<wgpu::Buffer>,
    score: (wgpu::ComputePipeline, wgpu::BindGroup),
    budget_pass: (wgpu::ComputePipeline, wgpu::BindGroup),
    select: (wgpu::ComputePipeline, wgpu::BindGroup),
    compact: (wgpu::ComputePipeline, wgpu::BindGroup),
    moves: Vec<(wgpu::ComputePipeline, wgpu::BindGroup)>,
    free: (wgpu::ComputePipeline, wgpu::BindGroup),
    /// With a page codec: the compressed pages compaction touches, decoded first.
    thaw: Option<Thaw>,
    /// With a recall tier: every victim captured into it before compaction
    /// ([`Scheduler::capture_into`]).
    capture: Option<recall::Capture>,
    /// The EKVA allocator, when the scheduler was built with one.
    pub ekva: Option<Ekva>,
    n_lists: u32,
    n_keys: u32,
    slots: u32,
    max_moves: u32,
    layers: u32,
    max_seqs: u32,
}

impl Scheduler {
    /// A scheduler whose layers share one budget (FastV: its early layers keep everything).
    pub async fn new(rt: &Runtime, pool: &KvPool, cfg: SchedulerConfig, budget: u32, threshold: Threshold) -> Result<Scheduler> {
        Self::with_pyramid(rt, pool, cfg, budget, None, threshold).await
    }

    /// `pyramid`: PyramidKV's ratio of the first (pruned) layer's budget to the last's; `budget`
    /// stays the mean over the pruned layers.
    pub async fn with_pyramid(
        rt: &Runtime,
        pool: &KvPool,
        cfg: SchedulerConfig,
        budget: u32,
        pyramid: Option<f32>,
        threshold: Threshold,
    ) -> Result<Scheduler> {
        Self::with_allocator(rt, pool, cfg, budget, pyramid, threshold, None).await
    }

    /// As [`Scheduler::with_pyramid`], with the EKVA allocator splitting every list's budget
    /// over expert groups when `allocator` is given.
    pub async fn with_allocator(
        rt: &Runtime,
        pool: &KvPool,
        cfg: SchedulerConfig,
        budget: u32,
        pyramid: Option<f32>,
        threshold: Threshold,
        allocator: Option<AllocatorSpec<'_>>,
    ) -> Result<Scheduler> {
        Self::with_select_workgroup(rt, pool, cfg, budget, pyramid, threshold, allocator, None).await
    }

    /// As [`Scheduler::with_allocator`], with `evict/select`'s invocations per list given
    /// (256, 512 or 1024, within the device's limits) instead of chosen for the device: the
    /// largest that fits on a GPU (a workgroup walks one list; more invocations, more loads in
    /// flight), 256 on a CPU adapter (where wider workgroups only add barrier work: lavapipe's
    /// eviction stage took 26 ms at 1024 against 7 ms at 256).
    #[allow(clippy::too_many_arguments)]
    pub async fn with_select_workgroup(
        rt: &Runtime,
        pool: &KvPool,
        cfg: SchedulerConfig,
        budget: u32,
        pyramid: Option<f32>,
        threshold: Threshold,
        allocator: Option<AllocatorSpec<'_>>,
        select_workgroup: Option<u32>,
    ) -> Result<Scheduler> {
        rt.check_owner(pool.owner(), "the pool")?;
        let fits = |w: u32| w <= rt.caps.max_invocations_per_workgroup && (3 * w + 256) * 4 + 64 <= rt.caps.max_workgroup_storage_bytes;
        let select_wg = match select_workgroup {
            Some(w) if [256, 512, 1024].contains(&w) && fits(w) => w,
            Some(w) => {
                return Err(Error::config(
                    "select_workgroup",
                    w,
                    format!("256, 512 or 1024 within this device's {} invocations per workgroup", rt.caps.max_invocations_per_workgroup),
                ));
            }
            None if rt.info.device_type == wgpu::DeviceType::Cpu => 256,
            None => [1024u32, 512, 256].into_iter().find(|&w| fits(w)).unwrap_or(256),
        };
        cfg.validate(budget)?;
        if let Some(a) = &allocator {
            a.cfg.validate()?;
            if !(1..=EKVA_MAX_GROUPS).contains(&a.n_experts) {
                return Err(Error::config(
                    "experts",
                    a.n_experts,
                    format!("the EKVA allocator splits lists over 1 to {EKVA_MAX_GROUPS} experts"),
                ));
            }
            if threshold != Threshold::default() {
                return Err(Error::config("threshold", format!("{threshold:?}"), "the EKVA allocator enforces budgets only; use fixed:0"));
            }
            if let Some(b) = a.route_stats {
                let want = u64::from(pool.cfg.layers) * u64::from(a.n_experts) * std::mem::size_of::<ExpertStats>() as u64;
                if b.size() < want {
                    return Err(Error::Input(format!("route stats: {} bytes, the allocator needs layers x experts = {want}", b.size())));
                }
            }
        }
        let layer_budgets = cfg.layer_budgets(budget, pool.cfg.layers, pyramid, pool.cfg.page_size)?;
        if !cfg.uses_evict_kernels() {
            return Err(Error::config(
                "scheduler",
                cfg.name(),
                "selects or places pages rather than evicting them; it is not an eviction scheduler",
            ));
        }
        if budget < pool.cfg.page_size {
            return Err(Error::config("budget", budget, format!("must be at least one page ({} tokens)", pool.cfg.page_size)));
        }
        if pool.cfg.kv_heads > 64 {
            return Err(Error::config("kv_heads", pool.cfg.kv_heads, "the schedulers handle at most 64 KV heads"));
        }
        match threshold {
            Threshold::Fixed { tau } if !(tau.is_finite() && tau >= 0.0) => {
                return Err(Error::config("threshold", tau, "must be finite and >= 0"));
            }
            Threshold::Adaptive { target, .. } if !(0.0..=1.0).contains(&target) => {
                return Err(Error::config("threshold.target", target, "must be in [0, 1]"));
            }
            Threshold::Adaptive { step, .. } if !(step.is_finite() && step >= 0.0) => {
                return Err(Error::config("threshold.step", step, "must be finite and >= 0"));
            }
            _ => {}
        }
        let c = &pool.cfg;
        let n_lists = c.n_lists();
        let n_keys = c.n_keys();
        let slots = c.n_ids() * c.page_size;
        let max_moves = n_keys * c.ring_capacity * c.page_size;
        let params = rt.uniform("evict params", &EvictParams::default());
        let utility = rt.storage("evict utility", u64::from(slots) * 4);
        let victim = rt.storage("evict victim", u64::from(slots) * 4);
        let tau0 = match threshold {
            Threshold::Fixed { tau } => tau,
            Threshold::Adaptive { .. } => 0.0,
        };
        let lists =
            rt.storage_init("evict lists", &vec![ListState { budget, tau: tau0, hit_rate: 1.0, ..Default::default() }; n_lists as usize]);
        let seq_lens = rt.storage("evict seq_lens", u64::from(c.max_seqs) * 4);
        let layer_budgets_buf = rt.storage_init("evict layer_budgets", &layer_budgets);
        let move_src = rt.storage("evict move_src", u64::from(max_moves) * 4);
        let move_dst = rt.storage("evict move_dst", u64::from(max_moves) * 4);
        let counts = rt.storage("evict counts", u64::from(n_keys) * 8);
        let freed = rt.storage("evict freed", u64::from(n_keys) * u64::from(c.ring_capacity) * 4);
        for (what, b) in [("evict move lists", &move_src), ("evict utility", &utility)] {
            rt.fits_binding(what, b.size())?;
        }

        let score_p = rt.pipeline(Kernel::EvictScore, &[]).await?;
        let score_bg = rt.bind(
            Kernel::EvictScore.label(),
            &score_p,
            &[&pool.geometry, &params, &pool.page_meta, &pool.slot_meta, &seq_lens, &utility],
        );
        let budget_p = rt.pipeline(Kernel::EvictBudget, &[]).await?;
        let budget_bg = rt.bind(
            Kernel::EvictBudget.label(),
            &budget_p,
            &[
                &pool.geometry,
                &params,
                &pool.page_list,
                &pool.page_counts,
                &pool.page_meta,
                &pool.slot_meta,
                &seq_lens,
                &lists,
                &layer_budgets_buf,
            ],
        );
        let groups = match &allocator {
            Some(a) => rt.storage("evict ekva groups", u64::from(n_lists) * u64::from(a.n_experts) * 16),
            None => rt.storage("evict ekva groups (off)", 16),
        };
        rt.fits_binding("EKVA groups", groups.size())?;
        // One workgroup walks each list (`select_wg` invocations: three reduction arrays of that
        // size in workgroup memory, and the 256-bin histogram).
        let select_p = rt.pipeline_with(Kernel::EvictSelect, &[("WG", format!("{select_wg}u"))], &[]).await?;
        let select_bg = rt.bind(
            Kernel::EvictSelect.label(),
            &select_p,
            &[
                &pool.geometry,
                &params,
                &pool.page_list,
                &pool.page_counts,
                &pool.page_meta,
                &pool.slot_meta,
                &utility,
                &lists,
                &victim,
                &groups,
            ],
        );
        let ekva = match allocator {
            None => None,
            Some(a) => {
                let e = a.n_experts;
                let importance = rt.storage_init("evict ekva importance", &vec![1.0f32 / e as f32; (pool.cfg.layers * e) as usize]);
                let route_stats = match a.route_stats {
                    Some(b) => b.clone(),
                    None => rt.storage_init("evict ekva route stats", &vec![ExpertStats::default(); (pool.cfg.layers * e) as usize]),
                };
                let all = [
                    (0, &pool.geometry),
                    (1, &params),
                    (2, &pool.page_list),
                    (3, &pool.page_counts),
                    (4, &pool.page_meta),
                    (5, &pool.slot_meta),
                    (6, &lists),
                    (7, &groups),
                    (8, &importance),
                    (9, &route_stats),
                ];
                let pick = |ids: &[u32]| all.iter().filter(|(i, _)| ids.contains(i)).copied().collect::<Vec<_>>();
                let ex_p = rt.pipeline(Kernel::EvictEkvaExperts, &[]).await?;
                let ex_bg = rt.bind_at(Kernel::EvictEkvaExperts.label(), &ex_p, &pick(&[0, 1, 2, 3, 4, 5, 7]));
                let up_p = rt.pipeline(Kernel::EvictEkvaImportance, &[]).await?;
                let up_bg = rt.bind_at(Kernel::EvictEkvaImportance.label(), &up_p, &pick(&[0, 1, 7, 8, 9]));
                let sp_p = rt.pipeline(Kernel::EvictEkvaSplit, &[]).await?;
                let sp_bg = rt.bind_at(Kernel::EvictEkvaSplit.label(), &sp_p, &pick(&[0, 1, 6, 7, 8]));
                Some(Ekva {
                    cfg: a.cfg,
                    n_experts: e,
                    groups: groups.clone(),
                    importance,
                    route_stats,
                    experts: (ex_p, ex_bg),
                    update: (up_p, up_bg),
                    split: (sp_p, sp_bg),
                })
            }
        };
        let compact_p = rt.pipeline(Kernel::EvictCompact, &[]).await?;
        let compact_bg = rt.bind(
            Kernel::EvictCompact.label(),
            &compact_p,
            &[&pool.geometry, &pool.rings, &pool.ring_pages, &pool.page_meta, &victim, &move_src, &move_dst, &counts, &freed],
        );
        let same_p = rt.pipeline(Kernel::EvictMoveSame, &[]).await?;
        let cross_p = if pool.n_buffers() > 1 { Some(rt.pipeline(Kernel::EvictMoveCross, &[]).await?) } else { None };
        let mut moves = Vec::new();
        for bs in 0..pool.n_buffers() {
            for bd in 0..pool.n_buffers() {
                let common = [
                    (0, &pool.geometry),
                    (1, &pool.window_bufs[bs]),
                    (2, &pool.window_bufs[bd]),
                    (3, &move_src),
                    (4, &move_dst),
                    (5, &counts),
                    (6, &pool.slot_meta),
                    (7, &pool.kv_buffers[bd]),
                    (9, &pool.page_gen),
                ];
                if bs == bd {
                    let bg = rt.bind_at(Kernel::EvictMoveSame.label(), &same_p, &common);
                    moves.push((same_p.clone(), bg));
                } else if let Some(cp) = &cross_p {
                    let mut e = common.to_vec();
                    e.push((8, &pool.kv_buffers[bs]));
                    let bg = rt.bind_at(Kernel::EvictMoveCross.label(), cp, &e);
                    moves.push((cp.clone(), bg));
                }
            }
        }
        let thaw = if pool.cfg.codec == Codec::None { None } else { Some(Thaw::new(rt, pool, &victim).await?) };
        let free_p = rt.pipeline(Kernel::EvictFree, &[]).await?;
        let free_bg =
            rt.bind(Kernel::EvictFree.label(), &free_p, &[&pool.geometry, &counts, &freed, &pool.free_stack, &pool.ctl, &pool.page_meta]);
        rt.check("scheduler setup")?;
        Ok(Scheduler {
            owner: rt.id(),
            cfg,
            budget,
            layer_budgets,
            threshold,
            select_wg,
            params,
            utility,
            lists,
            seq_lens,
            counts,
            _buffers: vec![victim, move_src, move_dst, freed, layer_budgets_buf, groups],
            score: (score_p, score_bg),
            budget_pass: (budget_p, budget_bg),
            select: (select_p, select_bg),
            compact: (compact_p, compact_bg),
            moves,
            free: (free_p, free_bg),
            thaw,
            capture: None,
            ekva,
            n_lists,
            n_keys,
            slots,
            max_moves,
            layers: c.layers,
            max_seqs: c.max_seqs,
        })
    }

    /// The parameter block of one eviction.
    pub fn params(&self, step: u32) -> EvictParams {
        let mut p = EvictParams { n_lists: self.n_lists, step, base_budget: self.budget, ..Default::default() };
        self.cfg.fill(&mut p);
        if let Some(e) = &self.ekva {
            e.cfg.fill(&mut p, e.n_experts);
        }
        match self.threshold {
            Threshold::Fixed { tau } => p.threshold = tau,
            Threshold::Adaptive { target, step } => {
                p.adaptive = 1;
                p.hit_target = target;
                p.tau_step = step;
            }
        }
        p
    }

    /// Stage the step and the sequences' current lengths (next position) for the next submission.
    pub fn prepare(&self, rt: &Runtime, step: u32, seq_lens: &[u32]) -> Result<()> {
        if seq_lens.len() != self.max_seqs as usize {
            return Err(Error::Input(format!("seq_lens: {} entries, the pool has {} sequences", seq_lens.len(), self.max_seqs)));
        }
        rt.queue.write_buffer(&self.params, 0, bytemuck::bytes_of(&self.params(step)));
        rt.queue.write_buffer(&self.seq_lens, 0, bytemuck::cast_slice(seq_lens));
        Ok(())
    }

    /// Score, budget, select, compact, move, free: the pool's page lists must be current
    /// (gathered after the last append). Rebuild them before attention reads the pool again.
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>) {
        for (_, dispatches) in self.stages() {
            dispatch_all(pass, &dispatches);
        }
    }

    /// The same kernels as [`Scheduler::encode`], each stage in its own compute pass between
    /// the timer's pairs `0..`: returns the stages' names in pair order. For probes: the pass
    /// boundaries add barriers the one-pass encoding does not have.
    pub fn encode_timed(&self, enc: &mut wgpu::CommandEncoder, timer: &crate::runtime::timer::GpuTimer) -> Vec<&'static str> {
        let mut names = Vec::new();
        for (i, (name, dispatches)) in self.stages().into_iter().enumerate() {
            let mut pass =
                enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some(name), timestamp_writes: timer.pass(i as u32) });
            dispatch_all(&mut pass, &dispatches);
            names.push(name);
        }
        names
    }

    /// The eviction's dispatches in order, by stage.
    fn stages(&self) -> Vec<(&'static str, Dispatches<'_>)> {
        let (x, y) = grid(self.slots);
        let lists = split_workgroups(self.n_lists);
        let mut out = vec![("score", vec![Work::Direct(&self.score.0, &self.score.1, [x, y])])];
        out.push(("budget", vec![Work::Direct(&self.budget_pass.0, &self.budget_pass.1, [self.max_seqs, self.layers])]));
        if let Some(e) = &self.ekva {
            let groups = self.n_lists.div_ceil(64);
            out.push((
                "ekva",
                vec![
                    Work::Direct(&e.experts.0, &e.experts.1, lists),
                    Work::Direct(&e.update.0, &e.update.1, [self.layers, 1]),
                    Work::Direct(&e.split.0, &e.split.1, split_workgroups(groups)),
                ],
            ));
        }
        out.push(("select", vec![Work::Direct(&self.select.0, &self.select.1, lists)]));
        if let Some(t) = &self.thaw {
            out.push(("thaw", vec![Work::Thaw(t)]));
        }
        if let Some(c) = &self.capture {
            out.push(("capture", vec![Work::Capture(c)]));
        }
        out.push(("compact", vec![Work::Direct(&self.compact.0, &self.compact.1, split_workgroups(self.n_keys))]));
        let (mx, my) = grid(self.max_moves);
        out.push(("move", self.moves.iter().map(|(p, bg)| Work::Direct(p, bg, [mx, my])).collect()));
        out.push(("free", vec![Work::Direct(&self.free.0, &self.free.1, [1, 1])]));
        out
    }

    /// Stages [`Scheduler::encode_timed`] times at most.
    pub const TIMED_STAGES: u32 = 9;

    /// Capture every victim into `tier` from now on (after select and a codec's thaw, before
    /// compaction), so that an eviction loses nothing ([`recall`]).
    pub async fn capture_into(&mut self, rt: &Runtime, pool: &KvPool, tier: &recall::RecallTier) -> Result<()> {
        rt.check_owner(self.owner, "this scheduler")?;
        self.capture = Some(tier.capture(rt, pool, &self._buffers[0]).await?);
        Ok(())
    }

    /// With a page codec: the compressed pages thawed (and the rings whose eviction was deferred
    /// for want of raw pages) by the last eviction and by all so far; `None` without a codec.
    pub async fn read_thaw(&self, rt: &Runtime) -> Result<Option<ThawCounts>> {
        match &self.thaw {
            Some(t) => Ok(Some(t.read_counts(rt).await?)),
            None => Ok(None),
        }
    }

    /// Evict in its own submission (the pool's page lists must be current).
    pub fn run(&self, rt: &Runtime, step: u32, seq_lens: &[u32]) -> Result<()> {
        rt.check_owner(self.owner, "this scheduler")?;
        self.prepare(rt, step, seq_lens)?;
        let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("evict") });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("evict"), timestamp_writes: None });
            self.encode(&mut pass);
        }
        rt.queue.submit([enc.finish()]);
        rt.check("evict")
    }

    /// Per shard ring, from the last eviction: slots moved by compaction and pages freed.
    pub async fn read_ring_counts(&self, rt: &Runtime) -> Result<Vec<[u32; 2]>> {
        rt.read_all(&self.counts).await
    }

    /// Every list's [`ListState`] after the last eviction, list-major (layer, seq, KV head).
    pub async fn read_lists(&self, rt: &Runtime) -> Result<Vec<ListState>> {
        rt.read_all(&self.lists).await
    }

    /// Utility keys of every pool slot (only cached slots are meaningful).
    pub async fn read_utility(&self, rt: &Runtime) -> Result<Vec<u32>> {
        rt.read_all(&self.utility).await
    }

    /// EKVA: every (list, expert) group's state from the last eviction (empty without the
    /// allocator).
    pub async fn read_groups(&self, rt: &Runtime) -> Result<Vec<GroupState>> {
        match &self.ekva {
            Some(e) => rt.read_all(&e.groups).await,
            None => Ok(Vec::new()),
        }
    }

    /// EKVA: every (layer, expert) importance (empty without the allocator).
    pub async fn read_importance(&self, rt: &Runtime) -> Result<Vec<f32>> {
        match &self.ekva {
            Some(e) => rt.read_all(&e.importance).await,
            None => Ok(Vec::new()),
        }
    }

    /// EKVA: overwrite the routing statistics the allocator reads (tests; a pipeline's router
    /// writes its own).
    pub fn write_route_stats(&self, rt: &Runtime, stats: &[ExpertStats]) -> Result<()> {
        let Some(e) = &self.ekva else {
            return Err(Error::Input("write_route_stats: the scheduler has no allocator".into()));
        };
        if stats.len() != (self.layers * e.n_experts) as usize {
            return Err(Error::Input(format!(
                "route stats: {} entries, expected layers x experts = {}",
                stats.len(),
                self.layers * e.n_experts
            )));
        }
        rt.queue.write_buffer(&e.route_stats, 0, bytemuck::cast_slice(stats));
        Ok(())
    }

    /// Overwrite the per-list state (tests and what-if runs).
    pub fn write_lists(&self, rt: &Runtime, lists: &[ListState]) -> Result<()> {
        if lists.len() != self.n_lists as usize {
            return Err(Error::Input(format!("lists: {} entries, the pool has {} page lists", lists.len(), self.n_lists)));
        }
        rt.queue.write_buffer(&self.lists, 0, bytemuck::cast_slice(lists));
        Ok(())
    }
}
