//! Re-balancing a loaded model's GPU memory between its K/V pool and its expert slots
//! ([`GpuLlama::reconfigure`]), without uploading the weights again.

use super::{GpuLlama, ModelOptions, check_options, kv_side};
use crate::{Error, Result};
use expertkv_core::evict::config::SchedulerConfig;
use expertkv_core::runtime::Runtime;

impl GpuLlama {
    /// The same model with the K/V side and expert slots `opts` asks for: the pool, attention,
    /// scheduler and step recording are built again (every sequence starts empty, at position
    /// 0), and a cached MoE file's GPU tier is remade with `opts.experts`' slots
    /// ([`crate::experts::ExpertCache::resize`]: empty slots, unless the count is unchanged).
    /// The weights, the experts' host tier, the routing counts and the reuse curve stay; the
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
            pool,
            attn,
            scheduler,
            quest,
            s,
            recorded,
            moe,
            io,
            prefill,
            step,
            trace,
            verify_evictions,
            ..
        } = self;
        // Everything that holds the old pool's or slots' buffers goes first.
        drop((recorded, prefill, scheduler, quest, attn, s, pool));
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
        if let Some((layers, e, k, native, cache, counts, reuse)) = experts {
            model.install_moe(rt, layers, e, k, native, cache)?;
            if let Some(m) = &mut model.moe {
                (m.counts, m.reuse) = (counts, reuse);
            }
        }
        rt.check("reconfigure")?;
        Ok(model)
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
        if matches!(opts.scheduler, Some((SchedulerConfig::FlexGen, _))) || self.flexgen.is_some() {
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
