//! The decode step's stage sequence, written once: route, append, compress, gather, attend
//! (every layer), evict, recount misses. Two ways of submitting it: fused (one command buffer,
//! no host round trip) and staged (a submission per stage, with the host's side work between
//! stages: the CPU lockstep, the full-cache reference, the low-rank calibration, FlexGen's host
//! tier). Prefill runs the same sequence over batches of positions.

use super::lockstep::{check_eviction, verify_err};
use super::report::Slot;
use super::{Pipeline, kv_words, rel_l2};
use crate::append::format::NewToken;
use crate::error::{Error, Result};
use crate::runtime::Runtime;
use crate::runtime::timer::GpuTimer;
use crate::workload::GenToken;

/// What one run of the stages covers.
#[derive(Clone, Copy, Debug)]
pub(super) struct Stages {
    /// Tokens routed and appended per layer (sequences x positions).
    pub per_layer: u32,
    /// Timestamps around every pass (a decode step's report).
    pub timed: bool,
    /// One submission (see [`Pipeline::fused`]); otherwise one per stage.
    pub fused: bool,
    /// Attend and evict (a prefill batch with nothing to evict only appends).
    pub attend: bool,
    /// Recount the experts' misses (every decode step).
    pub miss: bool,
}

/// The command stream of one run: a single encoder when fused, else a submission per stage.
struct Stream {
    enc: wgpu::CommandEncoder,
    fused: bool,
}

fn encoder(rt: &Runtime) -> wgpu::CommandEncoder {
    rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("decode step") })
}

impl Stream {
    /// End a stage: when staged, submit what it recorded (and check for errors).
    fn cut(&mut self, rt: &Runtime, stage: &str) -> Result<()> {
        if !self.fused {
            let enc = std::mem::replace(&mut self.enc, encoder(rt));
            rt.queue.submit([enc.finish()]);
            rt.check(stage)?;
        }
        Ok(())
    }

    fn finish(self, rt: &Runtime) -> Result<()> {
        rt.queue.submit([self.enc.finish()]);
        rt.check("decode step")
    }
}

/// The timestamp writes of `slot`'s pass when the run is timed.
fn ts(timer: Option<&GpuTimer>, timed: bool, slot: Slot, layers: u32) -> Option<wgpu::ComputePassTimestampWrites<'_>> {
    if timed { timer.and_then(|t| t.pass(slot.index(layers))) } else { None }
}

fn desc<'a>(label: &'a str, ts: Option<wgpu::ComputePassTimestampWrites<'a>>) -> wgpu::ComputePassDescriptor<'a> {
    wgpu::ComputePassDescriptor { label: Some(label), timestamp_writes: ts }
}

impl Pipeline {
    /// Run the stages on `tokens` (ordered [layer][token of the layer]) and, when attending,
    /// `queries[layer]`. Returns the attention error against the full-cache reference, when one
    /// is kept (staged runs only).
    pub(super) async fn run_stages(
        &mut self,
        rt: &Runtime,
        tokens: &[GenToken],
        queries: Vec<Vec<f32>>,
        st: Stages,
    ) -> Result<Option<f64>> {
        let layers = self.pool.cfg.layers;
        let per_layer = st.per_layer;
        if st.fused && !self.fused() {
            return Err(Error::Input("this pipeline needs the host between stages; run it staged".into()));
        }
        // Every input is staged before anything is recorded.
        let e = self.cfg.workload.n_experts as usize;
        for layer in 0..layers {
            let rows = &tokens[(layer * per_layer) as usize..((layer + 1) * per_layer) as usize];
            let logits: Vec<f32> = rows.iter().flat_map(|t| t.logits.iter().copied()).collect();
            debug_assert_eq!(logits.len(), rows.len() * e);
            self.router.set_logits(rt, layer, &logits)?;
            self.router.prepare(rt, layer, per_layer, self.routed_tokens + layer * per_layer)?;
        }
        let lens: Vec<u32> = (0..self.cfg.workload.n_seqs).map(|q| self.workload.position(q)).collect();
        if st.attend {
            self.attn.stage_layers(rt, self.step, &queries)?;
            if let Some(s) = &self.scheduler {
                s.prepare(rt, self.step, &lens)?;
            }
        }
        let mut stream = Stream { enc: encoder(rt), fused: st.fused };

        // Route.
        {
            let mut pass = stream.enc.begin_compute_pass(&desc("route", ts(self.timer.as_ref(), st.timed, Slot::Route, layers)));
            for layer in 0..layers {
                self.router.encode(&mut pass, layer, per_layer);
            }
        }
        self.routed_tokens = self.routed_tokens.wrapping_add(layers * per_layer);
        stream.cut(rt, "route")?;

        // Append, with the routed experts.
        let words = kv_words(tokens, self.pool.cfg.dtype);
        let mut new: Vec<NewToken> = tokens.iter().map(|t| t.token.clone()).collect();
        let routed = crate::append::Routed {
            experts: &self.router.experts,
            gates: &self.router.gates,
            per_layer,
            row_stride: self.router.shape.max_tokens,
        };
        let append_ts = ts(self.timer.as_ref(), st.timed, Slot::Append, layers);
        self.pool.encode_append(rt, &mut stream.enc, &new, &words, self.step, Some(routed), append_ts)?;
        stream.cut(rt, "append")?;
        // A low-rank codec fits its basis on the first batch, the calibration window (staged:
        // a fused run needs the basis).
        if self.pool.cfg.codec.is_low_rank() && !self.pool.calibrated {
            self.pool.calibrate(rt, self.cfg.basis_iters)?;
            if let Some(m) = &mut self.model {
                m.codec_basis = self.pool.read_basis(rt).await?;
            }
        }

        // Compress the pages that left their ring's head (no-op without a codec).
        {
            let mut pass = stream.enc.begin_compute_pass(&desc("compress", ts(self.timer.as_ref(), st.timed, Slot::Compress, layers)));
            self.pool.encode_compress(&mut pass);
        }
        stream.cut(rt, "codec")?;
        if let Some(r) = &mut self.reference {
            r.pool.append_timed(rt, &new, &words, self.step, Some(routed), None)?;
        }
        if self.model.is_some() {
            // The lockstep appends the same tokens with the experts the GPU routed.
            let k = self.cfg.workload.top_k as usize;
            for layer in 0..layers {
                let ex = self.router.read_experts(rt, layer, per_layer).await?;
                let ga = self.router.read_gates(rt, layer, per_layer).await?;
                for i in 0..per_layer as usize {
                    let t = &mut new[layer as usize * per_layer as usize + i];
                    t.experts = ex[i * k..(i + 1) * k].to_vec();
                    t.gates = ga[i * k..(i + 1) * k].to_vec();
                }
            }
            if let Some(m) = &mut self.model {
                m.append(&new, &words, self.step)?;
                m.compress();
            }
        }
        if !st.attend {
            return stream.finish(rt).map(|()| None);
        }

        // Gather the page lists, then attend every layer.
        if self.flexgen.is_some() {
            // Fetch the host pages these queries select before attention reads the pool.
            let bounds = self.refresh_bounds(rt).await?;
            let group = self.cfg.workload.group;
            if let Some((fg, _)) = &mut self.flexgen {
                fg.begin_step();
                for (layer, q) in queries.iter().enumerate() {
                    fg.fetch(rt, &self.pool, layer as u32, q, group, &bounds).await?;
                }
            }
        }
        let mut errors = Vec::new();
        for (layer, q) in (0..layers).zip(&queries) {
            if layer == 0 {
                self.pool.encode_gather(rt, &mut stream.enc, 0, layers, ts(self.timer.as_ref(), st.timed, Slot::Gather, layers));
            }
            self.attn.encode_layer_inputs(&mut stream.enc, layer)?;
            if let Some(qs) = &self.quest {
                qs.prepare(rt, layer, &self.attn);
            }
            {
                let mut pass =
                    stream.enc.begin_compute_pass(&desc("attend", ts(self.timer.as_ref(), st.timed, Slot::Attend(layer), layers)));
                if let Some(qs) = &self.quest {
                    if layer == 0 {
                        qs.encode_summarize(&mut pass);
                    }
                    qs.encode_select(&mut pass, layer)?;
                }
                self.attn.encode(&mut pass);
            }
            stream.cut(rt, "attend")?;
            if let Some(r) = &self.reference {
                r.attn.set_queries(rt, q)?;
                r.attn.prepare(rt, layer, self.step);
                let mut enc = encoder(rt);
                if layer == 0 {
                    r.pool.encode_gather(rt, &mut enc, 0, layers, None);
                }
                r.attn.encode(&mut enc.begin_compute_pass(&desc("reference attend", None)));
                rt.queue.submit([enc.finish()]);
                let got = self.attn.read_output(rt).await?;
                let want = r.attn.read_output(rt).await?;
                errors.push(rel_l2(&got, &want));
            }
            if self.model.is_some() {
                self.check_layer(rt, layer, q).await?;
            }
        }
        self.last_queries = queries.into_iter().last().unwrap_or_default();

        // Evict down to the budget (after attention recorded this step's masses); FlexGen moves
        // its coldest pages to host memory instead.
        if self.flexgen.is_some() {
            if self.model.is_some() {
                return Err(Error::config("verify", true, "FlexGen moves pages through the host; run it with --no-verify"));
            }
            let bounds = self.refresh_bounds(rt).await?;
            if let Some((fg, _)) = &mut self.flexgen {
                fg.offload(rt, &self.pool, &bounds).await?;
            }
        }
        let scheduler = self.scheduler.as_ref().filter(|_| self.flexgen.is_none());
        let before = match (scheduler, &self.model) {
            (Some(s), Some(m)) => {
                // The lockstep carries the metadata attention left (checked in `check_layer`);
                // nothing between attention and eviction may have changed it.
                rt.wait()?;
                if rt.read_all::<u32>(&self.pool.slot_meta).await? != m.slot_meta {
                    return Err(verify_err(format!("step {}: slot metadata changed between attention and eviction", self.step)));
                }
                Some(s.read_lists(rt).await?)
            }
            _ => None,
        };
        {
            // The pass is there without a scheduler too: the timer's pair is written every step.
            let mut pass = stream.enc.begin_compute_pass(&desc("evict", ts(self.timer.as_ref(), st.timed, Slot::Evict, layers)));
            if let Some(s) = scheduler {
                s.encode(&mut pass);
            }
        }
        stream.cut(rt, "evict")?;
        if let (Some(s), Some(m), Some(before)) = (scheduler, &mut self.model, before) {
            let lists = s.read_lists(rt).await?;
            check_eviction(rt, s, m, self.step, &lens, &before, &lists).await?;
        }

        // Recount each expert's cached tokens and miss rate for the next routing.
        if st.miss {
            {
                let mut pass = stream.enc.begin_compute_pass(&desc("route/miss", ts(self.timer.as_ref(), st.timed, Slot::Miss, layers)));
                self.router.encode_miss(&mut pass)?;
            }
            if let (Some(t), true) = (&self.timer, st.timed) {
                t.resolve(&mut stream.enc, Slot::pairs(layers));
            }
        }
        stream.finish(rt)?;
        Ok((!errors.is_empty()).then(|| errors.iter().sum::<f64>() / errors.len() as f64))
    }
}
