//! The expert cache's flags, shared by `run`, `eval` and `view --model`.

use anyhow::{Context, Result, bail};
use expertkv_model::LlamaConfig;
use expertkv_model::experts::{ExpertCacheConfig, ExpertPolicy, ExpertPrefetch};

/// A MoE file's experts in tiers: how many GPU slots, which expert leaves one, and prefetch.
#[derive(clap::Args, Clone, Debug, PartialEq, Eq)]
pub struct ExpertArgs {
    /// A MoE file's experts in tiers: this many GPU slots per layer (a count, or a share of the
    /// layer's experts such as 25%), every expert in host memory, the missing ones fetched
    /// between a layer's router and its experts [default: every expert on the GPU].
    #[arg(long)]
    pub expert_slots: Option<String>,
    /// Which expert leaves a slot for a missing one: lru, lfu, or score (the lowest router score
    /// in the layer's latest scoring).
    #[arg(long, default_value = "lru")]
    pub expert_policy: String,
    /// Fetch experts ahead of their layer's router: none (on demand only), or pregate (each
    /// layer's FFN input scored by the next layer's router; that top k copied while the next
    /// attention runs).
    #[arg(long, default_value = "none")]
    pub expert_prefetch: String,
}

impl Default for ExpertArgs {
    fn default() -> Self {
        ExpertArgs { expert_slots: None, expert_policy: "lru".into(), expert_prefetch: "none".into() }
    }
}

impl ExpertArgs {
    /// The policy and prefetch named (an error naming the choices otherwise).
    pub fn policy(&self) -> Result<(ExpertPolicy, ExpertPrefetch)> {
        Ok((ExpertPolicy::from_name(&self.expert_policy)?, ExpertPrefetch::from_name(&self.expert_prefetch)?))
    }

    /// The cache for the model `c`, or `None` without `--expert-slots`.
    pub fn config(&self, c: &LlamaConfig) -> Result<Option<ExpertCacheConfig>> {
        let (policy, prefetch) = self.policy()?;
        let Some(spec) = self.expert_slots.as_deref() else { return Ok(None) };
        if c.expert_count == 0 {
            bail!("--expert-slots: this model has a dense FFN (no experts to cache)");
        }
        let slots = match spec.strip_suffix('%') {
            Some(p) => {
                let share: f64 = p
                    .trim()
                    .parse()
                    .ok()
                    .filter(|v: &f64| *v > 0.0 && *v <= 100.0)
                    .with_context(|| format!("--expert-slots {spec}: a share in (0, 100]%"))?;
                ((f64::from(c.expert_count) * share / 100.0).round() as u32).max(1)
            }
            None => spec
                .trim()
                .parse()
                .with_context(|| format!("--expert-slots {spec}: a whole number of slots per layer, or a share such as 25%"))?,
        };
        Ok(Some(ExpertCacheConfig { slots, policy, prefetch }))
    }
}
