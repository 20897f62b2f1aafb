//! A MoE file's experts in tiers: a GPU expert cache of fixed slots per layer and host memory
//! holding every expert as the GPU reads it, in buffers the GPU copies from directly
//! ([`Runtime::host_copy_source`]: a fetch is a DMA copy, no CPU staging). A step's experts are
//! chosen on the GPU; between a layer's router and its experts the host reads the layer's
//! choices, copies the missing experts into slots (the victims chosen by [`ExpertPolicy`],
//! never an expert the step still needs) and updates the layer's slot table, so the FFN reads
//! every chosen expert from the GPU whatever was resident before: the logits equal the
//! all-resident run's, bit for bit. With [`ExpertPrefetch::Pregate`] the next layer's likely
//! experts, its router's top k over this layer's FFN input, are copied while that layer's
//! attention runs, so fewer choices wait.

use crate::gguf::Gguf;
use crate::ops::{MoeDown, MoeFfn, WeightFormat, pack_blocks, same_format, tensor_format};
use crate::{Error, LlamaConfig, Result};
use expertkv_core::runtime::Runtime;

/// Which resident expert leaves its slot for a missing one (among those the step does not need).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertPolicy {
    /// The least recently used.
    Lru,
    /// The least often chosen so far (ties: the least recently used).
    Lfu,
    /// The lowest router score in the layer's latest scoring (the step's own scores when a
    /// choice misses, the pre-gate's predicted ones when prefetching; ties: the least recently
    /// used): the expert the router wants least now.
    Score,
}

impl ExpertPolicy {
    /// Every policy, in `name` order.
    pub const ALL: [ExpertPolicy; 3] = [ExpertPolicy::Lru, ExpertPolicy::Lfu, ExpertPolicy::Score];

    /// The policy's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ExpertPolicy::Lru => "lru",
            ExpertPolicy::Lfu => "lfu",
            ExpertPolicy::Score => "score",
        }
    }

    /// The policy named `name` (an error listing the names otherwise).
    pub fn from_name(name: &str) -> Result<ExpertPolicy> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| Error::Input(format!("unknown expert policy `{name}`: one of {}", Self::ALL.map(ExpertPolicy::name).join(", "))))
    }
}

/// Whether experts are fetched before their layer routes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertPrefetch {
    /// Only on demand: a chosen expert that is not resident is fetched after its layer's
    /// router, before its FFN.
    None,
    /// Pre-gating: each layer's FFN input is also scored by the next layer's router; that top k
    /// is fetched while the next layer's attention runs, and only what it missed waits.
    Pregate,
}

impl ExpertPrefetch {
    /// Every mode, in `name` order.
    pub const ALL: [ExpertPrefetch; 2] = [ExpertPrefetch::None, ExpertPrefetch::Pregate];

    /// The mode's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ExpertPrefetch::None => "none",
            ExpertPrefetch::Pregate => "pregate",
        }
    }

    /// The mode named `name` (an error listing the names otherwise).
    pub fn from_name(name: &str) -> Result<ExpertPrefetch> {
        Self::ALL.into_iter().find(|p| p.name() == name).ok_or_else(|| {
            Error::Input(format!("unknown expert prefetch `{name}`: one of {}", Self::ALL.map(ExpertPrefetch::name).join(", ")))
        })
    }
}

/// The GPU tier's size, its eviction policy and prefetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertCacheConfig {
    /// Expert slots per layer on the GPU.
    pub slots: u32,
    /// Which expert leaves a slot.
    pub policy: ExpertPolicy,
    /// Whether experts are fetched ahead of their layer's router.
    pub prefetch: ExpertPrefetch,
}

impl ExpertCacheConfig {
    /// `slots` per layer under `policy`, fetched on demand only.
    pub fn on_demand(slots: u32, policy: ExpertPolicy) -> Self {
        ExpertCacheConfig { slots, policy, prefetch: ExpertPrefetch::None }
    }
}

/// Hits, misses and bytes moved host-to-GPU for expert weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ExpertTraffic {
    /// Chosen (layer, expert) pairs of a step already resident when their layer routed,
    /// prefetched ones included (each counted once a step).
    pub hits: u64,
    /// Chosen (layer, expert) pairs fetched after their layer routed (the FFN waits for them).
    pub misses: u64,
    /// Weight bytes copied to the GPU, on demand and ahead.
    pub bytes: u64,
    /// Experts fetched ahead of their layer's router.
    pub prefetched: u64,
    /// Of those, the ones their layer then chose.
    pub prefetch_used: u64,
}

impl ExpertTraffic {
    /// Hits over hits and misses (0 before any).
    pub fn hit_rate(&self) -> f64 {
        self.hits as f64 / (self.hits + self.misses).max(1) as f64
    }

    /// The sum of two counts (saturating).
    pub fn add(&mut self, o: &ExpertTraffic) {
        self.hits = self.hits.saturating_add(o.hits);
        self.misses = self.misses.saturating_add(o.misses);
        self.bytes = self.bytes.saturating_add(o.bytes);
        self.prefetched = self.prefetched.saturating_add(o.prefetched);
        self.prefetch_used = self.prefetch_used.saturating_add(o.prefetch_used);
    }
}

/// One layer's experts in host memory and its slots.
struct LayerTier {
    /// Per expert: its gate rows, up rows and down rows (as [`pack_blocks`] lays them out), one
    /// after the other in one host-memory buffer the GPU copies from
    /// ([`Runtime::host_copy_source`]).
    host: Vec<wgpu::Buffer>,
    /// Bytes of one expert's gate (= up) rows and of its down rows.
    gate_bytes: u64,
    down_bytes: u64,
    /// Per expert: its slot, or `slots` when not resident (the GPU slot table's contents).
    slot_of: Vec<u32>,
    /// Per slot: the expert in it.
    holder: Vec<Option<u32>>,
    /// Per slot: the last step that used it.
    last_used: Vec<u64>,
    /// Per slot: fetched ahead and not yet chosen.
    ahead: Vec<bool>,
    /// Per expert: steps that chose it.
    uses: Vec<u64>,
    /// Per expert: its router score in the layer's latest scoring (the highest over the
    /// step's tokens).
    score: Vec<f32>,
}

/// The expert tiers of a MoE file (see the module docs).
pub struct ExpertCache {
    /// Slots per layer and the policy.
    pub cfg: ExpertCacheConfig,
    /// Experts each token chooses.
    top_k: u32,
    layers: Vec<LayerTier>,
    /// Everything fetched since load.
    pub total: ExpertTraffic,
    /// The last step's traffic.
    pub last: ExpertTraffic,
    /// The last step's fetches: which expert went into which slot of which layer, replacing
    /// whom.
    pub last_fetches: Vec<crate::forward::trace::ExpertFetch>,
}

/// What a MoE file's experts take on the GPU, before any is uploaded (what
/// [`MoeFfn::gpu_bytes`] measures once they are).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertBytes {
    /// One slot in every layer: an expert's gate, up and down weights as the kernels read them.
    pub per_slot: u64,
    /// Whatever the slots count: every layer's slot table.
    pub fixed: u64,
}

impl ExpertBytes {
    /// The experts of file `g` (`c` its configuration); `None` for a dense FFN.
    pub fn of(g: &Gguf<'_>, c: &LlamaConfig) -> Result<Option<ExpertBytes>> {
        let (e, h, f) = (c.expert_count, c.embedding_length, c.feed_forward_length);
        if e == 0 {
            return Ok(None);
        }
        let (mut per_slot, mut fixed) = (0, 0);
        for l in 0..c.block_count {
            let name = |s: &str| format!("blk.{l}.{s}.weight");
            let fg = same_format(g, &name("ffn_gate_exps"), &name("ffn_up_exps"))?;
            let fd = tensor_format(g, &name("ffn_down_exps"))?;
            per_slot += fg.gpu_bytes(2 * f, h) + fd.gpu_bytes(h, f);
            fixed += expertkv_core::runtime::storage_size(4 * u64::from(e));
        }
        Ok(Some(ExpertBytes { per_slot, fixed }))
    }

    /// Bytes of `slots` slots per layer (every expert resident: `slots` = the expert count).
    pub fn with_slots(&self, slots: u32) -> u64 {
        self.fixed + self.per_slot * u64::from(slots)
    }
}

/// The fewest slots a layer needs: every expert one step of `n_seqs` tokens can choose
/// (`top_k` each) resident at once.
pub fn min_slots(n_seqs: u32, top_k: u32, n_experts: u32) -> u32 {
    n_seqs.saturating_mul(top_k).min(n_experts)
}

/// What a victim is chosen by, per slot and per expert.
pub struct VictimKeys<'a> {
    /// Per slot: the expert in it.
    pub holder: &'a [Option<u32>],
    /// Per slot: the last step that used it.
    pub last_used: &'a [u64],
    /// Per expert: steps that chose it.
    pub uses: &'a [u64],
    /// Per expert: its latest router score.
    pub score: &'a [f32],
}

/// The slot a missing expert goes into: a free slot (the first), else among the slots whose
/// expert `needed` (sorted) does not hold, the least recently used (`Lru`), the least often
/// chosen (`Lfu`) or the lowest scored (`Score`), those two then by least recent use; ties to
/// the lower expert. `None` when every slot holds a needed expert. Under `Lru` the residents of
/// a cache of S slots are then always the S experts last used latest (ties: the higher
/// experts), whatever the slot layout, so one run's [`ReuseCurve`] gives every size's hits.
pub fn victim(policy: ExpertPolicy, k: &VictimKeys<'_>, needed: &[u32]) -> Option<usize> {
    k.holder.iter().position(Option::is_none).or_else(|| {
        let candidates = (0..k.holder.len()).filter(|&v| k.holder[v].is_some_and(|old| needed.binary_search(&old).is_err()));
        let expert = |v: usize| k.holder[v].map_or(0, |x| x as usize);
        match policy {
            ExpertPolicy::Lru => candidates.min_by_key(|&v| (k.last_used[v], expert(v))),
            ExpertPolicy::Lfu => candidates.min_by_key(|&v| (k.uses[expert(v)], k.last_used[v], expert(v))),
            ExpertPolicy::Score => candidates.min_by(|&a, &b| {
                let (sa, sb) = (k.score[expert(a)], k.score[expert(b)]);
                sa.total_cmp(&sb).then(k.last_used[a].cmp(&k.last_used[b])).then(expert(a).cmp(&expert(b)))
            }),
        }
    })
}

/// The LRU hit counts of every cache size from one run's routing (Mattson's stack distances):
/// per layer each expert's last step, and per step each chosen expert's rank among the experts
/// used before it (by last step, then expert: the order [`victim`] keeps them in). A cache of
/// S slots on demand under LRU hits exactly the choices of rank below S, whatever S the run
/// itself had: the routing does not depend on residency. Counted as the cache counts, each
/// (layer, expert) once a step.
#[derive(Clone, Debug, Default)]
pub struct ReuseCurve {
    /// Per layer, per expert: the last step that chose it.
    last: Vec<Vec<Option<u64>>>,
    /// Choices by rank (`by_rank[r]`: chosen experts with `r` others used more recently).
    pub by_rank: Vec<u64>,
    /// Choices of an expert never chosen before in its layer (a miss at any size).
    pub cold: u64,
}

impl ReuseCurve {
    /// An empty curve for `layers` layers of `experts` experts.
    pub fn new(layers: u32, experts: u32) -> ReuseCurve {
        ReuseCurve { last: vec![vec![None; experts as usize]; layers as usize], by_rank: vec![0; experts as usize], cold: 0 }
    }

    /// Record layer `layer`'s choices at `step` (any order, repeats allowed; experts out of
    /// range are ignored, as the cache refuses them).
    pub fn record(&mut self, layer: u32, chosen: &[u32], step: u64) {
        let Some(last) = self.last.get_mut(layer as usize) else { return };
        let mut needed: Vec<u32> = chosen.iter().copied().filter(|&x| (x as usize) < last.len()).collect();
        needed.sort_unstable();
        needed.dedup();
        for &x in &needed {
            match last[x as usize] {
                None => self.cold += 1,
                Some(t) => {
                    let key = (t, x);
                    let rank = last.iter().enumerate().filter(|&(y, ly)| ly.is_some_and(|u| (u, y as u32) > key)).count();
                    self.by_rank[rank] += 1;
                }
            }
        }
        for &x in &needed {
            last[x as usize] = Some(step);
        }
    }

    /// Choices recorded (each (layer, expert) once a step).
    pub fn references(&self) -> u64 {
        self.cold + self.by_rank.iter().sum::<u64>()
    }

    /// Hits of an on-demand LRU cache of `slots` slots per layer over the recorded steps.
    pub fn hits(&self, slots: u32) -> u64 {
        self.by_rank.iter().take(slots as usize).sum()
    }
}

impl LayerTier {
    /// Bytes of one expert: its gate, up and down rows.
    fn expert_bytes(&self) -> u64 {
        2 * self.gate_bytes + self.down_bytes
    }

    fn keys(&self) -> VictimKeys<'_> {
        VictimKeys { holder: &self.holder, last_used: &self.last_used, uses: &self.uses, score: &self.score }
    }

    /// Set each expert's score to its highest over the tokens of `scores` (`[token][E]`).
    fn rescore(&mut self, scores: &[f32]) {
        let e = self.score.len();
        if e == 0 || scores.len() < e {
            return;
        }
        self.score.iter_mut().for_each(|s| *s = f32::NEG_INFINITY);
        for row in scores.chunks_exact(e) {
            for (s, &x) in self.score.iter_mut().zip(row) {
                *s = s.max(x);
            }
        }
    }
}

impl ExpertCache {
    /// Every layer's experts read from `g` into host memory and a GPU tier of `cfg.slots` per
    /// layer, none resident: the tiers and each layer's [`MoeFfn`] (to record with). Refused, with
    /// the minimum stated, when the slots cannot hold one step's experts of `n_seqs` sequences.
    pub fn load(rt: &Runtime, g: &Gguf<'_>, c: &LlamaConfig, cfg: ExpertCacheConfig, n_seqs: u32) -> Result<(ExpertCache, Vec<MoeFfn>)> {
        let (e, k, h, f) = (c.expert_count, c.expert_used_count, c.embedding_length, c.feed_forward_length);
        if e == 0 {
            return Err(Error::Input("an expert cache needs a MoE file (this model has a dense FFN)".into()));
        }
        let least = min_slots(n_seqs, k, e);
        if cfg.slots < least || cfg.slots > e {
            return Err(Error::Input(format!(
                "expert cache: {} slots per layer; one step of {n_seqs} sequences chooses up to {least} of the {e} experts, so at least {least} and at most {e}",
                cfg.slots
            )));
        }
        let mut layers = Vec::new();
        let mut ffns = Vec::new();
        for l in 0..c.block_count {
            let name = |s: &str| format!("blk.{l}.{s}.weight");
            let fg = same_format(g, &name("ffn_gate_exps"), &name("ffn_up_exps"))?;
            let fd = tensor_format(g, &name("ffn_down_exps"))?;
            let [gate, up, down] = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"].map(|s| g.tensor_data(&name(s)));
            let (gate, up, down) = (gate?, up?, down?);
            let per = |bytes: &[u8], what: &str| -> Result<usize> {
                let per = bytes.len() / e as usize;
                if per * e as usize != bytes.len() {
                    return Err(Error::Model(format!("blk.{l}.{what}: {} bytes are not {e} experts", bytes.len())));
                }
                Ok(per)
            };
            let (pg, pu, pd) = (per(gate, "ffn_gate_exps")?, per(up, "ffn_up_exps")?, per(down, "ffn_down_exps")?);
            let (mut host, mut sizes) = (Vec::new(), (0, 0));
            for x in 0..e as usize {
                let mut words = pack_blocks(fg, f, h, &gate[x * pg..(x + 1) * pg])?;
                let gate_words = words.len();
                words.extend(pack_blocks(fg, f, h, &up[x * pu..(x + 1) * pu])?);
                let down_words = pack_blocks(fd, h, f, &down[x * pd..(x + 1) * pd])?;
                if words.len() != 2 * gate_words {
                    return Err(Error::Model(format!("blk.{l}: an expert's gate and up rows differ in size")));
                }
                sizes = (gate_words as u64 * 4, down_words.len() as u64 * 4);
                words.extend(down_words);
                host.push(rt.host_copy_source(&format!("blk.{l} expert {x} (host)"), &words));
            }
            ffns.push(MoeFfn::expert_slots(rt, &format!("blk.{l} experts"), (fg, fd), h, e, f, cfg.slots)?);
            layers.push(LayerTier {
                host,
                gate_bytes: sizes.0,
                down_bytes: sizes.1,
                slot_of: vec![cfg.slots; e as usize],
                holder: vec![None; cfg.slots as usize],
                last_used: vec![0; cfg.slots as usize],
                ahead: vec![false; cfg.slots as usize],
                uses: vec![0; e as usize],
                score: vec![0.0; e as usize],
            });
        }
        Ok((
            ExpertCache {
                cfg,
                top_k: k,
                layers,
                total: ExpertTraffic::default(),
                last: ExpertTraffic::default(),
                last_fetches: Vec::new(),
            },
            ffns,
        ))
    }

    /// The GPU tier remade for `cfg`: the old slot buffers (`old`, each layer's [`MoeFfn`] from
    /// [`ExpertCache::load`] or an earlier resize) are dropped first, so the two never exist at
    /// once, and the new slots start empty (every expert is fetched again on its next use). The
    /// host tier, the traffic counters and each expert's use counts stay. The same slot count
    /// keeps the slots and their experts; only the policy and prefetch change. Check the slot
    /// count first ([`ExpertCache::check_slots`]): a refused resize has dropped `old`.
    pub fn resize(&mut self, rt: &Runtime, cfg: ExpertCacheConfig, n_seqs: u32, old: Vec<MoeFfn>) -> Result<Vec<MoeFfn>> {
        self.check_slots(cfg.slots, n_seqs)?;
        if old.len() != self.layers.len() {
            return Err(Error::Input(format!("expert cache: {} layers of slots for {} layers", old.len(), self.layers.len())));
        }
        if cfg.slots == self.cfg.slots {
            self.cfg = cfg;
            return Ok(old);
        }
        let shapes: Vec<_> = old
            .iter()
            .map(|f| {
                let down = match &f.down {
                    MoeDown::Experts(m) => m.format,
                    MoeDown::Transposed(_) => WeightFormat::F32,
                };
                ((f.gate_up.format, down), f.hidden, f.n_experts, f.max_size)
            })
            .collect();
        drop(old);
        let mut ffns = Vec::new();
        for (l, (formats, h, n, f)) in shapes.into_iter().enumerate() {
            ffns.push(MoeFfn::expert_slots(rt, &format!("blk.{l} experts"), formats, h, n, f, cfg.slots)?);
        }
        let slots = cfg.slots as usize;
        for t in &mut self.layers {
            t.slot_of.iter_mut().for_each(|s| *s = cfg.slots);
            t.holder = vec![None; slots];
            t.last_used = vec![0; slots];
            t.ahead = vec![false; slots];
        }
        self.cfg = cfg;
        Ok(ffns)
    }

    /// Empty every slot (each layer's slot table on the GPU too, `ffns` in layer order): the
    /// next step fetches every expert it chooses, as after a load. Counters and use counts stay.
    pub fn empty(&mut self, rt: &Runtime, ffns: &[&MoeFfn]) {
        let slots = self.cfg.slots;
        for (t, ffn) in self.layers.iter_mut().zip(ffns) {
            t.slot_of.iter_mut().for_each(|s| *s = slots);
            t.holder.iter_mut().for_each(|h| *h = None);
            t.last_used.iter_mut().for_each(|u| *u = 0);
            t.ahead.iter_mut().for_each(|a| *a = false);
            rt.queue.write_buffer(&ffn.offsets, 0, bytemuck::cast_slice(&t.slot_of));
        }
    }

    /// Whether `slots` slots per layer hold one step's experts of `n_seqs` sequences (and no
    /// more than every expert); the error states the range.
    pub fn check_slots(&self, slots: u32, n_seqs: u32) -> Result<()> {
        let e = self.layers.first().map_or(0, |t| t.slot_of.len() as u32);
        let least = min_slots(n_seqs, self.top_k, e);
        if slots < least || slots > e {
            return Err(Error::Input(format!(
                "expert cache: {slots} slots per layer; one step of {n_seqs} sequences chooses up to {least} of the {e} experts, so at least {least} and at most {e}"
            )));
        }
        Ok(())
    }

    /// Start a step's accounting.
    pub fn begin_step(&mut self) {
        self.last = ExpertTraffic::default();
        self.last_fetches.clear();
    }

    /// Copy expert `x` of layer `l` into slot `v` (encoded on `enc`: DMA from the host tier).
    fn fetch(&mut self, enc: &mut wgpu::CommandEncoder, layer: u32, x: u32, v: usize, ffn: &MoeFfn, ahead: bool) -> Result<()> {
        let slots = self.cfg.slots;
        let MoeDown::Experts(down) = &ffn.down else {
            return Err(Error::Input("expert cache: the layer's experts are not slotted".into()));
        };
        let t = &mut self.layers[layer as usize];
        if let Some(old) = t.holder[v] {
            t.slot_of[old as usize] = slots;
        }
        self.last_fetches.push(crate::forward::trace::ExpertFetch { layer, expert: x, slot: v as u32, evicted: t.holder[v], ahead });
        let (gw, dw, v64) = (t.gate_bytes, t.down_bytes, v as u64);
        let src = &t.host[x as usize];
        // Slot v: gate rows at v * f, up rows at (slots + v) * f, down rows at v * hidden.
        enc.copy_buffer_to_buffer(src, 0, &ffn.gate_up.buffer, v64 * gw, gw);
        enc.copy_buffer_to_buffer(src, gw, &ffn.gate_up.buffer, (u64::from(slots) + v64) * gw, gw);
        enc.copy_buffer_to_buffer(src, 2 * gw, &down.buffer, v64 * dw, dw);
        t.holder[v] = Some(x);
        t.slot_of[x as usize] = v as u32;
        self.last.bytes += t.expert_bytes();
        Ok(())
    }

    /// The distinct experts of `chosen`, sorted; an error for a layer or an expert out of range.
    fn check_layer(&self, layer: u32, chosen: &[u32]) -> Result<Vec<u32>> {
        let t = self.layers.get(layer as usize).ok_or_else(|| Error::Input(format!("expert cache: layer {layer}")))?;
        let e = t.slot_of.len() as u32;
        let mut needed: Vec<u32> = chosen.to_vec();
        needed.sort_unstable();
        needed.dedup();
        if let Some(bad) = needed.iter().find(|&&x| x >= e) {
            return Err(Error::Gpu { during: "expert cache".into(), message: format!("layer {layer} chose expert {bad} of {e}") });
        }
        Ok(needed)
    }

    /// Make every expert of `chosen` (layer `layer`'s choices this step, any order, repeats
    /// allowed) resident in `ffn`'s slots before the layer's FFN runs: hits are touched; each
    /// missing expert is copied (on `enc`, which must be submitted before the FFN) into a free
    /// slot, else the policy's victim among the slots this step does not need; the slot table
    /// follows. `scores` are the layer's router scores this step (`[token][E]`, for the `Score`
    /// policy; empty otherwise). `step` orders the uses (LRU).
    #[allow(clippy::too_many_arguments)]
    pub fn ensure(
        &mut self,
        rt: &Runtime,
        enc: &mut wgpu::CommandEncoder,
        layer: u32,
        chosen: &[u32],
        scores: &[f32],
        step: u64,
        ffn: &MoeFfn,
    ) -> Result<()> {
        let slots = self.cfg.slots;
        let needed = self.check_layer(layer, chosen)?;
        if needed.len() as u32 > slots {
            return Err(Error::Input(format!("expert cache: layer {layer} needs {} experts at once, {slots} slots", needed.len())));
        }
        self.layers[layer as usize].rescore(scores);
        let mut changed = false;
        for &x in &needed {
            let t = &mut self.layers[layer as usize];
            t.uses[x as usize] += 1;
            let s = t.slot_of[x as usize];
            if s < slots {
                t.last_used[s as usize] = step;
                if std::mem::take(&mut t.ahead[s as usize]) {
                    self.last.prefetch_used += 1;
                }
                self.last.hits += 1;
                continue;
            }
            let Some(v) = victim(self.cfg.policy, &t.keys(), &needed) else {
                return Err(Error::Input(format!("expert cache: no slot of layer {layer} is free of this step's experts")));
            };
            self.fetch(enc, layer, x, v, ffn, false)?;
            let t = &mut self.layers[layer as usize];
            t.last_used[v] = step;
            t.ahead[v] = false;
            self.last.misses += 1;
            changed = true;
        }
        // Prefetched experts the layer did not choose are ordinary residents from here on.
        self.layers[layer as usize].ahead.iter_mut().for_each(|a| *a = false);
        if changed {
            rt.queue.write_buffer(&ffn.offsets, 0, bytemuck::cast_slice(&self.layers[layer as usize].slot_of));
        }
        Ok(())
    }

    /// Fetch layer `layer`'s predicted experts (`predicted`, as `chosen` in [`ExpertCache::ensure`];
    /// `scores` the predicted router scores) ahead of its router, encoded on `enc`: each missing
    /// one into a free slot, else the policy's victim among the slots the prediction does not
    /// name. The layer's FFN must not run before `enc`'s copies (they may overlap whatever
    /// comes between). Experts already resident are left as they are.
    #[allow(clippy::too_many_arguments)]
    pub fn prefetch(
        &mut self,
        rt: &Runtime,
        enc: &mut wgpu::CommandEncoder,
        layer: u32,
        predicted: &[u32],
        scores: &[f32],
        step: u64,
        ffn: &MoeFfn,
    ) -> Result<()> {
        let slots = self.cfg.slots;
        let mut wanted = self.check_layer(layer, predicted)?;
        wanted.truncate(slots as usize);
        self.layers[layer as usize].rescore(scores);
        let mut changed = false;
        for &x in &wanted {
            let t = &self.layers[layer as usize];
            if t.slot_of[x as usize] < slots {
                continue;
            }
            let Some(v) = victim(self.cfg.policy, &t.keys(), &wanted) else { break };
            self.fetch(enc, layer, x, v, ffn, true)?;
            let t = &mut self.layers[layer as usize];
            t.last_used[v] = step;
            t.ahead[v] = true;
            self.last.prefetched += 1;
            changed = true;
        }
        if changed {
            rt.queue.write_buffer(&ffn.offsets, 0, bytemuck::cast_slice(&self.layers[layer as usize].slot_of));
        }
        Ok(())
    }

    /// Add the last step's traffic to the total.
    pub fn end_step(&mut self) {
        let last = self.last;
        self.total.add(&last);
    }

    /// Bytes of one expert of layer `layer` (gate, up and down rows): what one fetch copies (0
    /// for a layer out of range).
    pub fn layer_expert_bytes(&self, layer: u32) -> u64 {
        self.layers.get(layer as usize).map_or(0, LayerTier::expert_bytes)
    }

    /// GPU bytes of every layer's slots (gate, up and down rows of each slot).
    pub fn gpu_bytes(&self) -> u64 {
        self.layers.iter().map(|t| t.expert_bytes() * u64::from(self.cfg.slots)).sum()
    }

    /// Host bytes holding every expert.
    pub fn host_bytes(&self) -> u64 {
        self.layers.iter().map(|t| t.expert_bytes() * t.host.len() as u64).sum()
    }

    /// Each layer's resident experts, by slot.
    pub fn resident(&self) -> Vec<Vec<Option<u32>>> {
        self.layers.iter().map(|t| t.holder.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A free slot first; then never a needed expert; LRU by last use, LFU by uses then last use,
    /// ties to the lower slot; none when every slot is needed.
    #[test]
    fn victims_follow_the_policy_and_spare_the_step() {
        const FULL: [Option<u32>; 4] = [Some(4), Some(1), Some(7), Some(2)];
        let last = [5, 3, 3, 9];
        // Uses and scores per expert 0..8.
        let uses = [0, 10, 1, 0, 2, 0, 0, 8, 0];
        let score = [0.0, 0.5, 3.0, 0.0, -1.0, 0.0, 0.0, -1.0, 0.0];
        let keys = |holder: &'static [Option<u32>]| VictimKeys { holder, last_used: &last, uses: &uses, score: &score };
        assert_eq!(victim(ExpertPolicy::Lru, &keys(&[Some(4), None, Some(7), None]), &[]), Some(1));
        // LRU: slots 1 and 2 last used at 3: the lower; with expert 1 needed, slot 2.
        assert_eq!(victim(ExpertPolicy::Lru, &keys(&FULL), &[]), Some(1));
        assert_eq!(victim(ExpertPolicy::Lru, &keys(&FULL), &[1]), Some(2));
        assert_eq!(victim(ExpertPolicy::Lru, &keys(&FULL), &[1, 7]), Some(0));
        // LFU: uses 2 (slot 0, expert 4), 10, 8, 1 (slot 3, expert 2): slot 3; then slot 0.
        assert_eq!(victim(ExpertPolicy::Lfu, &keys(&FULL), &[]), Some(3));
        assert_eq!(victim(ExpertPolicy::Lfu, &keys(&FULL), &[2]), Some(0));
        assert_eq!(victim(ExpertPolicy::Lfu, &keys(&FULL), &[1, 2, 4, 7]), None);
        // Score: experts 4 and 7 score -1 (slots 0 and 2): the one used less recently, slot 2;
        // with 7 needed, slot 0; then expert 1 (0.5) before expert 2 (3.0).
        assert_eq!(victim(ExpertPolicy::Score, &keys(&FULL), &[]), Some(2));
        assert_eq!(victim(ExpertPolicy::Score, &keys(&FULL), &[7]), Some(0));
        assert_eq!(victim(ExpertPolicy::Score, &keys(&FULL), &[4, 7]), Some(1));
        assert_eq!(victim(ExpertPolicy::Score, &keys(&FULL), &[1, 2, 4, 7]), None);
        assert_eq!(min_slots(3, 2, 8), 6);
        assert_eq!(min_slots(8, 2, 8), 8);
    }

    /// The curve's hits at every size equal an LRU cache's of that size, simulated with
    /// [`victim`] on random routing with repeats and temporal locality.
    #[test]
    fn reuse_curve_hits_are_every_lru_sizes_hits() {
        let (experts, k) = (8u32, 3usize);
        let mut rng = expertkv_core::rng::Rng::new(11);
        let steps: Vec<Vec<u32>> =
            (0..300).map(|_| (0..k).map(|_| if rng.below(3) == 0 { rng.below(experts) } else { rng.below(3) }).collect()).collect();
        let mut curve = ReuseCurve::new(1, experts);
        for (t, chosen) in steps.iter().enumerate() {
            curve.record(0, chosen, t as u64 + 1);
        }
        for slots in k as u32..=experts {
            let (mut holder, mut last_used) = (vec![None; slots as usize], vec![0u64; slots as usize]);
            let (uses, score) = (vec![0; experts as usize], vec![0.0; experts as usize]);
            let mut hits = 0;
            for (t, chosen) in steps.iter().enumerate() {
                let mut needed = chosen.clone();
                needed.sort_unstable();
                needed.dedup();
                for &x in &needed {
                    if let Some(s) = holder.iter().position(|&h| h == Some(x)) {
                        hits += 1;
                        last_used[s] = t as u64 + 1;
                        continue;
                    }
                    let keys = VictimKeys { holder: &holder, last_used: &last_used, uses: &uses, score: &score };
                    let v = victim(ExpertPolicy::Lru, &keys, &needed).expect("a victim");
                    holder[v] = Some(x);
                    last_used[v] = t as u64 + 1;
                }
            }
            assert_eq!(curve.hits(slots), hits, "{slots} slots");
        }
        assert_eq!(curve.hits(experts) + curve.cold, curve.references());
        assert!(curve.cold <= u64::from(experts) && curve.hits(k as u32) < curve.hits(experts));
    }

    #[test]
    fn a_rescore_keeps_each_experts_best_token() {
        let mut t = LayerTier {
            host: Vec::new(),
            gate_bytes: 0,
            down_bytes: 0,
            slot_of: vec![3; 3],
            holder: vec![None; 3],
            last_used: vec![0; 3],
            ahead: vec![false; 3],
            uses: vec![0; 3],
            score: vec![0.0; 3],
        };
        t.rescore(&[1.0, -2.0, 0.5, 0.0, -3.0, 4.0]);
        assert_eq!(t.score, [1.0, -2.0, 4.0]);
        // Too few scores (the policy does not read them) leave the last ones.
        t.rescore(&[]);
        assert_eq!(t.score, [1.0, -2.0, 4.0]);
        assert!(ExpertPrefetch::from_name("pregate").is_ok_and(|p| p == ExpertPrefetch::Pregate));
        assert!(ExpertPrefetch::from_name("oracle").is_err_and(|e| e.to_string().contains("none, pregate")));
    }
}
