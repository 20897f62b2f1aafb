//! The seven routers, chosen by name with their parameters.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::gpu_data::{RouteParams, routers};

/// A router and its parameters. Every router selects the top-k experts of `logit + bias` (ties
/// to the lowest expert index; the hash router ignores scores) and gates them with the model's
/// softmax renormalised over the chosen k; they differ in the bias (see `route/bias.wgsl`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "name", rename_all = "kebab-case", deny_unknown_fields)]
pub enum RouterConfig {
    /// Base hash: k consecutive experts from a hash of the token's id.
    Hash,
    /// TopK softmax: the model's own top-k.
    Topk,
    /// TopK + load balance: bias -alpha (load_e - mean load).
    LoadBalance {
        /// Strength of the pull towards the mean load (default 4).
        alpha: f32,
    },
    /// PiKV cache-aware: bias -lambda log(1 + miss_e).
    CacheAware {
        /// Strength of the miss-rate penalty (default 2).
        lambda: f32,
    },
    /// Entropy-penalised (EPLB-style): bias beta log(load_e + 1/(16E)), the marginal effect of a
    /// routing slot on the routing entropy; beta > 0 concentrates routing, beta < 0 spreads it.
    Entropy {
        /// Sign and strength of the entropy term (default 0.5).
        beta: f32,
    },
    /// Learns a bias online on the GPU: expected cost (c_miss miss + c_lb overload) + kappa KL.
    Adaptive {
        /// Step size of the bias update, `b -= lr * grad`; at least 0 (default 2).
        lr: f32,
        /// Weight of KL(softmax(logit + b) || softmax(logit)), which keeps routing near the
        /// model's own; at least 0 (default 1).
        kappa: f32,
        /// Cost per unit of an expert's miss rate (default 1).
        c_miss: f32,
        /// Cost per unit of an expert's overload, `load * E - 1` (default 0.1).
        c_lb: f32,
    },
    /// Top `topk_groups` of `groups` expert groups by their best score, then top-k within them.
    Hierarchical {
        /// Groups of consecutive experts; must divide the expert count (default 8).
        groups: u32,
        /// Groups kept per token, in 1..=min(8, groups), holding at least top_k experts (default 4).
        topk_groups: u32,
    },
}

/// The router names [`RouterConfig::default_for`] accepts (aliases in brackets), for help and
/// error messages.
pub const ROUTER_NAMES: &str = "hash, topk, load-balance, cache-aware (pikv), entropy (eplb), adaptive, hierarchical";

impl RouterConfig {
    /// The router's canonical name (`cache-aware`, not its alias `pikv`).
    pub fn name(&self) -> &'static str {
        match self {
            RouterConfig::Hash => "hash",
            RouterConfig::Topk => "topk",
            RouterConfig::LoadBalance { .. } => "load-balance",
            RouterConfig::CacheAware { .. } => "cache-aware",
            RouterConfig::Entropy { .. } => "entropy",
            RouterConfig::Adaptive { .. } => "adaptive",
            RouterConfig::Hierarchical { .. } => "hierarchical",
        }
    }

    /// The router of this name with default parameters.
    pub fn default_for(name: &str) -> Result<RouterConfig> {
        Ok(match name {
            "hash" | "round-robin" => RouterConfig::Hash,
            "topk" => RouterConfig::Topk,
            "load-balance" | "lb" => RouterConfig::LoadBalance { alpha: 4.0 },
            "cache-aware" | "pikv" => RouterConfig::CacheAware { lambda: 2.0 },
            "entropy" | "eplb" => RouterConfig::Entropy { beta: 0.5 },
            "adaptive" => RouterConfig::Adaptive { lr: 2.0, kappa: 1.0, c_miss: 1.0, c_lb: 0.1 },
            "hierarchical" => RouterConfig::Hierarchical { groups: 8, topk_groups: 4 },
            other => return Err(Error::config("router", other, format!("allowed values: {ROUTER_NAMES}"))),
        })
    }

    /// `name` or `name:key=value,key=value` (keys are the parameter names above).
    pub fn parse(spec: &str) -> Result<RouterConfig> {
        let (name, rest) = spec.split_once(':').unwrap_or((spec, ""));
        let mut cfg = RouterConfig::default_for(name.trim())?;
        for kv in rest.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = kv.split_once('=').ok_or_else(|| Error::config("router", spec, format!("`{kv}` is not key=value")))?;
            let (k, v) = (k.trim(), v.trim());
            let f = || v.parse::<f32>().map_err(|_| Error::config("router", spec, format!("`{k}` needs a number, got `{v}`")));
            let u = || v.parse::<u32>().map_err(|_| Error::config("router", spec, format!("`{k}` needs a whole number, got `{v}`")));
            match (&mut cfg, k) {
                (RouterConfig::LoadBalance { alpha }, "alpha") => *alpha = f()?,
                (RouterConfig::CacheAware { lambda }, "lambda") => *lambda = f()?,
                (RouterConfig::Entropy { beta }, "beta") => *beta = f()?,
                (RouterConfig::Adaptive { lr, .. }, "lr") => *lr = f()?,
                (RouterConfig::Adaptive { kappa, .. }, "kappa") => *kappa = f()?,
                (RouterConfig::Adaptive { c_miss, .. }, "c_miss") => *c_miss = f()?,
                (RouterConfig::Adaptive { c_lb, .. }, "c_lb") => *c_lb = f()?,
                (RouterConfig::Hierarchical { groups, .. }, "groups") => *groups = u()?,
                (RouterConfig::Hierarchical { topk_groups, .. }, "topk_groups") => *topk_groups = u()?,
                _ => return Err(Error::config("router", spec, format!("router `{}` has no parameter `{k}`", cfg.name()))),
            }
        }
        Ok(cfg)
    }

    /// Check the router against the routing shape; the error names the field.
    pub fn validate(&self, n_experts: u32, top_k: u32) -> Result<()> {
        if n_experts == 0 || n_experts > 256 {
            return Err(Error::config("n_experts", n_experts, "must be in 1..=256"));
        }
        if top_k == 0 || top_k > 8 || top_k > n_experts {
            return Err(Error::config("top_k", top_k, format!("must be in 1..=min(8, n_experts = {n_experts})")));
        }
        let finite = |field: &'static str, v: f32| if v.is_finite() { Ok(()) } else { Err(Error::config(field, v, "must be finite")) };
        match *self {
            RouterConfig::LoadBalance { alpha } => finite("router.alpha", alpha)?,
            RouterConfig::CacheAware { lambda } => finite("router.lambda", lambda)?,
            RouterConfig::Entropy { beta } => finite("router.beta", beta)?,
            RouterConfig::Adaptive { lr, kappa, c_miss, c_lb } => {
                finite("router.lr", lr)?;
                finite("router.kappa", kappa)?;
                finite("router.c_miss", c_miss)?;
                finite("router.c_lb", c_lb)?;
                if lr < 0.0 {
                    return Err(Error::config("router.lr", lr, "must be >= 0"));
                }
                if kappa < 0.0 {
                    return Err(Error::config("router.kappa", kappa, "must be >= 0"));
                }
            }
            RouterConfig::Hierarchical { groups, topk_groups } => {
                if groups == 0 || !n_experts.is_multiple_of(groups) {
                    return Err(Error::config("router.groups", groups, format!("must divide n_experts = {n_experts}")));
                }
                if topk_groups == 0 || topk_groups > groups.min(8) {
                    return Err(Error::config("router.topk_groups", topk_groups, format!("must be in 1..=min(8, groups = {groups})")));
                }
                if topk_groups * (n_experts / groups) < top_k {
                    return Err(Error::config(
                        "router.topk_groups",
                        topk_groups,
                        format!("the kept groups hold {} experts, fewer than top_k = {top_k}", topk_groups * (n_experts / groups)),
                    ));
                }
            }
            RouterConfig::Hash | RouterConfig::Topk => {}
        }
        Ok(())
    }

    /// The router's fields of the kernels' parameter block.
    pub fn fill(&self, p: &mut RouteParams) {
        p.router = match self {
            RouterConfig::Hash => routers::HASH,
            RouterConfig::Topk => routers::TOPK,
            RouterConfig::LoadBalance { .. } => routers::LOAD_BALANCE,
            RouterConfig::CacheAware { .. } => routers::CACHE_AWARE,
            RouterConfig::Entropy { .. } => routers::ENTROPY,
            RouterConfig::Adaptive { .. } => routers::ADAPTIVE,
            RouterConfig::Hierarchical { .. } => routers::HIERARCHICAL,
        };
        p.n_groups = 1;
        p.topk_groups = 1;
        match *self {
            RouterConfig::LoadBalance { alpha } => p.alpha = alpha,
            RouterConfig::CacheAware { lambda } => p.lambda = lambda,
            RouterConfig::Entropy { beta } => p.beta = beta,
            RouterConfig::Adaptive { lr, kappa, c_miss, c_lb } => {
                p.lr = lr;
                p.kappa = kappa;
                p.c_miss = c_miss;
                p.c_lb = c_lb;
            }
            RouterConfig::Hierarchical { groups, topk_groups } => {
                p.n_groups = groups;
                p.topk_groups = topk_groups;
            }
            RouterConfig::Hash | RouterConfig::Topk => {}
        }
    }

    /// The default router of every kind, in the order of the article.
    pub fn all_defaults() -> Vec<RouterConfig> {
        ["hash", "topk", "load-balance", "cache-aware", "entropy", "adaptive", "hierarchical"]
            .iter()
            .map(|n| RouterConfig::default_for(n).unwrap_or(RouterConfig::Topk))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_names_and_params() {
        assert_eq!(RouterConfig::parse("pikv:lambda=3").unwrap(), RouterConfig::CacheAware { lambda: 3.0 });
        assert_eq!(
            RouterConfig::parse("hierarchical:groups=16,topk_groups=2").unwrap(),
            RouterConfig::Hierarchical { groups: 16, topk_groups: 2 }
        );
        assert!(RouterConfig::parse("nope").unwrap_err().to_string().contains("allowed values"));
        assert!(RouterConfig::parse("topk:alpha=1").unwrap_err().to_string().contains("no parameter"));
        assert!(RouterConfig::parse("load-balance:alpha=x").unwrap_err().to_string().contains("number"));
    }

    #[test]
    fn validation_names_fields() {
        let h = RouterConfig::Hierarchical { groups: 7, topk_groups: 2 };
        assert!(h.validate(64, 8).unwrap_err().to_string().contains("router.groups"));
        let h = RouterConfig::Hierarchical { groups: 64, topk_groups: 2 };
        assert!(h.validate(64, 8).unwrap_err().to_string().contains("topk_groups"));
        assert!(RouterConfig::Topk.validate(4, 8).unwrap_err().to_string().contains("top_k"));
        assert!(RouterConfig::Topk.validate(300, 8).unwrap_err().to_string().contains("n_experts"));
    }

    #[test]
    fn serde_round_trip() {
        for r in RouterConfig::all_defaults() {
            let s = serde_json::to_string(&r).unwrap();
            assert_eq!(serde_json::from_str::<RouterConfig>(&s).unwrap(), r);
        }
    }
}
