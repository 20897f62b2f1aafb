//! One GPU budget for a request's K/V pages and a MoE file's expert slots, split per request.
//!
//! A [`SplitPolicy`] turns the total and a request's context into a [`Split`]: the pool (the
//! whole context, or H2O's budget-sized pool when the K/V share cannot hold it) and the expert
//! slots per layer. [`crate::forward::GpuLlama::reconfigure`] applies a split between requests
//! without uploading the weights again, so the split follows the requests as they come.
//!
//! - **Joint** (the controller): K/V gets exactly what the request needs (its whole context,
//!   nothing evicted) and the experts every other byte, up to every expert. Only a context
//!   whose pool does not fit beside one step's experts is evicted, to the largest H2O budget
//!   that does. Experts cost bytes moved per miss (fewer with more slots, never more); an
//!   eviction costs quality, so quality comes first and speed takes the rest.
//! - **Online** (the controller, not told how long a request will run): at admission the
//!   pool holds the prompt and every byte the expert slots leave, the slots as many as fit
//!   beside the prompt's pool. When the context fills the pool, [`SplitPolicy::grow`] gives K/V
//!   one slot per layer or more (as few as the context needs) and the pool every byte left, and
//!   [`crate::forward::GpuLlama::reconfigure_live`] moves the live K/V across. A live context
//!   stays whole: one that no longer fits beside one step's experts is refused at that token
//!   (a prompt too long at admission is evicted, as under joint).
//! - **Fixed** shares (50/50; MoE-Infinity's experts 0.75 / K/V 0.15): the pool is its share's
//!   size whatever the request, and a context past it is evicted to what the share holds.
//! - **Experts-first** behind a K/V floor (FreeToken): the pool holds the floor's tokens, the
//!   experts the rest; a longer context is evicted to the floor.
//! - **Cell**: a fixed slot count and H2O at a share of each context (the 2-D sweep's grid).

use crate::experts::ExpertBytes;
use crate::forward::MODEL_PAGE_SIZE;
use crate::{Error, Result};

/// How a request's split is chosen (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SplitPolicy {
    /// The joint controller: the whole context in K/V when it fits beside one step's experts,
    /// every other byte in expert slots.
    Joint,
    /// The joint controller told only the prompt: the pool grows, slot by slot, as the context
    /// does ([`SplitPolicy::grow`]).
    Online,
    /// Fixed shares of the total for the experts and for K/V (the rest unused).
    Fixed {
        /// The experts' share of the total, 0 to 1.
        experts: f64,
        /// The K/V pool's share of the total, 0 to 1.
        kv: f64,
    },
    /// The pool holds `floor` tokens; the experts take the rest.
    ExpertsFirst {
        /// Tokens the pool holds.
        floor: u32,
    },
    /// `slots` per layer and H2O keeping `share` of each context (1: the full cache).
    Cell {
        /// Expert slots per layer.
        slots: u32,
        /// The share of each request's context the pool keeps, in (0, 1].
        share: f64,
    },
}

/// What a split gives one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Split {
    /// Expert slots per layer.
    pub slots: u32,
    /// Tokens per sequence the pool is built for (the model's `max_context`).
    pub pool_tokens: u32,
    /// H2O's budget (tokens per layer and KV head) when the context is evicted; `None` keeps it
    /// whole.
    pub h2o_budget: Option<u32>,
    /// The pool's bytes.
    pub kv_bytes: u64,
    /// The slots' bytes (and the slot tables').
    pub expert_bytes: u64,
}

impl Split {
    /// The bytes of the pool and the slots together.
    pub fn bytes(&self) -> u64 {
        self.kv_bytes + self.expert_bytes
    }
}

/// What a split is computed from.
pub struct SplitInputs<'a> {
    /// The budget, bytes.
    pub total: u64,
    /// The experts' bytes per slot in every layer, and the slot tables'.
    pub experts: ExpertBytes,
    /// Experts per layer.
    pub n_experts: u32,
    /// The fewest slots a step needs ([`crate::experts::min_slots`]).
    pub least: u32,
    /// The model's trained context (the most tokens a pool is built for).
    pub max_context: u32,
    /// The pool's bytes for a context of `tokens` (first), kept whole (`None`) or under H2O's
    /// budget (tokens per layer and KV head).
    pub kv_bytes: &'a dyn Fn(u32, Option<u32>) -> Result<u64>,
}

impl SplitInputs<'_> {
    /// Most slots `bytes` hold, up to every expert.
    fn slots_in(&self, bytes: u64) -> u32 {
        let per = self.experts.per_slot.max(1);
        (bytes.saturating_sub(self.experts.fixed) / per).min(u64::from(self.n_experts)) as u32
    }

    /// The largest H2O budget below `context` whose pool fits `bytes` (`None`: not even a
    /// budget of one page, the least a budget may be).
    fn h2o_within(&self, context: u32, bytes: u64) -> Result<Option<u32>> {
        let (mut lo, mut hi) = (MODEL_PAGE_SIZE, context.saturating_sub(1));
        if hi < lo || (self.kv_bytes)(context, Some(lo))? > bytes {
            return Ok(None);
        }
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if (self.kv_bytes)(context, Some(mid))? <= bytes {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        Ok(Some(lo))
    }

    /// The most tokens a whole-context pool of at most `bytes` is built for (up to the model's
    /// context), at least `context`'s worth when that fits.
    fn tokens_within(&self, bytes: u64) -> Result<u32> {
        let (mut lo, mut hi) = (0u32, self.max_context);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if (self.kv_bytes)(mid, None)? <= bytes {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        Ok(lo)
    }

    fn split(&self, slots: u32, pool_tokens: u32, h2o_budget: Option<u32>) -> Result<Split> {
        let kv_bytes = (self.kv_bytes)(pool_tokens, h2o_budget)?;
        Ok(Split { slots, pool_tokens, h2o_budget, kv_bytes, expert_bytes: self.experts.with_slots(slots) })
    }
}

impl SplitPolicy {
    /// `joint`, `online`, `E/K` (shares of the total for experts and K/V: `50/50`, `0.75/0.15`),
    /// `experts-first:TOKENS`, or `cell:SLOTS:PERCENT` (H2O keeping PERCENT of each context; 100
    /// keeps it whole).
    pub fn parse(spec: &str) -> Result<SplitPolicy> {
        let bad = |why: &str| Error::Input(format!("split policy `{spec}`: {why}"));
        let share = |s: &str| -> Result<f64> {
            let v: f64 = s.trim().parse().map_err(|_| bad("a share is a number"))?;
            // 50/50 reads as percentages.
            let v = if v > 1.0 { v / 100.0 } else { v };
            if !(v > 0.0 && v <= 1.0) {
                return Err(bad("a share is in (0, 1] or (0, 100]"));
            }
            Ok(v)
        };
        if spec == "joint" {
            return Ok(SplitPolicy::Joint);
        }
        if spec == "online" {
            return Ok(SplitPolicy::Online);
        }
        if let Some(t) = spec.strip_prefix("experts-first:") {
            let floor = t.parse().ok().filter(|&f: &u32| f > 0).ok_or_else(|| bad("the floor is a token count above 0"))?;
            return Ok(SplitPolicy::ExpertsFirst { floor });
        }
        if let Some(rest) = spec.strip_prefix("cell:") {
            let (s, p) = rest.split_once(':').ok_or_else(|| bad("cell:SLOTS:PERCENT"))?;
            let slots = s.parse().ok().filter(|&s: &u32| s > 0).ok_or_else(|| bad("slots are a count above 0"))?;
            let p: f64 = p.trim_end_matches('%').parse().map_err(|_| bad("the percentage is a number"))?;
            if !(p > 0.0 && p <= 100.0) {
                return Err(bad("the percentage is in (0, 100]"));
            }
            return Ok(SplitPolicy::Cell { slots, share: p / 100.0 });
        }
        if let Some((e, k)) = spec.split_once('/') {
            let (experts, kv) = (share(e)?, share(k)?);
            if experts + kv > 1.0 + 1e-9 {
                return Err(bad("the shares add up to more than the total"));
            }
            return Ok(SplitPolicy::Fixed { experts, kv });
        }
        Err(bad("give joint, online, E/K (50/50, 0.75/0.15), experts-first:TOKENS or cell:SLOTS:PERCENT"))
    }

    /// The policy as [`SplitPolicy::parse`] reads it.
    pub fn spec(&self) -> String {
        match *self {
            SplitPolicy::Joint => "joint".into(),
            SplitPolicy::Online => "online".into(),
            SplitPolicy::Fixed { experts, kv } => format!("{experts}/{kv}"),
            SplitPolicy::ExpertsFirst { floor } => format!("experts-first:{floor}"),
            SplitPolicy::Cell { slots, share } => format!("cell:{slots}:{}", share * 100.0),
        }
    }

    /// The split for a request of `context` tokens (prompt and generated; for
    /// [`SplitPolicy::Online`], what is known at admission: the prompt and its first token), or
    /// why this policy cannot serve it within the total (the minimum stated).
    pub fn split(&self, inp: &SplitInputs<'_>, context: u32) -> Result<Split> {
        let total = inp.total;
        let refuse = |what: String| Err(Error::Input(format!("split {}: {what}", self.spec())));
        if context == 0 || context > inp.max_context {
            return refuse(format!("a context of {context} tokens; the model's is {}", inp.max_context));
        }
        let least_bytes = inp.experts.with_slots(inp.least);
        let s = match *self {
            SplitPolicy::Online if (inp.kv_bytes)(context, None)? + least_bytes <= total => self.grow(inp, context)?,
            SplitPolicy::Joint | SplitPolicy::Online => {
                let whole = (inp.kv_bytes)(context, None)?;
                if whole + least_bytes <= total {
                    inp.split(inp.slots_in(total - whole), context, None)?
                } else {
                    let Some(b) = inp.h2o_within(context, total.saturating_sub(least_bytes))? else {
                        return refuse(format!(
                            "{total} bytes hold neither the context's pool nor one page beside one step's experts ({least_bytes} bytes)"
                        ));
                    };
                    // Online does not know the request's length: its evicted pool is built for
                    // the model's context (H2O's pages are its budget's, whatever the context).
                    let tokens = if *self == SplitPolicy::Online { inp.max_context } else { context };
                    inp.split(inp.slots_in(total - (inp.kv_bytes)(tokens, Some(b))?), tokens, Some(b))?
                }
            }
            SplitPolicy::Fixed { experts, kv } => {
                let (for_experts, for_kv) = ((experts * total as f64) as u64, (kv * total as f64) as u64);
                let tokens = inp.tokens_within(for_kv)?;
                let slots = inp.slots_in(for_experts);
                if tokens >= context {
                    inp.split(slots, tokens, None)?
                } else {
                    let Some(b) = inp.h2o_within(context, for_kv)? else {
                        return refuse(format!("the K/V share ({for_kv} bytes) holds no page of a {context}-token context"));
                    };
                    inp.split(slots, context, Some(b))?
                }
            }
            SplitPolicy::ExpertsFirst { floor } => {
                let (tokens, budget) = if context <= floor { (floor.min(inp.max_context), None) } else { (context, Some(floor)) };
                let kv = (inp.kv_bytes)(tokens, budget)?;
                inp.split(inp.slots_in(total.saturating_sub(kv)), tokens, budget)?
            }
            SplitPolicy::Cell { slots, share } => {
                let keep = (f64::from(context) * share).round() as u32;
                let budget = (keep < context).then_some(keep.max(MODEL_PAGE_SIZE));
                inp.split(slots.min(inp.n_experts), context, budget)?
            }
        };
        if s.slots < inp.least {
            return refuse(format!(
                "{} slots per layer, under one step's {} (the pool takes {} of {total} bytes)",
                s.slots, inp.least, s.kv_bytes
            ));
        }
        if s.bytes() > total {
            return refuse(format!("{} bytes, over the total of {total}", s.bytes()));
        }
        Ok(s)
    }
}

impl SplitPolicy {
    /// [`SplitPolicy::Online`]'s split for a live context of `context` tokens kept whole: the
    /// most slots that fit beside its pool, and the pool every byte they leave (up to the
    /// model's context). Refused, with the figures, when the context no longer fits whole beside
    /// one step's experts. Any policy may ask; only online's splits change with it.
    pub fn grow(&self, inp: &SplitInputs<'_>, context: u32) -> Result<Split> {
        let total = inp.total;
        let least_bytes = inp.experts.with_slots(inp.least);
        if context == 0 || context > inp.max_context {
            return Err(Error::Input(format!("split online: a context of {context} tokens; the model's is {}", inp.max_context)));
        }
        let whole = (inp.kv_bytes)(context, None)?;
        if whole + least_bytes > total {
            return Err(Error::Input(format!(
                "split online: a live context of {context} tokens needs {whole} bytes of K/V beside one step's experts ({least_bytes}), over the total of {total}; a live context is not evicted"
            )));
        }
        let slots = inp.slots_in(total - whole);
        let tokens = inp.tokens_within(total - inp.experts.with_slots(slots))?.max(context);
        let s = inp.split(slots, tokens, None)?;
        if s.slots < inp.least || s.bytes() > total {
            return Err(Error::Input(format!("split online: {} slots and {} bytes within {total}", s.slots, s.bytes())));
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool of 100 bytes a token kept (whole, or H2O's budget plus a page of 16), slots of
    /// 1,000 bytes, tables of 10, 8 experts, 2 a step.
    fn inputs(total: u64, f: &dyn Fn(u32, Option<u32>) -> Result<u64>) -> SplitInputs<'_> {
        SplitInputs { total, experts: ExpertBytes { per_slot: 1000, fixed: 10 }, n_experts: 8, least: 2, max_context: 4096, kv_bytes: f }
    }

    fn pool(tokens: u32, budget: Option<u32>) -> Result<u64> {
        Ok(100 * u64::from(budget.map_or(tokens, |b| (b + 16).min(tokens))))
    }

    #[test]
    fn joint_keeps_the_whole_context_and_gives_the_rest_to_experts() {
        let inp = inputs(10_010, &pool);
        // 20 tokens: 2,000 bytes of pool, 8,000 for 8 slots.
        assert_eq!(
            SplitPolicy::Joint.split(&inp, 20).unwrap(),
            Split { slots: 8, pool_tokens: 20, h2o_budget: None, kv_bytes: 2000, expert_bytes: 8010 }
        );
        // 60 tokens: 6,000 bytes, 4 slots.
        let s = SplitPolicy::Joint.split(&inp, 60).unwrap();
        assert_eq!((s.slots, s.h2o_budget), (4, None));
        // 90 tokens do not fit beside 2 slots (2,010): H2O at the largest budget that does,
        // (8,000 - 0) / 100 - 16 = 64 tokens.
        let s = SplitPolicy::Joint.split(&inp, 90).unwrap();
        assert_eq!((s.slots, s.h2o_budget, s.kv_bytes), (2, Some(64), 8000));
        assert!(s.bytes() <= 10_010);
    }

    #[test]
    fn online_gives_the_pool_every_byte_the_slots_leave_and_grows_a_slot_at_a_time() {
        let inp = inputs(10_010, &pool);
        let online = SplitPolicy::parse("online").unwrap();
        assert_eq!(online.spec(), "online");
        // A 20-token prompt: 8 slots (8,010 bytes), the pool every byte left, 20 tokens.
        let s = online.split(&inp, 20).unwrap();
        assert_eq!((s.slots, s.pool_tokens, s.h2o_budget, s.bytes()), (8, 20, None, 10_010));
        // A 25-token prompt: 7 slots, the pool the 3,000 bytes they leave: 30 tokens.
        let s = online.split(&inp, 25).unwrap();
        assert_eq!((s.slots, s.pool_tokens, s.kv_bytes, s.expert_bytes), (7, 30, 3000, 7010));
        // The context fills the pool at 30: growing to 31 costs one slot and gives 40 tokens.
        let g = online.grow(&inp, 31).unwrap();
        assert_eq!((g.slots, g.pool_tokens, g.h2o_budget), (6, 40, None));
        // 75 tokens: 2 slots, 80 tokens of pool; 81 no longer fit beside one step's experts.
        let g = online.grow(&inp, 75).unwrap();
        assert_eq!((g.slots, g.pool_tokens, g.bytes()), (2, 80, 10_010));
        assert!(online.grow(&inp, 81).is_err_and(|e| e.to_string().contains("not evicted")));
        // A prompt too long at admission is evicted as under joint, its pool built for the
        // model's context (H2O's pages are the budget's).
        let s = online.split(&inp, 90).unwrap();
        assert_eq!((s.slots, s.pool_tokens, s.h2o_budget), (2, 4096, Some(64)));
    }

    #[test]
    fn fixed_shares_size_the_pool_to_their_share_whatever_the_request() {
        let inp = inputs(10_000, &pool);
        let half = SplitPolicy::parse("50/50").unwrap();
        assert_eq!(half, SplitPolicy::Fixed { experts: 0.5, kv: 0.5 });
        // A short request still gets a 50-token pool (5,000 bytes) and 4 slots.
        let s = half.split(&inp, 20).unwrap();
        assert_eq!((s.slots, s.pool_tokens, s.h2o_budget, s.kv_bytes), (4, 50, None, 5000));
        // A long one is evicted to what 5,000 bytes hold: 34 tokens and a page.
        let s = half.split(&inp, 80).unwrap();
        assert_eq!((s.slots, s.pool_tokens, s.h2o_budget), (4, 80, Some(34)));
        // MoE-Infinity's shares: 1,500 bytes of K/V hold no page of an 80-token context.
        let mi = SplitPolicy::parse("0.75/0.15").unwrap();
        assert!(mi.split(&inp, 80).is_err_and(|e| e.to_string().contains("holds no page")));
        let s = mi.split(&inputs(22_000, &pool), 80).unwrap();
        assert_eq!((s.slots, s.h2o_budget, s.kv_bytes), (8, Some(17), 3300));
        assert!(SplitPolicy::parse("0.8/0.3").is_err_and(|e| e.to_string().contains("more than the total")));
    }

    #[test]
    fn experts_first_holds_the_floor_and_cells_their_share() {
        let inp = inputs(10_010, &pool);
        let ef = SplitPolicy::parse("experts-first:30").unwrap();
        let s = ef.split(&inp, 20).unwrap();
        assert_eq!((s.slots, s.pool_tokens, s.h2o_budget), (7, 30, None));
        let s = ef.split(&inp, 80).unwrap();
        assert_eq!((s.slots, s.h2o_budget), (5, Some(30)));
        let cell = SplitPolicy::parse("cell:3:50").unwrap();
        let s = cell.split(&inp, 80).unwrap();
        assert_eq!((s.slots, s.h2o_budget, s.kv_bytes), (3, Some(40), 5600));
        // Over the total, or under a step's slots: refused with the figures.
        assert!(SplitPolicy::parse("cell:8:100").unwrap().split(&inp, 80).is_err_and(|e| e.to_string().contains("over the total")));
        assert!(SplitPolicy::parse("cell:1:100").unwrap().split(&inp, 20).is_err_and(|e| e.to_string().contains("under one step's 2")));
        for bad in ["", "half", "cell:3", "cell:0:50", "cell:3:0", "experts-first:0", "0/0.5"] {
            assert!(SplitPolicy::parse(bad).is_err(), "{bad}");
        }
        for p in ["joint", "online", "0.75/0.15", "experts-first:30", "cell:3:50"] {
            assert_eq!(SplitPolicy::parse(&SplitPolicy::parse(p).unwrap().spec()).unwrap(), SplitPolicy::parse(p).unwrap());
        }
    }

    #[test]
    fn a_total_below_one_step_of_experts_is_refused_with_the_minimum() {
        let inp = inputs(1_500, &pool);
        let e = SplitPolicy::Joint.split(&inp, 20).unwrap_err().to_string();
        assert!(e.contains("2010"), "{e}");
    }
}
