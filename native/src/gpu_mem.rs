//! `run --gpu-mem BYTES`: one GPU memory budget for the K/V pool and a MoE file's experts.
//!
//! The split is planned before the model loads, from what each side will allocate
//! ([`ModelOptions::kv_bytes`], [`ExpertBytes`]): the K/V side the run's options need (the pool
//! for the whole context, or FlexGen's GPU tier, with a codec's compressed pages; QUEST's page
//! bounds where QUEST or FlexGen selects pages), then as many expert slots per layer as the rest
//! holds, up to every expert. A budget that cannot hold the pool and one step's experts is
//! refused with the minimum stated. After loading, the bytes the two sides allocated are
//! measured and must be within the budget. The rest of the model (attention weights,
//! embeddings, routers), per-step scratch and small uniforms are outside the budget.

use anyhow::{Result, bail};
use expertkv_core::config::Codec;
use expertkv_core::evict::config::SchedulerConfig;
use expertkv_model::LlamaConfig;
use expertkv_model::experts::{ExpertBytes, ExpertCacheConfig, ExpertPolicy, ExpertPrefetch, min_slots};
use expertkv_model::forward::{GpuLlama, ModelOptions};
use expertkv_model::gguf::Gguf;
use serde::Serialize;

use crate::fmt_bytes;

/// How the budget was split, and what the load then allocated.
#[derive(Clone, Debug, Serialize)]
pub struct GpuMemPlan {
    /// The budget, bytes.
    pub budget: u64,
    /// The K/V side's bytes (the pool's pages and tables, QUEST's bounds), as planned.
    pub kv_bytes: u64,
    /// The experts' bytes as planned (0 for a dense model).
    pub expert_bytes: u64,
    /// Expert slots per layer (the expert count when every expert fits), if the model has experts.
    pub slots_per_layer: Option<u32>,
    /// The experts per layer.
    pub experts_per_layer: u32,
    /// Bytes the pool and the experts allocated, measured after loading.
    pub allocated: u64,
}

/// Split `budget` for the model `c` (file `g`) run with `opts` (whose `experts` is ignored) on a
/// device with storage bindings of `max_binding` bytes: the options with the expert cache the
/// budget allows, and the plan. `policy` picks the victims and `prefetch` says whether experts
/// are fetched ahead when not every expert fits.
pub fn plan(
    budget: u64,
    g: &Gguf<'_>,
    c: &LlamaConfig,
    opts: ModelOptions,
    (policy, prefetch): (ExpertPolicy, ExpertPrefetch),
    max_binding: u64,
) -> Result<(ModelOptions, GpuMemPlan)> {
    let kv = opts.kv_bytes(c, max_binding)?;
    let seqs = if opts.n_seqs == 1 { "1 sequence".to_string() } else { format!("{} sequences", opts.n_seqs) };
    let codec = if opts.codec == Codec::None { String::new() } else { format!(", {} pages", opts.codec.spec()) };
    let flexgen = matches!(opts.scheduler, Some((SchedulerConfig::FlexGen, _)));
    let what_kv = match &opts.scheduler {
        Some((SchedulerConfig::FlexGen, b)) => {
            format!("the K/V pool ({seqs}, FlexGen's GPU tier of {b} tokens per layer and KV head{codec})")
        }
        Some((s, b)) if s.keeps_budget_per_list() && opts.pyramid.is_none() => {
            format!("the K/V pool ({seqs}, {} keeping {b} tokens per layer and KV head{codec})", s.name())
        }
        _ => format!("the K/V pool ({seqs} of {} tokens{codec})", opts.max_context),
    };
    let smaller = if flexgen {
        "a smaller FlexGen --budget or a page codec"
    } else {
        "a page codec (--codec int4, say), an evicting scheduler's budget (--scheduler h2o --budget N) or FlexGen's host tier"
    };
    let Some(eb) = ExpertBytes::of(g, c)? else {
        if kv > budget {
            bail!(
                "--gpu-mem {}: {what_kv} needs {}; give at least {kv} bytes, or shrink the pool with {smaller}",
                fmt_bytes(budget),
                fmt_bytes(kv)
            );
        }
        let plan = GpuMemPlan { budget, kv_bytes: kv, expert_bytes: 0, slots_per_layer: None, experts_per_layer: 0, allocated: 0 };
        return Ok((opts.expert_cache(None), plan));
    };
    let e = c.expert_count;
    let least = min_slots(opts.n_seqs, c.expert_used_count, e);
    let need = kv + eb.with_slots(least);
    if need > budget {
        bail!(
            "--gpu-mem {}: {what_kv} needs {} and one step's experts ({least} of {e} per layer, {} each in all layers) {}; give at least {need} bytes ({})",
            fmt_bytes(budget),
            fmt_bytes(kv),
            fmt_bytes(eb.per_slot),
            fmt_bytes(eb.with_slots(least)),
            fmt_bytes(need)
        );
    }
    if eb.per_slot == 0 {
        bail!("--gpu-mem: this file's experts take no bytes on the GPU (a degenerate FFN shape)");
    }
    let slots = (((budget - kv - eb.fixed) / eb.per_slot).min(u64::from(e))) as u32;
    let cache = (slots < e).then_some(ExpertCacheConfig { slots, policy, prefetch });
    let plan = GpuMemPlan {
        budget,
        kv_bytes: kv,
        expert_bytes: eb.with_slots(slots),
        slots_per_layer: Some(slots),
        experts_per_layer: e,
        allocated: 0,
    };
    Ok((opts.expert_cache(cache), plan))
}

impl GpuMemPlan {
    /// Measure what `m` allocated for its pool and experts; an error if it is not what was
    /// planned or exceeds the budget.
    pub fn measure(&mut self, m: &GpuLlama) -> Result<()> {
        let (kv, experts) = (m.kv_bytes_allocated(), m.expert_bytes_allocated());
        self.allocated = kv + experts;
        if kv != self.kv_bytes || experts != self.expert_bytes || self.allocated > self.budget {
            bail!(
                "--gpu-mem {}: the pool allocated {kv} bytes and the experts {experts}, where {} and {} were planned",
                self.budget,
                self.kv_bytes,
                self.expert_bytes
            );
        }
        Ok(())
    }

    /// One line for the run's output.
    pub fn line(&self) -> String {
        let experts = match self.slots_per_layer {
            Some(s) if s == self.experts_per_layer => format!("experts {} (all {s} per layer)", fmt_bytes(self.expert_bytes)),
            Some(s) => format!(
                "experts {} ({s} of {} slots per layer, the rest in host memory)",
                fmt_bytes(self.expert_bytes),
                self.experts_per_layer
            ),
            None => "no experts".into(),
        };
        format!(
            "gpu-mem: {} budget: K/V pool {}, {experts}; {} allocated ({:.1}%)",
            fmt_bytes(self.budget),
            fmt_bytes(self.kv_bytes),
            fmt_bytes(self.allocated),
            100.0 * self.allocated as f64 / self.budget as f64
        )
    }
}
