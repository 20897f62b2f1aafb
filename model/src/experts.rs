//! A MoE file's experts in tiers: a GPU expert cache of fixed slots per layer and host memory
//! holding every expert as the GPU reads it. A step's experts are chosen on the GPU; between a
//! layer's router and its experts the host reads the layer's choices, fetches the missing
//! experts into slots (the victims chosen by [`ExpertPolicy`], never an expert the step still
//! needs) and updates the layer's slot table, so the FFN reads every chosen expert from the GPU
//! whatever was resident before: the logits equal the all-resident run's, bit for bit.

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
}

impl ExpertPolicy {
    /// Every policy, in `name` order.
    pub const ALL: [ExpertPolicy; 2] = [ExpertPolicy::Lru, ExpertPolicy::Lfu];

    /// The policy's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ExpertPolicy::Lru => "lru",
            ExpertPolicy::Lfu => "lfu",
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

/// The GPU tier's size and its eviction policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertCacheConfig {
    /// Expert slots per layer on the GPU.
    pub slots: u32,
    /// Which expert leaves a slot.
    pub policy: ExpertPolicy,
}

/// Hits, misses and bytes moved host-to-GPU for expert weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExpertTraffic {
    /// Chosen (layer, expert) pairs of a step already resident (each counted once a step).
    pub hits: u64,
    /// Chosen (layer, expert) pairs fetched from host memory.
    pub misses: u64,
    /// Weight bytes written to the GPU by those fetches.
    pub bytes: u64,
}

impl ExpertTraffic {
    /// Hits over hits and misses (0 before any).
    pub fn hit_rate(&self) -> f64 {
        self.hits as f64 / (self.hits + self.misses).max(1) as f64
    }
}

/// One layer's experts in host memory (as [`pack_blocks`] lays them out) and its slots.
struct LayerTier {
    /// Per expert: gate rows, up rows, down rows.
    host: Vec<[Vec<u32>; 3]>,
    /// Per expert: its slot, or `slots` when not resident (the GPU slot table's contents).
    slot_of: Vec<u32>,
    /// Per slot: the expert in it.
    holder: Vec<Option<u32>>,
    /// Per slot: the last step that used it.
    last_used: Vec<u64>,
    /// Per expert: steps that chose it.
    uses: Vec<u64>,
}

/// The expert tiers of a MoE file (see the module docs).
pub struct ExpertCache {
    /// Slots per layer and the policy.
    pub cfg: ExpertCacheConfig,
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

/// The slot a missing expert goes into: a free slot (the first), else among the slots whose
/// expert `needed` (sorted) does not hold, the least recently used (`Lru`) or the least often
/// chosen, then least recently used (`Lfu`); ties to the lower slot. `None` when every slot holds
/// a needed expert.
pub fn victim(policy: ExpertPolicy, holder: &[Option<u32>], last_used: &[u64], uses: &[u64], needed: &[u32]) -> Option<usize> {
    holder.iter().position(Option::is_none).or_else(|| {
        (0..holder.len()).filter(|&v| holder[v].is_some_and(|old| needed.binary_search(&old).is_err())).min_by_key(|&v| match policy {
            ExpertPolicy::Lru => (0, last_used[v]),
            ExpertPolicy::Lfu => (holder[v].map_or(0, |old| uses[old as usize]), last_used[v]),
        })
    })
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
            let split = |bytes: &[u8], fmt: WeightFormat, rows: u32, cols: u32, what: &str| -> Result<Vec<Vec<u32>>> {
                let per = bytes.len() / e as usize;
                if per * e as usize != bytes.len() {
                    return Err(Error::Model(format!("blk.{l}.{what}: {} bytes are not {e} experts", bytes.len())));
                }
                bytes.chunks_exact(per).map(|b| pack_blocks(fmt, rows, cols, b)).collect()
            };
            let (gs, us, ds) =
                (split(gate, fg, f, h, "ffn_gate_exps")?, split(up, fg, f, h, "ffn_up_exps")?, split(down, fd, h, f, "ffn_down_exps")?);
            let host = gs.into_iter().zip(us).zip(ds).map(|((a, b), d)| [a, b, d]).collect();
            ffns.push(MoeFfn::expert_slots(rt, &format!("blk.{l} experts"), (fg, fd), h, e, f, cfg.slots)?);
            layers.push(LayerTier {
                host,
                slot_of: vec![cfg.slots; e as usize],
                holder: vec![None; cfg.slots as usize],
                last_used: vec![0; cfg.slots as usize],
                uses: vec![0; e as usize],
            });
        }
        Ok((ExpertCache { cfg, layers, total: ExpertTraffic::default(), last: ExpertTraffic::default(), last_fetches: Vec::new() }, ffns))
    }

    /// Start a step's accounting.
    pub fn begin_step(&mut self) {
        self.last = ExpertTraffic::default();
        self.last_fetches.clear();
    }

    /// Make every expert of `chosen` (layer `layer`'s choices this step, any order, repeats
    /// allowed) resident in `ffn`'s slots before the layer's FFN runs: hits are touched; each
    /// missing expert is written into a free slot, else the policy's victim among the slots
    /// this step does not need; the slot table follows. `step` orders the uses (LRU).
    pub fn ensure(&mut self, rt: &Runtime, layer: u32, chosen: &[u32], step: u64, ffn: &MoeFfn) -> Result<()> {
        let slots = self.cfg.slots;
        let policy = self.cfg.policy;
        let t = self.layers.get_mut(layer as usize).ok_or_else(|| Error::Input(format!("expert cache: layer {layer}")))?;
        let e = t.slot_of.len() as u32;
        let mut needed: Vec<u32> = chosen.to_vec();
        needed.sort_unstable();
        needed.dedup();
        if let Some(bad) = needed.iter().find(|&&x| x >= e) {
            return Err(Error::Gpu { during: "expert cache".into(), message: format!("layer {layer} chose expert {bad} of {e}") });
        }
        if needed.len() as u32 > slots {
            return Err(Error::Input(format!("expert cache: layer {layer} needs {} experts at once, {slots} slots", needed.len())));
        }
        let MoeDown::Experts(down) = &ffn.down else {
            return Err(Error::Input("expert cache: the layer's experts are not slotted".into()));
        };
        let mut changed = false;
        for &x in &needed {
            t.uses[x as usize] += 1;
            let s = t.slot_of[x as usize];
            if s < slots {
                t.last_used[s as usize] = step;
                self.last.hits += 1;
                continue;
            }
            let Some(v) = victim(policy, &t.holder, &t.last_used, &t.uses, &needed) else {
                return Err(Error::Input(format!("expert cache: no slot of layer {layer} is free of this step's experts")));
            };
            if let Some(old) = t.holder[v] {
                t.slot_of[old as usize] = slots;
            }
            self.last_fetches.push(crate::forward::trace::ExpertFetch { layer, expert: x, slot: v as u32, evicted: t.holder[v] });
            let [gate, up, dn] = &t.host[x as usize];
            let v64 = v as u64;
            // Slot v: gate rows at v * f, up rows at (slots + v) * f, down rows at v * hidden.
            let (gw, dw) = (gate.len() as u64 * 4, dn.len() as u64 * 4);
            rt.queue.write_buffer(&ffn.gate_up.buffer, v64 * gw, bytemuck::cast_slice(gate));
            rt.queue.write_buffer(&ffn.gate_up.buffer, (u64::from(slots) + v64) * gw, bytemuck::cast_slice(up));
            rt.queue.write_buffer(&down.buffer, v64 * dw, bytemuck::cast_slice(dn));
            t.holder[v] = Some(x);
            t.slot_of[x as usize] = v as u32;
            t.last_used[v] = step;
            self.last.misses += 1;
            self.last.bytes += 2 * gw + dw;
            changed = true;
        }
        if changed {
            rt.queue.write_buffer(&ffn.offsets, 0, bytemuck::cast_slice(&t.slot_of));
        }
        Ok(())
    }

    /// Add the last step's traffic to the total.
    pub fn end_step(&mut self) {
        self.total.hits += self.last.hits;
        self.total.misses += self.last.misses;
        self.total.bytes += self.last.bytes;
    }

    /// GPU bytes of every layer's slots (gate, up and down rows of each slot).
    pub fn gpu_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|t| t.host.first().map_or(0, |[a, b, d]| (a.len() + b.len() + d.len()) as u64 * 4) * u64::from(self.cfg.slots))
            .sum()
    }

    /// Host bytes holding every expert.
    pub fn host_bytes(&self) -> u64 {
        self.layers.iter().flat_map(|t| &t.host).map(|[a, b, d]| (a.len() + b.len() + d.len()) as u64 * 4).sum()
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
        let full = [Some(4), Some(1), Some(7), Some(2)];
        let last = [5, 3, 3, 9];
        // Uses per expert 0..8.
        let uses = [0, 10, 1, 0, 2, 0, 0, 8, 0];
        assert_eq!(victim(ExpertPolicy::Lru, &[Some(4), None, Some(7), None], &last, &uses, &[]), Some(1));
        // LRU: slots 1 and 2 last used at 3: the lower; with expert 1 needed, slot 2.
        assert_eq!(victim(ExpertPolicy::Lru, &full, &last, &uses, &[]), Some(1));
        assert_eq!(victim(ExpertPolicy::Lru, &full, &last, &uses, &[1]), Some(2));
        assert_eq!(victim(ExpertPolicy::Lru, &full, &last, &uses, &[1, 7]), Some(0));
        // LFU: uses 2 (slot 0, expert 4), 10, 8, 1 (slot 3, expert 2): slot 3; then slot 0.
        assert_eq!(victim(ExpertPolicy::Lfu, &full, &last, &uses, &[]), Some(3));
        assert_eq!(victim(ExpertPolicy::Lfu, &full, &last, &uses, &[2]), Some(0));
        assert_eq!(victim(ExpertPolicy::Lfu, &full, &last, &uses, &[1, 2, 4, 7]), None);
        assert_eq!(min_slots(3, 2, 8), 6);
        assert_eq!(min_slots(8, 2, 8), 8);
    }
}
