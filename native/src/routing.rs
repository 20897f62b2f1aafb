//! The route stage's options on the model (`run`, and what `eval` and `view` share): where the
//! tokens' experts come from, the router choosing them, the shards and the EKVA allocator; and
//! the summary printed after a run.

use anyhow::{Result, bail};
use clap::Args;
use expertkv_core::config::ShardMap;
use expertkv_core::evict::config::EkvaConfig;
use expertkv_core::route::config::RouterConfig;
use expertkv_core::runtime::Runtime;
use expertkv_model::forward::GpuLlama;
use expertkv_model::labels::KvRouting;

use crate::moe_spec::{MoeSpec, parse_moe};

#[derive(Args, Clone, Debug, Default)]
pub struct RoutingArgs {
    /// Label a dense model's tokens with a MoEfication's router while its FFN stays dense
    /// (E:K or E:K:fitted, as --moe): the K/V carry trained routing structure, quality stays
    /// the dense model's [default: off; a MoE file or --moe label the tokens with their own
    /// router].
    #[arg(long, value_name = "E:K[:fitted]")]
    pub labels: Option<String>,
    /// The route stage's router, choosing each token's experts at every layer before its K/V
    /// are appended (hash, topk, load-balance, entropy, cache-aware, adaptive, hierarchical;
    /// name or name:key=value,...) [default: topk when the route stage is on: with --labels,
    /// --shards, --shard-map or --allocator; off otherwise].
    #[arg(long, value_name = "ROUTER")]
    pub kv_router: Option<String>,
    /// Shards per (layer, sequence) of the K/V pool, a power of two [default: 1].
    #[arg(long)]
    pub shards: Option<u32>,
    /// How tokens map onto the shards: pikv, expert, token-block [default: expert].
    #[arg(long)]
    pub shard_map: Option<String>,
    /// EKVA: split the scheduler's budget across the experts by importance (ekva or
    /// ekva:floor=F,alpha=A,decay=D) [default: none].
    #[arg(long)]
    pub allocator: Option<String>,
}

impl RoutingArgs {
    /// The labels-only MoEfication asked for.
    pub fn labels_spec(&self) -> Result<Option<MoeSpec>> {
        match self.labels.as_deref() {
            Some(spec) => match parse_moe(spec)? {
                Some(s) => Ok(Some(s)),
                None => bail!("--labels: give E:K or E:K:fitted (the MoEfication whose router labels the tokens)"),
            },
            None => Ok(None),
        }
    }

    /// The route stage for a routing source of `shape` (E, k): a MoE file's, --moe's or
    /// --labels', when an option asks for it (--labels, --kv-router, --shards, --shard-map or
    /// --allocator). `None` when none does: a MoE file or --moe alone routes only its FFN, so
    /// its prompt is prefilled in chunks (the route stage labels token by token). An error
    /// names the option when an option needs a source and there is none.
    pub fn routing(&self, shape: Option<(u32, u32)>) -> Result<Option<KvRouting>> {
        let given = [
            ("--kv-router", self.kv_router.is_some()),
            ("--shards", self.shards.is_some()),
            ("--shard-map", self.shard_map.is_some()),
            ("--allocator", self.allocator.is_some()),
        ];
        let Some((e, k)) = shape else {
            if let Some((name, _)) = given.iter().find(|(_, g)| *g) {
                bail!("{name} routes the tokens to experts: give a routing source too (a MoE file, --moe E:K or --labels E:K)");
            }
            return Ok(None);
        };
        if self.labels.is_none() && !given.iter().any(|(_, g)| *g) {
            return Ok(None);
        }
        let n_shards = self.shards.unwrap_or(1);
        let shard_map = ShardMap::parse(self.shard_map.as_deref().unwrap_or("expert"), n_shards)?;
        let router = self.kv_router.as_deref().map_or(Ok(RouterConfig::Topk), RouterConfig::parse)?;
        let allocator = self.allocator.as_deref().map_or(Ok(None), EkvaConfig::parse)?;
        let r = KvRouting { n_experts: e, top_k: k, router, n_shards, shard_map, allocator };
        r.validate()?;
        Ok(Some(r))
    }
}

/// What the route stage did over a run: its source, router and shards, how the labels spread
/// over the experts, their miss rates, and (with a sparse FFN) how often the pre-gated first
/// label is the FFN's first expert.
pub fn summary(rt: &Runtime, m: &GpuLlama) -> Result<Option<String>> {
    let (Some(source), Some(router)) = (m.label_source(), m.label_router()) else { return Ok(None) };
    let stats = pollster::block_on(m.label_stats(rt))?;
    let c = &m.kv.pool.cfg;
    let e = stats.len() / c.layers.max(1) as usize;
    if e == 0 {
        return Ok(None);
    }
    // Per layer, the busiest expert's share of the labels; the mean over layers.
    let shares: Vec<f64> = stats
        .chunks(e)
        .map(|l| f64::from(l.iter().map(|s| s.appended).max().unwrap_or(0)) / f64::from(l.iter().map(|s| s.appended).sum::<u32>().max(1)))
        .collect();
    let busiest = shares.iter().sum::<f64>() / shares.len().max(1) as f64;
    let miss = stats.iter().map(|s| f64::from(s.miss)).sum::<f64>() / stats.len() as f64;
    let mut out = format!(
        "routing labels: {} (pre-gated: the layer's router on its input), router {}, {} shard{} by {}; \
the busiest expert of a layer took {:.0}% of its labels on average (even: {:.0}%); mean miss rate {:.3}",
        source.name(),
        router.name(),
        c.n_shards,
        if c.n_shards == 1 { "" } else { "s" },
        c.shard_map.name(),
        100.0 * busiest,
        100.0 / e as f64,
        miss
    );
    let (same, of) = m.label_agreement();
    if of > 0 {
        out += &format!("; first label = the FFN's first expert on {:.1}% of {of} (token, layer)s", 100.0 * same as f64 / of as f64);
    }
    Ok(Some(out))
}
