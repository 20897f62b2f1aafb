//! A run of the decode step's stages ([`crate::step::record`]) over the synthetic workload: the
//! workload as the step's source ([`HostSource`]: its K/V words, queries and router logits
//! staged from the host), submitted as one command buffer when nothing needs the host mid-step, else in segments
//! with the host's side work where they end: the CPU lockstep's append and checks, the
//! full-cache reference's attention, FlexGen's host tier. Prefill runs the same stages over
//! batches of positions (attending and evicting only with a scheduler).

use super::lockstep::{check_eviction, check_routing, verify_err};
use super::{Pipeline, kv_words, rel_l2};
use crate::append::format::NewToken;
use crate::error::{Error, Result};
use crate::gpu_data::ListState;
use crate::runtime::Runtime;
use crate::step::{self, Attend, Checks, HostSource, KvPause, Recorder, Run};
use crate::workload::GenToken;

/// What one run of the stages covers.
#[derive(Clone, Copy, Debug)]
pub(super) struct Stages {
    /// Tokens routed and appended per layer (sequences x positions).
    pub per_layer: u32,
    /// Timestamps around every pass (a decode step's report).
    pub timed: bool,
    /// One submission (see [`Pipeline::fused`]); otherwise one per pause of the host.
    pub fused: bool,
    /// Attend and evict (a prefill batch with nothing to evict only appends).
    pub attend: bool,
    /// Recount the experts' misses (every decode step).
    pub miss: bool,
}

/// What the host's side work of a run reads and carries between its pauses.
struct SideWork {
    tokens: Vec<NewToken>,
    words: Vec<u32>,
    queries: Vec<Vec<f32>>,
    per_layer: u32,
    /// Every sequence's length after the run (the scheduler's and the lockstep's).
    lens: Vec<u32>,
    /// Whether the run compresses (the lockstep compresses after each layer's append too).
    compressing: bool,
    /// The lists before eviction (the lockstep's).
    before: Option<Vec<ListState>>,
    /// The attention error of every layer against the full-cache reference.
    errors: Vec<f64>,
    /// The lockstep's: every token's router logits, the route stage's statistics before the
    /// run, and the hash router's number of the run's first token.
    gen_logits: Vec<Vec<f32>>,
    route_stats: Vec<crate::gpu_data::ExpertStats>,
    token_offset: u32,
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
        let layers = self.kv.pool.cfg.layers;
        let per_layer = st.per_layer;
        if st.fused && !self.fused() {
            return Err(Error::Input("this pipeline needs the host between stages; run it staged".into()));
        }
        let n_seqs = self.cfg.workload.n_seqs;
        let lens: Vec<u32> = (0..n_seqs).map(|q| self.workload.position(q)).collect();
        // A low-rank codec fits its basis once the calibration window is in the pool (its pages
        // stayed raw); this run then compresses them.
        let held: Vec<u32> = lens.iter().map(|&l| l.saturating_sub(per_layer / n_seqs)).collect();
        if self.kv.calibrate_if_due(rt, &held, self.calibration_window, self.cfg.basis_iters)?
            && let Some(m) = &mut self.model
        {
            m.codec_basis = self.kv.pool.read_basis(rt).await?;
        }
        // Every input is staged before anything is recorded.
        let e = self.cfg.workload.n_experts as usize;
        for layer in 0..layers {
            let rows = &tokens[(layer * per_layer) as usize..((layer + 1) * per_layer) as usize];
            let logits: Vec<f32> = rows.iter().flat_map(|t| t.logits.iter().copied()).collect();
            debug_assert_eq!(logits.len(), rows.len() * e);
            self.router().set_logits(rt, layer, &logits)?;
        }
        let words = kv_words(tokens, self.kv.pool.cfg.dtype);
        let stage = HostSource::stage(rt, &mut self.kv_stage, &words);
        let new: Vec<NewToken> = tokens.iter().map(|t| t.token.clone()).collect();
        // The lockstep routes from the statistics the run starts from.
        let (gen_logits, route_stats) = match (&self.model, &self.kv.route) {
            (Some(_), Some(route)) => (tokens.iter().map(|t| t.logits.clone()).collect(), route.router.read_stats(rt).await?),
            _ => (Vec::new(), Vec::new()),
        };
        let token_offset = self.routed_tokens;
        self.kv.prepare(rt, &new, per_layer, self.step, self.routed_tokens, st.attend.then_some(&lens[..]))?;
        self.routed_tokens = self.routed_tokens.wrapping_add(layers * per_layer);
        if st.attend {
            self.kv.attn.stage_queries(rt, &queries)?;
        }
        let run = Run {
            per_layer,
            attend: if st.attend { Attend::Decode } else { Attend::Skip },
            evict: st.attend,
            miss: st.miss,
            checks: Checks { layers: self.model.is_some() || self.reference.is_some(), evict: self.model.is_some() },
        };
        let segments = {
            let layer_bytes = words.len() as u64 * 4 / u64::from(layers);
            let source = HostSource { attn: &self.kv.attn, words: stage, layer_bytes, attends: st.attend };
            let timer = self.timer.as_mut().filter(|_| st.timed);
            let mut rec = Recorder::new(rt, "decode step", timer);
            step::record(&self.kv, &source, &mut rec, run)?;
            rec.finish()
        };
        let compressing = self.kv.pool.ready_to_compress();
        let mut side = SideWork {
            tokens: new,
            words,
            queries,
            per_layer,
            lens,
            compressing,
            before: None,
            errors: Vec::new(),
            gen_logits,
            route_stats,
            token_offset,
        };
        for seg in segments {
            rt.queue.submit([seg.cb]);
            if let Some(pause) = seg.then {
                rt.check("decode step")?;
                self.side_work(rt, pause, &mut side).await?;
            }
        }
        rt.check("decode step")?;
        if st.attend {
            self.last_queries = side.queries.pop().unwrap_or_default();
        }
        let errors = side.errors;
        Ok((!errors.is_empty()).then(|| errors.iter().sum::<f64>() / errors.len() as f64))
    }

    /// The host's work where a staged run stops.
    async fn side_work(&mut self, rt: &Runtime, pause: KvPause, s: &mut SideWork) -> Result<()> {
        let step = self.step;
        match pause {
            KvPause::Appended(l) => {
                if self.kv.flexgen.is_some() {
                    // The layer's host pages its queries select come back before its gather.
                    self.kv.fetch_host_pages(rt, l).await?;
                }
                let (lo, hi) = ((l * s.per_layer) as usize, ((l + 1) * s.per_layer) as usize);
                let kvw = s.words.len() / s.tokens.len().max(1);
                let words = &s.words[lo * kvw..hi * kvw];
                let Some(route) = &self.kv.route else { unreachable!("the pipeline routes") };
                if let Some(r) = &mut self.reference {
                    r.pool.append_timed(rt, &s.tokens[lo..hi], words, step, Some(route.routed(l, s.per_layer)), None)?;
                }
                if let Some(m) = &mut self.model {
                    // The lockstep routes the layer itself (checked against what the GPU routed)
                    // and appends the same tokens with the experts it chose (their gates as the
                    // GPU rounded them, once checked).
                    let k = self.cfg.workload.top_k as usize;
                    let p = route.router.params(l, s.per_layer, s.token_offset.wrapping_add(l * s.per_layer));
                    let logits: Vec<f32> = s.gen_logits[lo..hi].iter().flatten().copied().collect();
                    let (bias, experts, gates) = route.router.read_choice(rt, l, s.per_layer).await?;
                    let (ex, ga) = check_routing(&p, &s.route_stats, &logits, &bias, &experts, &gates, step)?;
                    let mut layer = s.tokens[lo..hi].to_vec();
                    for (i, t) in layer.iter_mut().enumerate() {
                        t.experts = ex[i * k..(i + 1) * k].to_vec();
                        t.gates = ga[i * k..(i + 1) * k].to_vec();
                    }
                    m.append(&layer, words, step)?;
                    if s.compressing {
                        m.compress();
                    }
                }
            }
            KvPause::Attended(l) => {
                let q = &s.queries[l as usize];
                if let Some(r) = &self.reference {
                    r.attn.set_queries(rt, q)?;
                    r.attn.prepare(rt, l, step);
                    let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("reference attend") });
                    r.pool.encode_gather_layer(&mut enc, l)?;
                    r.attn.encode(
                        &mut enc
                            .begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("reference attend"), timestamp_writes: None }),
                    );
                    rt.queue.submit([enc.finish()]);
                    let got = self.kv.attn.read_output(rt).await?;
                    let want = r.attn.read_output(rt).await?;
                    s.errors.push(rel_l2(&got, &want));
                }
                if self.model.is_some() {
                    let q = q.clone();
                    self.check_layer(rt, l, &q).await?;
                }
            }
            KvPause::BeforeEvict => {
                if self.kv.flexgen.is_some() {
                    // This step's attention mass counts: the coldest pages past the budget go to
                    // host memory.
                    self.kv.offload_host_pages(rt).await?;
                }
                if let (Some(sch), Some(m)) = (&self.kv.scheduler, &self.model) {
                    // The lockstep carries the metadata attention left (checked in `check_layer`);
                    // nothing between attention and eviction may have changed it.
                    rt.wait()?;
                    if rt.read_all::<u32>(&self.kv.pool.slot_meta).await? != m.slot_meta {
                        return Err(verify_err(format!("step {step}: slot metadata changed between attention and eviction")));
                    }
                    s.before = Some(sch.read_lists(rt).await?);
                }
            }
            KvPause::Evicted => {
                if let (Some(sch), Some(m), Some(before)) = (&self.kv.scheduler, &mut self.model, &s.before) {
                    let lists = sch.read_lists(rt).await?;
                    check_eviction(rt, sch, m, step, &s.lens, before, &lists).await?;
                }
            }
        }
        Ok(())
    }
}
