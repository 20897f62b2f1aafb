//! Re-balancing a loaded model's GPU memory between its K/V pool and its expert slots
//! ([`GpuLlama::reconfigure`]), without uploading the weights again; between requests, or in
//! the middle of one with its sequences' K/V carried across ([`GpuLlama::reconfigure_live`]).

use super::{GpuLlama, ModelOptions, check_options, kv_side};
use crate::{Error, Result};
use expertkv_core::evict::config::SchedulerConfig;
use expertkv_core::runtime::Runtime;

impl GpuLlama {
    /// The same model with the K/V side and expert slots `opts` asks for: the pool, attention,
    /// scheduler and step recording are built again (every sequence starts empty, at position
    /// 0), and a cached MoE file's GPU tier is remade with `opts.experts`' slots
    /// ([`crate::experts::ExpertCache::resize`]: empty slots, unless the count is unchanged).
    /// The weights, the experts' host tier, the routing counts, the reuse curve, the transfer
    /// totals, the trace and the stage timer ([`GpuLlama::time_stages`]) stay; the
    /// step counter runs on, as it does when a sequence is released and another joins. The old
    /// pool and slots are dropped before the new ones are made, so the two never hold GPU memory
    /// at once.
    ///
    /// Refused where [`GpuLlama::check_reconfigure`] refuses, which it calls first; call that
    /// to keep the model on a refusal, since this takes it. An error after the checks (the device
    /// out of memory) loses the model: load it again.
    pub async fn reconfigure(self, rt: &Runtime, opts: ModelOptions) -> Result<GpuLlama> {
        self.check_reconfigure(&opts)?;
        let GpuLlama {
            cfg,
            kernels,
            layers,
            kv,
            labels,
            s,
            recorded,
            moe,
            io,
            prefill,
            step,
            trace,
            verify_evictions,
            timer,
            transfer_totals,
            ..
        } = self;
        // Everything that holds the old pool's or slots' buffers goes first.
        drop((recorded, prefill, labels, s, kv));
        let experts = match moe {
            Some(m) => {
                let (e, k, native, counts, reuse) = (m.n_experts, m.top_k, m.native, m.counts, m.reuse);
                let (routers, ffns): (Vec<_>, Vec<_>) = m.layers.into_iter().unzip();
                let mut cache = m.cache;
                let ffns = match (&mut cache, opts.experts) {
                    (Some(c), Some(ec)) => c.resize(rt, ec, opts.n_seqs, ffns)?,
                    _ => ffns,
                };
                Some((routers.into_iter().zip(ffns).collect::<Vec<_>>(), e, k, native, cache, counts, reuse))
            }
            None => None,
        };
        let kv = kv_side(rt, &cfg, &kernels, &layers, (&io.0, io.1.as_ref(), &io.2), &opts).await?;
        let mut model = GpuLlama::assemble(cfg, kernels, layers, io, kv, &opts);
        (model.step, model.trace, model.verify_evictions) = (step, trace, verify_evictions);
        (model.timer, model.transfer_totals) = (timer, transfer_totals);
        if let Some((layers, e, k, native, cache, counts, reuse)) = experts {
            model.install_moe(rt, layers, e, k, native, cache)?;
            if let Some(m) = &mut model.moe {
                (m.counts, m.reuse) = (counts, reuse);
            }
        }
        rt.check("reconfigure")?;
        Ok(model)
    }

    /// [`GpuLlama::reconfigure`] in the middle of a request: every sequence's K/V is read out
    /// to host memory ([`GpuLlama::read_prefix`]), the old pool and slots are dropped, the new
    /// ones made, and each sequence restored at its position ([`GpuLlama::restore_prefix`]), so
    /// decoding goes on where it stopped and the logits are those the model would have given
    /// without the change, bit for bit (the words are the append's own; the slots hold other
    /// experts but the same bytes of the ones the kernels read). The GPU never holds both pools:
    /// the carried K/V waits in host memory. The expert slots start empty when their count
    /// changes; the step counter goes on as if nothing had been appended.
    ///
    /// Refused where [`GpuLlama::check_reconfigure_live`] refuses, which it calls first; call
    /// that to keep the model on a refusal, since this takes it. Any later error (a readback, the
    /// device out of memory) loses the model and its sequences.
    pub async fn reconfigure_live(self, rt: &Runtime, opts: ModelOptions) -> Result<GpuLlama> {
        self.check_reconfigure_live(&opts)?;
        let step = self.step;
        // The sequences holding tokens, read out from one snapshot of the pool's tables.
        let live: Vec<(u32, u32)> = (0..self.n_seqs).zip(self.positions.iter().copied()).filter(|&(_, n)| n > 0).collect();
        let carried = self.read_prefixes(rt, &live).await?;
        let mut model = self.reconfigure(rt, opts).await?;
        for (&(seq, n), kv) in live.iter().zip(&carried) {
            model.restore_prefix(rt, seq, n, kv).await?;
        }
        // Restoring counts a step per sequence; the request's steps go on from where they were.
        model.step = step;
        Ok(model)
    }

    /// Whether [`GpuLlama::reconfigure_live`] takes `opts`: what [`GpuLlama::check_reconfigure`]
    /// takes, with raw pages and no policy between tokens (the conditions a restored prefix
    /// needs, [`GpuLlama::kv_order_refusal`]), as many sequences, K/V stored alike, and room for every sequence's
    /// next token.
    pub fn check_reconfigure_live(&self, opts: &ModelOptions) -> Result<()> {
        self.check_reconfigure(opts)?;
        let refuse = |why: String| Err(Error::Input(format!("reconfiguring live sequences: {why}")));
        if let Some(why) = self.kv_order_refusal() {
            return refuse(format!("their K/V cannot be carried across: {why}"));
        }
        if opts.scheduler.is_some() || opts.codec != expertkv_core::config::Codec::None {
            return refuse("the new pool must keep raw pages and no scheduler to take the K/V back".into());
        }
        if opts.n_seqs != self.n_seqs {
            return refuse(format!("{} sequences live, {} asked for", self.n_seqs, opts.n_seqs));
        }
        if opts.dtype != self.kv.pool.cfg.dtype {
            return refuse(format!("their K/V is {:?}; the new pool must store the same", self.kv.pool.cfg.dtype));
        }
        if let Some(&p) = self.positions.iter().max()
            && p >= opts.max_context
        {
            return refuse(format!("a sequence holds {p} tokens; a pool of {} per sequence leaves no room", opts.max_context));
        }
        Ok(())
    }

    /// Whether [`GpuLlama::reconfigure`] takes `opts`: not the route stage (`routing`, labels),
    /// FlexGen, another prefill chunk, the low-rank codecs (their calibration window belongs to a
    /// fresh load), a router set with [`GpuLlama::set_moe_router`], a change between an expert
    /// cache and every expert resident (a cache with as many slots as experts holds them all), or
    /// anything [`GpuLlama::load`] refuses.
    pub fn check_reconfigure(&self, opts: &ModelOptions) -> Result<()> {
        let refuse = |why: &str| Err(Error::Input(format!("reconfigure: {why}; load the model again with these options")));
        if opts.routing.is_some() || self.labels.is_some() {
            return refuse("the route stage's labels and shards are set up at load");
        }
        if opts.prefill_chunk != self.prefill_chunk {
            return refuse("the prefill chunk sizes buffers made at load");
        }
        if matches!(opts.scheduler, Some((SchedulerConfig::FlexGen, _))) || self.kv.flexgen.is_some() {
            return refuse("FlexGen's host tier is set up at load");
        }
        if opts.codec.is_low_rank() {
            return refuse("a low-rank codec calibrates on a fresh load's first tokens");
        }
        check_options(&self.cfg, opts)?;
        if let Some(m) = &self.moe {
            if m.routed.is_some() {
                return refuse("a pipeline router chooses the experts");
            }
            match (&m.cache, &opts.experts) {
                (Some(c), Some(ec)) => c.check_slots(ec.slots, opts.n_seqs)?,
                (None, None) => {}
                (Some(_), None) => return refuse("the experts are in an expert cache (as many slots as experts hold every one)"),
                (None, Some(_)) => return refuse("every expert was uploaded at load, outside an expert cache"),
            }
        } else if opts.experts.is_some() {
            return Err(Error::Input("an expert cache needs a MoE file (this model has a dense FFN)".into()));
        }
        Ok(())
    }
}
