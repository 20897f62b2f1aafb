//! The schedulers (eviction and placement policies), chosen by name with their parameters.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::gpu_data::{EvictParams, KEEP_ALL, policies};

/// A scheduler's budget: tokens kept per (layer, sequence, KV head), or a share of the context
/// (`25%`), which becomes tokens once the context is known.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Budget {
    /// A number of tokens, at least 1.
    Tokens(u32),
    /// Percent of the context, in (0, 100].
    Share(f64),
}

impl Budget {
    /// `64` (tokens) or `25%` (a share of the context).
    pub fn parse(s: &str) -> Result<Budget> {
        let b = s.trim();
        let bad = || Error::config("budget", b, "a number of tokens or a percentage like 25%");
        if let Some(pct) = b.strip_suffix('%') {
            let f: f64 = pct.trim().parse().map_err(|_| bad())?;
            if !(f > 0.0 && f <= 100.0) {
                return Err(Error::config("budget", b, "a percentage must be in (0, 100]"));
            }
            Ok(Budget::Share(f))
        } else {
            match b.parse::<u32>() {
                Ok(0) => Err(Error::config("budget", b, "keeping no token leaves nothing to attend")),
                Ok(t) => Ok(Budget::Tokens(t)),
                Err(_) => Err(bad()),
            }
        }
    }

    /// Tokens for a context of `context` tokens (a share rounds up, and keeps at least one).
    pub fn tokens(self, context: u32) -> u32 {
        match self {
            Budget::Tokens(t) => t,
            Budget::Share(f) => ((f64::from(context) * f / 100.0).ceil() as u32).max(1),
        }
    }
}

impl std::fmt::Display for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Budget::Tokens(t) => write!(f, "{t}"),
            Budget::Share(p) => write!(f, "{p}%"),
        }
    }
}

/// An eviction policy: a utility per cached token (or page) plus the shared budget enforcement.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "name", rename_all = "kebab-case", deny_unknown_fields)]
pub enum SchedulerConfig {
    /// H2O: keep the heavy hitters (accumulated attention mass), plus sinks and a recent window.
    H2o {
        /// First positions of the sequence always kept (attention sinks; default 4).
        sinks: u32,
        /// Most recent positions always kept (default 32; [`SchedulerConfig::parse_for_budget`]
        /// makes it half the budget).
        window: u32,
    },
    /// StreamingLLM: keep the attention sinks and the most recent tokens.
    StreamingLlm {
        /// First positions of the sequence always kept (default 4); the budget must exceed it.
        sinks: u32,
    },
    /// LRU: evict the least recently attended tokens.
    Lru,
    /// LRU+: recency, frequency and importance (attention mass), weighted.
    LruPlus {
        /// Weight of recency, the step of last access over the current step (default 1).
        w_recency: f32,
        /// Weight of frequency, ln(1 + accesses) (default 0.1).
        w_freq: f32,
        /// Weight of the accumulated attention mass (default 1).
        w_attn: f32,
        /// First positions of the sequence always kept (default 4).
        sinks: u32,
        /// Most recent positions always kept (default 32).
        window: u32,
    },
    /// AdaKV: the (layer, sequence) budget split over heads by how spread out their attention is.
    AdaKv {
        /// Share of the base budget every head keeps before the rest is split in proportion to
        /// exp(entropy of its attention mass), in [0, 1] (default 0.2).
        floor: f32,
        /// First positions of the sequence always kept (default 4).
        sinks: u32,
        /// Most recent positions always kept (default 32).
        window: u32,
    },
    /// DuoAttention: retrieval heads keep everything, streaming heads keep the budget (sinks +
    /// most recent tokens); heads are classified online from the share of their attention on
    /// sinks and the last `window` positions.
    Duo {
        /// Share of a head's attention mass on the sinks and the last `window` positions at or
        /// above which it is a streaming head, in [0, 1] (default 0.5).
        tau: f32,
        /// First positions of the sequence always kept (default 4).
        sinks: u32,
        /// Recent positions that, with the sinks, classify heads (default 64); not protected
        /// from eviction.
        window: u32,
    },
    /// QUEST: per-page key bounds; per query, attention reads only the pages with the highest
    /// bound on q.k (the budget's worth). Pages are selected, not evicted.
    Quest,
    /// FlexGen-style placement: the budget's worth of the hottest pages on the GPU, the rest in
    /// host memory, fetched back when a query's bound selects them.
    FlexGen,
    /// FastV as its paper prunes: from layer `from_layer` on, drop the least-attended context
    /// tokens (accumulated attention mass, no sinks or window protected) down to the budget;
    /// earlier layers keep everything.
    FastvTokens {
        /// First layer pruned, below the model's layer count (default 2).
        from_layer: u32,
    },
}

/// The scheduler names [`SchedulerConfig::default_for`] accepts, for help and error messages.
pub const SCHEDULER_NAMES: &str = "h2o, streaming-llm, lru, lru-plus, adakv, duo, quest, flexgen, fastv-tokens";

/// Largest PyramidKV ratio (first layer's budget over the last's) accepted.
pub const MAX_PYRAMID_RATIO: f32 = 64.0;

/// How the per-list utility threshold (extra eviction of low-mass tokens under the budget) is set.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Threshold {
    /// Evict tokens whose mass is under `tau` x the list's mean mass (0: budget only).
    Fixed {
        /// Multiple of the list's mean mass; finite and at least 0.
        tau: f32,
    },
    /// `tau` moves by `step` x (hit rate - target) every eviction: up while the kept attention
    /// share is above target (evict more), down when below.
    Adaptive {
        /// Hit rate aimed at: the share of a list's attention mass an eviction keeps, in [0, 1].
        target: f32,
        /// Change of `tau` per unit of hit-rate error per eviction; finite and at least 0
        /// (`tau` starts at 0 and stays in [0, 1]).
        step: f32,
    },
}

impl Default for Threshold {
    fn default() -> Self {
        Threshold::Fixed { tau: 0.0 }
    }
}

/// The EKVA allocator over an evicting scheduler: each page list's budget split over expert
/// groups (a token's group is its top-1 expert at that layer) in proportion to expert
/// importance, with a floor; importance is a moving average of routing frequency and attention
/// mass, updated on the GPU every eviction.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EkvaConfig {
    /// Share of a list's budget spread evenly over the groups holding tokens, before
    /// importance splits the rest.
    pub floor: f32,
    /// Weight of routing frequency in importance; the rest is attention mass.
    pub alpha: f32,
    /// Weight of the previous importance in its moving average (0: this step only).
    pub decay: f32,
}

impl Default for EkvaConfig {
    fn default() -> Self {
        EkvaConfig { floor: 0.25, alpha: 0.5, decay: 0.8 }
    }
}

/// Most expert groups the EKVA allocator splits a list into.
pub const EKVA_MAX_GROUPS: u32 = 256;

impl EkvaConfig {
    /// `none` (no allocator: `None`), `ekva` or `ekva:key=value,...` (floor, alpha, decay).
    pub fn parse(spec: &str) -> Result<Option<EkvaConfig>> {
        let (name, rest) = spec.split_once(':').unwrap_or((spec, ""));
        match name.trim() {
            "none" | "off" if rest.trim().is_empty() => return Ok(None),
            "ekva" => {}
            other => return Err(Error::config("allocator", other, "allowed values: none, ekva[:floor=F,alpha=A,decay=D]")),
        }
        let mut c = EkvaConfig::default();
        for kv in rest.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = kv.split_once('=').ok_or_else(|| Error::config("allocator", spec, format!("`{kv}` is not key=value")))?;
            let x: f32 = v
                .trim()
                .parse()
                .map_err(|_| Error::config("allocator", spec, format!("`{}` needs a number, got `{}`", k.trim(), v.trim())))?;
            match k.trim() {
                "floor" => c.floor = x,
                "alpha" => c.alpha = x,
                "decay" => c.decay = x,
                other => return Err(Error::config("allocator", spec, format!("ekva has no parameter `{other}` (floor, alpha, decay)"))),
            }
        }
        c.validate()?;
        Ok(Some(c))
    }

    /// Err naming the field unless floor, alpha and decay are all in [0, 1].
    pub fn validate(&self) -> Result<()> {
        for (field, v) in [("allocator.floor", self.floor), ("allocator.alpha", self.alpha), ("allocator.decay", self.decay)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(Error::config(field, v, "must be in [0, 1]"));
            }
        }
        Ok(())
    }

    /// The allocator as [`EkvaConfig::parse`] reads it back: `ekva:floor=F,alpha=A,decay=D`.
    pub fn spec(&self) -> String {
        format!("ekva:floor={},alpha={},decay={}", self.floor, self.alpha, self.decay)
    }

    /// The allocator's fields of the eviction kernels' parameter block.
    pub fn fill(&self, p: &mut EvictParams, n_experts: u32) {
        p.n_groups = n_experts;
        p.ekva_floor = self.floor;
        p.ekva_alpha = self.alpha;
        p.ekva_decay = self.decay;
    }
}

impl SchedulerConfig {
    /// The scheduler's canonical name (`streaming-llm`, not its aliases `streaming` or `sl`).
    pub fn name(&self) -> &'static str {
        match self {
            SchedulerConfig::H2o { .. } => "h2o",
            SchedulerConfig::StreamingLlm { .. } => "streaming-llm",
            SchedulerConfig::Lru => "lru",
            SchedulerConfig::LruPlus { .. } => "lru-plus",
            SchedulerConfig::AdaKv { .. } => "adakv",
            SchedulerConfig::Duo { .. } => "duo",
            SchedulerConfig::Quest => "quest",
            SchedulerConfig::FlexGen => "flexgen",
            SchedulerConfig::FastvTokens { .. } => "fastv-tokens",
        }
    }

    /// Whether the policy bounds the GPU pool (evicting, or placing pages in host memory); QUEST
    /// keeps every page and selects among them.
    pub fn evicts(&self) -> bool {
        !matches!(self, SchedulerConfig::Quest)
    }

    /// Whether `codec` runs under this scheduler: under the evicting ones (an eviction thaws the
    /// compressed pages it touches, see `compress::Thaw`), not under QUEST (it bounds each page
    /// from its raw keys) or FlexGen (it moves raw pages to the host tier).
    pub fn check_codec(&self, codec: crate::config::Codec) -> Result<()> {
        if codec == crate::config::Codec::None || self.uses_evict_kernels() {
            return Ok(());
        }
        let why =
            if matches!(self, SchedulerConfig::Quest) { "bounds each page from its raw keys" } else { "moves raw pages to the host tier" };
        Err(Error::config(
            "codec",
            codec.name(),
            format!(
                "codecs combine with the evicting schedulers (h2o, streaming-llm, lru, lru-plus, adakv, duo, fastv-tokens), not {}: it {why}",
                self.name()
            ),
        ))
    }

    /// Whether every page list keeps at most the budget after each eviction, whatever its
    /// attention (H2O, StreamingLLM, LRU, LRU+): a pool for such a scheduler need hold only the
    /// budget's pages per list. AdaKV splits a (layer, sequence) budget unevenly over heads,
    /// DuoAttention's retrieval heads and FastV's early layers keep everything, QUEST and
    /// FlexGen do not evict from the pool.
    pub fn keeps_budget_per_list(&self) -> bool {
        matches!(
            self,
            SchedulerConfig::H2o { .. } | SchedulerConfig::StreamingLlm { .. } | SchedulerConfig::Lru | SchedulerConfig::LruPlus { .. }
        )
    }

    /// Whether the policy runs on the shared GPU eviction kernels (`evict/*`).
    pub fn uses_evict_kernels(&self) -> bool {
        !matches!(self, SchedulerConfig::Quest | SchedulerConfig::FlexGen)
    }

    /// The scheduler of this name (or alias) with default parameters.
    pub fn default_for(name: &str) -> Result<SchedulerConfig> {
        Ok(match name {
            "h2o" => SchedulerConfig::H2o { sinks: 4, window: 32 },
            "streaming-llm" | "streaming" | "sl" => SchedulerConfig::StreamingLlm { sinks: 4 },
            "lru" => SchedulerConfig::Lru,
            "lru-plus" | "lru+" => SchedulerConfig::LruPlus { w_recency: 1.0, w_freq: 0.1, w_attn: 1.0, sinks: 4, window: 32 },
            "adakv" => SchedulerConfig::AdaKv { floor: 0.2, sinks: 4, window: 32 },
            "duo" | "duo-attention" => SchedulerConfig::Duo { tau: 0.5, sinks: 4, window: 64 },
            "quest" => SchedulerConfig::Quest,
            "flexgen" => SchedulerConfig::FlexGen,
            "fastv-tokens" | "fastv" => SchedulerConfig::FastvTokens { from_layer: 2 },
            other => return Err(Error::config("scheduler", other, format!("allowed values: {SCHEDULER_NAMES}"))),
        })
    }

    /// `name` or `name:key=value,...`.
    pub fn parse(spec: &str) -> Result<SchedulerConfig> {
        let (name, rest) = spec.split_once(':').unwrap_or((spec, ""));
        let mut cfg = SchedulerConfig::default_for(name.trim())?;
        for kv in rest.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = kv.split_once('=').ok_or_else(|| Error::config("scheduler", spec, format!("`{kv}` is not key=value")))?;
            let (k, v) = (k.trim(), v.trim());
            let f = || v.parse::<f32>().map_err(|_| Error::config("scheduler", spec, format!("`{k}` needs a number, got `{v}`")));
            let u = || v.parse::<u32>().map_err(|_| Error::config("scheduler", spec, format!("`{k}` needs a whole number, got `{v}`")));
            let name = cfg.name();
            match (&mut cfg, k) {
                (
                    SchedulerConfig::H2o { sinks, .. }
                    | SchedulerConfig::StreamingLlm { sinks }
                    | SchedulerConfig::LruPlus { sinks, .. }
                    | SchedulerConfig::AdaKv { sinks, .. }
                    | SchedulerConfig::Duo { sinks, .. },
                    "sinks",
                ) => *sinks = u()?,
                (
                    SchedulerConfig::H2o { window, .. }
                    | SchedulerConfig::LruPlus { window, .. }
                    | SchedulerConfig::AdaKv { window, .. }
                    | SchedulerConfig::Duo { window, .. },
                    "window",
                ) => *window = u()?,
                (SchedulerConfig::LruPlus { w_recency, .. }, "w_recency") => *w_recency = f()?,
                (SchedulerConfig::LruPlus { w_freq, .. }, "w_freq") => *w_freq = f()?,
                (SchedulerConfig::LruPlus { w_attn, .. }, "w_attn") => *w_attn = f()?,
                (SchedulerConfig::AdaKv { floor, .. }, "floor") => *floor = f()?,
                (SchedulerConfig::Duo { tau, .. }, "tau") => *tau = f()?,
                (SchedulerConfig::FastvTokens { from_layer }, "from_layer") => *from_layer = u()?,
                _ => return Err(Error::config("scheduler", spec, format!("scheduler `{name}` has no parameter `{k}`"))),
            }
        }
        Ok(cfg)
    }

    /// [`SchedulerConfig::parse`] for a known budget: where the spec leaves a parameter to the
    /// method's paper and the paper sets it from the budget, it is set so. H2O's heavy hitters
    /// and recent window split the budget evenly (window = budget / 2) unless `window=` is given.
    pub fn parse_for_budget(spec: &str, budget: u32) -> Result<SchedulerConfig> {
        let mut cfg = SchedulerConfig::parse(spec)?;
        let given = |key: &str| {
            spec.split_once(':').is_some_and(|(_, rest)| rest.split(',').any(|kv| kv.split_once('=').is_some_and(|(k, _)| k.trim() == key)))
        };
        if let SchedulerConfig::H2o { window, .. } = &mut cfg
            && !given("window")
        {
            *window = budget / 2;
        }
        Ok(cfg)
    }

    /// Check the parameters on their own and against `budget` (tokens per list); the error
    /// names the field.
    pub fn validate(&self, budget: u32) -> Result<()> {
        let fin = |field: &'static str, v: f32| if v.is_finite() { Ok(()) } else { Err(Error::config(field, v, "must be finite")) };
        match *self {
            SchedulerConfig::LruPlus { w_recency, w_freq, w_attn, .. } => {
                fin("scheduler.w_recency", w_recency)?;
                fin("scheduler.w_freq", w_freq)?;
                fin("scheduler.w_attn", w_attn)?;
            }
            SchedulerConfig::AdaKv { floor, .. } if !(0.0..=1.0).contains(&floor) => {
                return Err(Error::config("scheduler.floor", floor, "must be in [0, 1]"));
            }
            SchedulerConfig::Duo { tau, .. } if !(0.0..=1.0).contains(&tau) => {
                return Err(Error::config("scheduler.tau", tau, "must be in [0, 1]"));
            }
            _ => {}
        }
        if let SchedulerConfig::StreamingLlm { sinks } = *self
            && sinks >= budget
        {
            return Err(Error::config("budget", budget, format!("StreamingLLM needs a budget above its {sinks} sinks")));
        }
        Ok(())
    }

    /// Every layer's base budget (`KEEP_ALL`: the layer keeps everything). Uniform by default;
    /// FastV keeps its early layers whole; PyramidKV (`pyramid` = r, the first pruned layer's
    /// budget over the last's) shrinks it linearly with depth, the budgets averaging `budget`
    /// over the pruned layers (largest-remainder rounding, so they sum exactly).
    pub fn layer_budgets(&self, budget: u32, layers: u32, pyramid: Option<f32>, page_size: u32) -> Result<Vec<u32>> {
        let first = match *self {
            SchedulerConfig::FastvTokens { from_layer } if from_layer >= layers => {
                return Err(Error::config(
                    "scheduler.from_layer",
                    from_layer,
                    format!("the model has {layers} layers; FastV prunes from a layer below that"),
                ));
            }
            SchedulerConfig::FastvTokens { from_layer } => from_layer,
            _ => 0,
        };
        let mut out = vec![KEEP_ALL; first as usize];
        let n = layers - first;
        let r = match pyramid {
            None => 1.0,
            Some(r) if r.is_finite() && (1.0..=MAX_PYRAMID_RATIO).contains(&r) => f64::from(r),
            Some(r) => return Err(Error::config("pyramid", r, format!("the ratio must be in [1, {MAX_PYRAMID_RATIO}]"))),
        };
        // w_i linear from a (first) to b (last), a / b = r, mean 1.
        let (a, b) = (2.0 * r / (1.0 + r), 2.0 / (1.0 + r));
        let ideal: Vec<f64> = (0..n)
            .map(|i| {
                let t = if n > 1 { f64::from(i) / f64::from(n - 1) } else { 0.5 };
                (a + (b - a) * t) * f64::from(budget)
            })
            .collect();
        let mut alloc: Vec<u32> = ideal.iter().map(|x| x.floor() as u32).collect();
        let total = u64::from(budget) * u64::from(n);
        let mut left = total - alloc.iter().map(|&x| u64::from(x)).sum::<u64>();
        let mut order: Vec<usize> = (0..n as usize).collect();
        // Largest fractional part first; ties to the shallower layer.
        order.sort_by(|&i, &j| (ideal[j] - ideal[j].floor()).total_cmp(&(ideal[i] - ideal[i].floor())).then(i.cmp(&j)));
        for &i in order.iter().cycle() {
            if left == 0 {
                break;
            }
            alloc[i] += 1;
            left -= 1;
        }
        if let Some((i, &b)) = alloc.iter().enumerate().find(|&(_, &b)| b < page_size) {
            let layer = first as usize + i;
            return Err(match pyramid {
                Some(r) => Error::config(
                    "pyramid",
                    r,
                    format!("layer {layer} would keep {b} tokens, below one page ({page_size}); raise the budget or lower the ratio"),
                ),
                None => Error::config("budget", budget, format!("{budget} tokens is below one page ({page_size} tokens)")),
            });
        }
        out.extend(alloc);
        Ok(out)
    }

    /// The policy's fields of the kernels' parameter block.
    pub fn fill(&self, p: &mut EvictParams) {
        let (policy, sinks, window) = match *self {
            SchedulerConfig::H2o { sinks, window } => (policies::H2O, sinks, window),
            SchedulerConfig::StreamingLlm { sinks } => (policies::STREAMING, sinks, 0),
            SchedulerConfig::Lru => (policies::LRU, 0, 0),
            SchedulerConfig::LruPlus { w_recency, w_freq, w_attn, sinks, window } => {
                p.w_recency = w_recency;
                p.w_freq = w_freq;
                p.w_attn = w_attn;
                (policies::LRU_PLUS, sinks, window)
            }
            SchedulerConfig::AdaKv { floor, sinks, window } => {
                p.ada_floor = floor;
                (policies::ADAKV, sinks, window)
            }
            SchedulerConfig::Duo { tau, sinks, window } => {
                p.duo_tau = tau;
                (policies::DUO, sinks, window)
            }
            // H2O's utility with nothing protected; the early layers' budgets are KEEP_ALL.
            SchedulerConfig::FastvTokens { .. } => (policies::H2O, 0, 0),
            // Not evict/* policies: those kernels never run with them.
            SchedulerConfig::Quest | SchedulerConfig::FlexGen => (u32::MAX, 0, 0),
        };
        p.policy = policy;
        p.sinks = sinks;
        p.window = window;
    }

    /// The default scheduler of every kind, in [`SCHEDULER_NAMES`]'s order.
    pub fn all_defaults() -> Vec<SchedulerConfig> {
        ["h2o", "streaming-llm", "lru", "lru-plus", "adakv", "duo", "quest", "flexgen", "fastv-tokens"]
            .iter()
            .filter_map(|n| SchedulerConfig::default_for(n).ok())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ekva_parse() {
        assert_eq!(EkvaConfig::parse("none").unwrap(), None);
        assert_eq!(EkvaConfig::parse("ekva").unwrap(), Some(EkvaConfig::default()));
        let c = EkvaConfig::parse("ekva:floor=0.5, alpha=1,decay=0").unwrap().unwrap();
        assert_eq!((c.floor, c.alpha, c.decay), (0.5, 1.0, 0.0));
        assert_eq!(EkvaConfig::parse(&c.spec()).unwrap(), Some(c));
        for bad in ["ekva:floor=2", "ekva:beta=1", "ekva:floor", "ekva:alpha=x", "pikv", "none:floor=1"] {
            let e = EkvaConfig::parse(bad).unwrap_err().to_string();
            assert!(e.contains("allocator"), "{bad}: {e}");
        }
    }

    #[test]
    fn h2o_splits_the_budget_as_its_paper_unless_told() {
        assert_eq!(SchedulerConfig::parse_for_budget("h2o", 512).unwrap(), SchedulerConfig::H2o { sinks: 4, window: 256 });
        assert_eq!(SchedulerConfig::parse_for_budget("h2o:sinks=2", 64).unwrap(), SchedulerConfig::H2o { sinks: 2, window: 32 });
        assert_eq!(SchedulerConfig::parse_for_budget("h2o:window=16", 512).unwrap(), SchedulerConfig::H2o { sinks: 4, window: 16 });
        assert_eq!(SchedulerConfig::parse_for_budget("lru-plus", 512).unwrap(), SchedulerConfig::parse("lru-plus").unwrap());
    }

    #[test]
    fn parse_and_validate() {
        assert_eq!(SchedulerConfig::parse("h2o:window=8").unwrap(), SchedulerConfig::H2o { sinks: 4, window: 8 });
        assert!(SchedulerConfig::parse("lru:window=8").unwrap_err().to_string().contains("no parameter"));
        assert!(SchedulerConfig::parse("belady").unwrap_err().to_string().contains("allowed values"));
        assert!(SchedulerConfig::StreamingLlm { sinks: 8 }.validate(4).unwrap_err().to_string().contains("budget"));
        assert_eq!(SchedulerConfig::parse("fastv-tokens:from_layer=3").unwrap(), SchedulerConfig::FastvTokens { from_layer: 3 });
        for s in SchedulerConfig::all_defaults() {
            let j = serde_json::to_string(&s).unwrap();
            assert_eq!(serde_json::from_str::<SchedulerConfig>(&j).unwrap(), s);
        }
    }

    #[test]
    fn layer_budgets() {
        let h2o = SchedulerConfig::H2o { sinks: 4, window: 8 };
        assert_eq!(h2o.layer_budgets(64, 4, None, 16).unwrap(), vec![64; 4]);
        // PyramidKV: shrinking with depth, first / last close to the ratio, same total.
        let b = h2o.layer_budgets(100, 7, Some(3.0), 16).unwrap();
        assert!(b.windows(2).all(|w| w[0] > w[1]), "{b:?}");
        assert_eq!(b.iter().sum::<u32>(), 700);
        assert!((f64::from(b[0]) / f64::from(b[6]) - 3.0).abs() < 0.1, "{b:?}");
        assert!(h2o.layer_budgets(32, 8, Some(8.0), 16).unwrap_err().to_string().contains("below one page"));
        assert!(h2o.layer_budgets(32, 8, Some(0.5), 16).unwrap_err().to_string().contains("ratio"));
        // FastV: early layers whole; a pyramid over the pruned layers only.
        let f = SchedulerConfig::FastvTokens { from_layer: 2 };
        let b = f.layer_budgets(50, 5, Some(2.0), 8).unwrap();
        assert_eq!(&b[..2], &[KEEP_ALL, KEEP_ALL]);
        assert_eq!(b[2..].iter().sum::<u32>(), 150);
        assert!(f.layer_budgets(50, 2, None, 8).unwrap_err().to_string().contains("from_layer"));
    }

    #[test]
    fn budgets_are_tokens_or_shares_of_the_context() {
        assert_eq!(Budget::parse("64").unwrap(), Budget::Tokens(64));
        assert_eq!(Budget::parse(" 25% ").unwrap(), Budget::Share(25.0));
        assert_eq!(Budget::parse("25%").unwrap().tokens(1000), 250);
        assert_eq!(Budget::parse("12.5%").unwrap().tokens(1001), 126, "rounds up");
        assert_eq!(Budget::parse("0.01%").unwrap().tokens(10), 1, "keeps a token");
        assert_eq!(Budget::Tokens(64).tokens(10), 64);
        assert_eq!(Budget::parse("25%").unwrap().to_string(), "25%");
        for bad in ["", "0", "-3", "0%", "101%", "x%", "1e3", "25 %%"] {
            assert!(Budget::parse(bad).is_err(), "{bad:?}");
        }
    }
}
