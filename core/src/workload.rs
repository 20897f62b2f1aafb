//! The embedded synthetic workload: deterministic from a seed. Keys carry planted attention
//! sinks and heavy hitters (tokens every query attends to strongly). Each token also gets router
//! logits over the experts: a Zipf-shaped popularity per layer, noise, and temporal locality (the
//! expert its predecessor preferred gets a bonus), so that a TopK router sees skewed, sticky
//! routing. `NewToken::experts` is the TopK choice of those logits (the model's own gate).

use serde::{Deserialize, Serialize};

use crate::append::format::NewToken;
use crate::error::{Error, Result};
use crate::rng::Rng;

/// The synthetic workload's shape and statistics; every field has a default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkloadConfig {
    /// Seed of every draw: keys, values, queries, routing and heavy-hitter positions (default 42).
    pub seed: u64,
    /// Sequences decoded side by side (default 4).
    pub n_seqs: u32,
    /// Layers generated (default 2).
    pub layers: u32,
    /// KV heads per layer (default 4).
    pub kv_heads: u32,
    /// Query heads per KV head.
    pub group: u32,
    /// Dimensions per head (default 64).
    pub head_dim: u32,
    /// Experts per layer (default 16).
    pub n_experts: u32,
    /// Experts routed per token, at most `n_experts` (default 2).
    pub top_k: u32,
    /// Tokens per sequence before decoding starts.
    pub prompt_len: u32,
    /// Zipf exponent of expert popularity.
    pub zipf_s: f64,
    /// Probability that a token's logits favour its predecessor's top-1 expert.
    pub locality: f64,
    /// Logit bonus of that favoured expert.
    pub locality_bonus: f64,
    /// Standard deviation of the logit noise.
    pub logit_noise: f64,
    /// The first `sinks` positions of every sequence are attention sinks.
    pub sinks: u32,
    /// Fraction of other positions planted as heavy hitters.
    pub heavy_fraction: f64,
    /// Dot-product boost (in units of sqrt(head_dim)) of sinks and heavy hitters.
    pub sink_boost: f64,
    /// Dot-product boost of heavy hitters, in the same units (default 2; sinks' default is 3).
    pub heavy_boost: f64,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        WorkloadConfig {
            seed: 42,
            n_seqs: 4,
            layers: 2,
            kv_heads: 4,
            group: 4,
            head_dim: 64,
            n_experts: 16,
            top_k: 2,
            prompt_len: 1024,
            zipf_s: 1.1,
            locality: 0.6,
            locality_bonus: 2.5,
            logit_noise: 1.0,
            sinks: 4,
            heavy_fraction: 0.02,
            sink_boost: 3.0,
            heavy_boost: 2.0,
        }
    }
}

impl WorkloadConfig {
    /// Check the counts (at least 1, top_k at most n_experts), `locality`, `heavy_fraction` and
    /// `zipf_s`; the error names the field.
    pub fn validate(&self) -> Result<()> {
        for (f, v) in [
            ("n_seqs", self.n_seqs),
            ("layers", self.layers),
            ("kv_heads", self.kv_heads),
            ("group", self.group),
            ("head_dim", self.head_dim),
            ("n_experts", self.n_experts),
            ("top_k", self.top_k),
        ] {
            if v == 0 {
                return Err(Error::config(f, v, "must be at least 1"));
            }
        }
        if self.top_k > self.n_experts {
            return Err(Error::config("top_k", self.top_k, format!("cannot exceed n_experts = {}", self.n_experts)));
        }
        if !(0.0..=1.0).contains(&self.locality) {
            return Err(Error::config("locality", self.locality, "must be in [0, 1]"));
        }
        if !(0.0..=1.0).contains(&self.heavy_fraction) {
            return Err(Error::config("heavy_fraction", self.heavy_fraction, "must be in [0, 1]"));
        }
        if !(self.zipf_s.is_finite() && self.zipf_s >= 0.0) {
            return Err(Error::config("zipf_s", self.zipf_s, "must be a finite number >= 0"));
        }
        Ok(())
    }

    /// Query heads per sequence and layer: `kv_heads x group`.
    pub fn q_heads(&self) -> u32 {
        self.kv_heads * self.group
    }
}

/// One generated token: TopK routing, its router logits (`[n_experts]`), K and V
/// (`[kv_heads][head_dim]` each, f32).
#[derive(Clone, Debug)]
pub struct GenToken {
    /// The token's record for the pool: layer, sequence, position, TopK experts and gates.
    pub token: NewToken,
    /// Router logits, one per expert.
    pub logits: Vec<f32>,
    /// Keys, `[kv_heads][head_dim]`: noise plus the boost along the head's direction.
    pub k: Vec<f32>,
    /// Values, `[kv_heads][head_dim]`: standard normal noise.
    pub v: Vec<f32>,
}

/// The generator: a [`WorkloadConfig`] and its random state. Each call draws the next tokens or
/// queries, so the same sequence of calls gives the same data for the same seed.
pub struct Workload {
    /// The configuration it was built from.
    pub cfg: WorkloadConfig,
    rng: Rng,
    /// Per (layer, seq, kv head): the unit direction queries lean towards.
    directions: Vec<Vec<f32>>,
    /// Per layer: each expert's base logit, -zipf_s ln(popularity rank + 1).
    base_logits: Vec<Vec<f64>>,
    /// Per (layer, seq): the previous token's top-1 expert.
    last_expert: Vec<u32>,
    /// Next position of every sequence.
    positions: Vec<u32>,
}

impl Workload {
    /// Validate `cfg` and draw the fixed parts: the query direction of every (layer, seq, KV
    /// head) and every layer's expert popularity.
    pub fn new(cfg: WorkloadConfig) -> Result<Workload> {
        cfg.validate()?;
        let mut rng = Rng::new(cfg.seed);
        let d = cfg.head_dim as usize;
        let n_dir = (cfg.layers * cfg.n_seqs * cfg.kv_heads) as usize;
        let directions = (0..n_dir)
            .map(|_| {
                let v: Vec<f64> = (0..d).map(|_| rng.normal()).collect();
                let n = v.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
                v.iter().map(|x| (x / n) as f32).collect()
            })
            .collect();
        let base_logits = (0..cfg.layers)
            .map(|_| {
                let mut p: Vec<u32> = (0..cfg.n_experts).collect();
                for i in (1..p.len()).rev() {
                    let j = rng.below(i as u32 + 1) as usize;
                    p.swap(i, j);
                }
                let mut base = vec![0.0; cfg.n_experts as usize];
                for (rank, e) in p.iter().enumerate() {
                    base[*e as usize] = -cfg.zipf_s * (rank as f64 + 1.0).ln();
                }
                base
            })
            .collect();
        Ok(Workload {
            last_expert: vec![u32::MAX; (cfg.layers * cfg.n_seqs) as usize],
            positions: vec![0; cfg.n_seqs as usize],
            cfg,
            rng,
            directions,
            base_logits,
        })
    }

    fn direction(&self, layer: u32, seq: u32, head: u32) -> &[f32] {
        &self.directions[((layer * self.cfg.n_seqs + seq) * self.cfg.kv_heads + head) as usize]
    }

    /// Is `position` a planted heavy hitter (deterministic in seed and position)?
    pub fn is_heavy(&self, position: u32) -> bool {
        if position < self.cfg.sinks {
            return false;
        }
        let mut r = Rng::new(self.cfg.seed ^ (u64::from(position) << 20) ^ 0x4856_4856);
        r.uniform() < self.cfg.heavy_fraction
    }

    /// Router logits of the next token of `seq` at `layer`, and its TopK experts and gates.
    fn route(&mut self, layer: u32, seq: u32) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
        let li = (layer * self.cfg.n_seqs + seq) as usize;
        let prev = self.last_expert[li];
        let favour = prev != u32::MAX && self.rng.uniform() < self.cfg.locality;
        let logits: Vec<f32> = (0..self.cfg.n_experts)
            .map(|e| {
                let bonus = if favour && e == prev { self.cfg.locality_bonus } else { 0.0 };
                (self.base_logits[layer as usize][e as usize] + self.cfg.logit_noise * self.rng.normal() + bonus) as f32
            })
            .collect();
        let (experts, gates) = topk_of(&logits, self.cfg.top_k as usize);
        self.last_expert[li] = experts[0];
        (logits, experts, gates)
    }

    /// The next token of `seq` at `layer` (position = the sequence's current length).
    fn token(&mut self, layer: u32, seq: u32, position: u32) -> GenToken {
        let d = self.cfg.head_dim as usize;
        let hkv = self.cfg.kv_heads;
        let (logits, experts, gates) = self.route(layer, seq);
        let boost = if position < self.cfg.sinks {
            self.cfg.sink_boost
        } else if self.is_heavy(position) {
            self.cfg.heavy_boost
        } else {
            0.0
        };
        let mut k = Vec::with_capacity(d * hkv as usize);
        let mut v = Vec::with_capacity(d * hkv as usize);
        for h in 0..hkv {
            let dir: Vec<f32> = self.direction(layer, seq, h).to_vec();
            for dir_i in dir.iter().take(d) {
                let noise = self.rng.normal() as f32;
                k.push(noise + (boost * (d as f64).sqrt()) as f32 * dir_i);
                v.push(self.rng.normal() as f32);
            }
        }
        GenToken { token: NewToken { layer, seq, position, experts, gates }, logits, k, v }
    }

    /// The next token of every sequence at every layer (one position), ordered `[layer][seq]`;
    /// every sequence's position advances by one.
    pub fn next_tokens(&mut self) -> Vec<GenToken> {
        let mut out = Vec::with_capacity((self.cfg.n_seqs * self.cfg.layers) as usize);
        for layer in 0..self.cfg.layers {
            for seq in 0..self.cfg.n_seqs {
                let pos = self.positions[seq as usize];
                out.push(self.token(layer, seq, pos));
            }
        }
        for p in &mut self.positions {
            *p += 1;
        }
        out
    }

    /// `positions` positions of every sequence at every layer, ordered `[layer][position][seq]`
    /// (the order the router's rows and the append batch share).
    pub fn next_positions(&mut self, positions: u32) -> Vec<GenToken> {
        let steps: Vec<Vec<GenToken>> = (0..positions).map(|_| self.next_tokens()).collect();
        let n = self.cfg.n_seqs as usize;
        let mut out = Vec::with_capacity(steps.len() * n * self.cfg.layers as usize);
        for layer in 0..self.cfg.layers as usize {
            for step in &steps {
                out.extend_from_slice(&step[layer * n..(layer + 1) * n]);
            }
        }
        out
    }

    /// Decode queries of one layer, `[seq][q_head][head_dim]`: each query head leans towards its
    /// KV head's direction, so sinks and heavy hitters draw most of the attention.
    pub fn queries(&mut self, layer: u32) -> Vec<f32> {
        let d = self.cfg.head_dim as usize;
        let mut q = Vec::with_capacity((self.cfg.n_seqs * self.cfg.q_heads()) as usize * d);
        for seq in 0..self.cfg.n_seqs {
            for h in 0..self.cfg.kv_heads {
                let dir: Vec<f32> = self.direction(layer, seq, h).to_vec();
                for _ in 0..self.cfg.group {
                    for dir_i in dir.iter().take(d) {
                        q.push(self.rng.normal() as f32 * 0.5 + 1.5 * dir_i * (d as f32).sqrt().sqrt());
                    }
                }
            }
        }
        q
    }

    /// The position the next token of `seq` gets: positions generated for it so far.
    pub fn position(&self, seq: u32) -> u32 {
        self.positions[seq as usize]
    }
}

/// The k largest logits (ties to the lowest index) and their softmax renormalised over them.
pub fn topk_of(logits: &[f32], k: usize) -> (Vec<u32>, Vec<f32>) {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|a, b| logits[*b].partial_cmp(&logits[*a]).unwrap_or(std::cmp::Ordering::Equal));
    order.truncate(k);
    let m = logits[order[0]];
    let w: Vec<f64> = order.iter().map(|e| f64::from(logits[*e] - m).exp()).collect();
    let s: f64 = w.iter().sum();
    (order.iter().map(|e| *e as u32).collect(), w.iter().map(|x| (x / s) as f32).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_from_seed() {
        let mut a = Workload::new(WorkloadConfig::default()).unwrap();
        let mut b = Workload::new(WorkloadConfig::default()).unwrap();
        let ta = a.next_tokens();
        let tb = b.next_tokens();
        assert_eq!(ta[0].k, tb[0].k);
        assert_eq!(ta[3].token, tb[3].token);
        assert_eq!(a.queries(1), b.queries(1));
    }

    #[test]
    fn routing_is_skewed_and_local() {
        let cfg = WorkloadConfig { n_seqs: 1, layers: 1, prompt_len: 0, ..Default::default() };
        let e = cfg.n_experts as usize;
        let mut w = Workload::new(cfg).unwrap();
        let t0 = w.next_tokens().remove(0);
        assert_eq!(t0.logits.len(), e);
        assert_eq!(t0.token.experts, topk_of(&t0.logits, 2).0);
        let mut counts = vec![0u32; e];
        let mut repeats = 0;
        let mut prev = u32::MAX;
        let n = 4000;
        for _ in 0..n {
            let t = w.next_tokens().remove(0);
            let first = t.token.experts[0];
            counts[first as usize] += 1;
            if first == prev {
                repeats += 1;
            }
            prev = first;
            assert_eq!(t.token.experts.len(), 2);
            assert!((t.token.gates.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        }
        counts.sort_unstable();
        // Zipf: the top expert takes far more than a uniform share.
        assert!(counts[e - 1] > 3 * n / e as u32, "{counts:?}");
        // Locality 0.6 plus chance repeats.
        assert!(repeats > n / 2, "{repeats}");
    }

    #[test]
    fn invalid_config_names_the_field() {
        let cfg = WorkloadConfig { top_k: 20, ..Default::default() };
        assert!(Workload::new(cfg).err().unwrap().to_string().contains("top_k"));
    }
}
