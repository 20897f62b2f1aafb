//! The decode step's stage sequence, written once for every source of K/V: the synthetic
//! workload ([`crate::pipeline`]) and a trained model (`expertkv-model`) record their steps and
//! prefill passes through [`record()`], each plugging its own products in as a [`Source`].
//!
//! Per layer: the source writes the layer's inputs (queries, K/V words, router logits), then
//! route (`route/`), append (`append/`), compress (`compress/`), gather and attend (`attend/`,
//! with QUEST's selection from `evict/quest`), then the source's output (a model's FFN). After
//! the last layer: the source's end (a model's head), evict (`evict/`, the victims captured into
//! the recall tier where one is kept) and the experts' miss recount (`route/miss`); with the recall
//! tier, each layer's attention also reads its lists' best evicted pages (`attend/recall`). Where the host must act mid-step (the CPU lockstep, FlexGen's host
//! tier, an expert cache), the recording is cut into segments ([`record::Recorder::cut`]);
//! otherwise a step is one submission.

pub mod kv;
pub mod record;

pub use kv::{KvSide, KvSideConfig, RouteSpec, RouteStage};
pub use record::{KvPause, Recorder, Segment, StepStage, StepTimer, Timing};

use crate::attend::Attention;
use crate::attend::prefill::PrefillAttention;
use crate::error::Result;
use crate::runtime::Runtime;

/// What a step's products are: the source of every layer's queries, K/V and router logits, and
/// whatever runs around the K/V side (a model's embedding, FFN and head).
pub trait Source<P> {
    /// Before the first layer (a model's embedding).
    fn begin(&self, _rec: &mut Recorder<'_, P>) -> Result<()> {
        Ok(())
    }

    /// Layer `layer`'s inputs: its queries into the attention's query buffer, its K/V words
    /// where [`Source::kv_words`] says, and, with the route stage, its router logits into the
    /// router's rows of the layer.
    fn layer_inputs(&self, rec: &mut Recorder<'_, P>, layer: u32) -> Result<()>;

    /// Where layer `layer`'s K/V words are once [`Source::layer_inputs`] ran: a buffer and the
    /// byte they start at (per token K then V of every KV head, in the pool's storage words).
    fn kv_words(&self, layer: u32) -> (&wgpu::Buffer, u64);

    /// After layer `layer`'s attention (a model's output projection and FFN).
    fn layer_output(&self, _rec: &mut Recorder<'_, P>, _layer: u32) -> Result<()> {
        Ok(())
    }

    /// After the last layer, before eviction (a model's head).
    fn end(&self, _rec: &mut Recorder<'_, P>) -> Result<()> {
        Ok(())
    }
}

/// K/V and queries made on the host (the synthetic workload, the soak) as a step's source:
/// every layer's K/V words staged in one buffer ([`HostSource::stage`]), its queries in the
/// attention's staging ([`Attention::stage_queries`]), copied into place before the layer's
/// attention; router logits, if any, written into the router's rows before the run.
pub struct HostSource<'a> {
    /// The attention whose staged queries are copied.
    pub attn: &'a Attention,
    /// Every layer's K/V words, layer after layer.
    pub words: &'a wgpu::Buffer,
    /// Bytes of one layer's K/V words.
    pub layer_bytes: u64,
    /// Whether the run attends (else no queries are staged).
    pub attends: bool,
}

impl HostSource<'_> {
    /// Write `words` (every layer's, layer after layer) into `buffer`, grown to fit.
    pub fn stage<'b>(rt: &Runtime, buffer: &'b mut Option<wgpu::Buffer>, words: &[u32]) -> &'b wgpu::Buffer {
        let bytes = (words.len() as u64 * 4).max(4);
        if buffer.as_ref().is_none_or(|b| b.size() < bytes) {
            *buffer = Some(rt.storage("staged K/V words", bytes));
        }
        let Some(b) = buffer else { unreachable!("allocated above") };
        rt.queue.write_buffer(b, 0, bytemuck::cast_slice(words));
        b
    }
}

impl<P> Source<P> for HostSource<'_> {
    fn layer_inputs(&self, rec: &mut Recorder<'_, P>, layer: u32) -> Result<()> {
        if self.attends {
            self.attn.encode_layer_queries(rec.enc(), layer)?;
        }
        Ok(())
    }

    fn kv_words(&self, layer: u32) -> (&wgpu::Buffer, u64) {
        (self.words, self.layer_bytes * u64::from(layer))
    }
}

/// Which attention a run of the stages takes.
#[derive(Clone, Copy)]
pub enum Attend<'a> {
    /// Decode attention ([`KvSide::attn`]): a query per sequence.
    Decode,
    /// A prompt chunk's causal attention over the pool.
    Prefill(&'a PrefillAttention),
    /// None: the tokens are only appended (a prefill batch with no policy to feed).
    Skip,
}

/// Where a run stops for the host's checks.
#[derive(Clone, Copy, Debug, Default)]
pub struct Checks {
    /// After every layer's append and attention ([`KvPause::Appended`], [`KvPause::Attended`]).
    pub layers: bool,
    /// Around the eviction ([`KvPause::BeforeEvict`], [`KvPause::Evicted`]).
    pub evict: bool,
}

/// One run of the stages: a decode step, or a prefill batch.
#[derive(Clone, Copy)]
pub struct Run<'a> {
    /// Tokens appended to each layer (as staged by [`KvSide::prepare`]).
    pub per_layer: u32,
    /// The attention.
    pub attend: Attend<'a>,
    /// Evict after the last layer (the scheduler, or FlexGen's offload).
    pub evict: bool,
    /// Recount every expert's cached tokens after it (the route stage's miss rates).
    pub miss: bool,
    /// The host's checks.
    pub checks: Checks,
}

/// Record one run of the stages over `kv`, with `src`'s products around them, into `rec`.
pub fn record<P: From<KvPause>, S: Source<P>>(kv: &KvSide, src: &S, rec: &mut Recorder<'_, P>, run: Run<'_>) -> Result<()> {
    let attends = !matches!(run.attend, Attend::Skip);
    src.begin(rec)?;
    for l in 0..kv.pool.cfg.layers {
        src.layer_inputs(rec, l)?;
        let routing = kv.route.as_ref().and_then(|r| r.staged(l));
        if let Some(r) = &kv.route {
            rec.pass("route", |p| r.router.encode(p, l, run.per_layer));
        }
        kv.pool.copy_staged_batch(rec.enc(), l, src.kv_words(l), routing)?;
        rec.pass("append", |p| kv.pool.encode_staged_dispatches(p, routing));
        if kv.pool.ready_to_compress() {
            // Pages that left their ring's head are compressed before anything reads them.
            rec.pass("compress", |p| kv.pool.encode_compress(p));
        }
        if run.checks.layers || (kv.flexgen.is_some() && attends) {
            rec.cut(KvPause::Appended(l).into());
        }
        if attends {
            kv.pool.copy_gather_params(rec.enc(), l)?;
            rec.pass("gather", |p| kv.pool.encode_gather_dispatch(p));
            match run.attend {
                Attend::Prefill(a) => rec.pass("attention", |p| a.encode(p, l))?,
                _ => {
                    kv.attn.encode_layer_params(rec.enc(), l)?;
                    rec.pass("attention", |p| -> Result<()> {
                        if let Some(q) = &kv.quest {
                            // The layer's pages are all appended: refresh the bounds of those
                            // that changed, then select for the layer's queries.
                            q.encode_summarize(p);
                            q.encode_select(p, l)?;
                        }
                        kv.attn.encode_split(p);
                        if kv.recall.is_none() {
                            kv.attn.encode_merge(p);
                        }
                        Ok(())
                    })?;
                    // The recall tier's best pages join the softmax before the reduce, in a
                    // pass of their own (a stage of their own in the timings).
                    if let Some(r) = &kv.recall {
                        rec.pass("recall", |p| r.encode_recall(p))?;
                        rec.pass("attention", |p| kv.attn.encode_merge(p));
                    }
                }
            }
            rec.tag(StepStage::Attention(l));
            if run.checks.layers {
                rec.cut(KvPause::Attended(l).into());
            }
        }
        src.layer_output(rec, l)?;
    }
    src.end(rec)?;
    if run.evict {
        if (run.checks.evict && kv.scheduler.is_some()) || kv.flexgen.is_some() {
            rec.cut(KvPause::BeforeEvict.into());
        }
        if let Some(s) = &kv.scheduler {
            rec.pass("evict", |p| s.encode(p));
            if run.checks.evict {
                rec.cut(KvPause::Evicted.into());
            }
        }
    }
    if let (true, Some(r)) = (run.miss, &kv.route) {
        rec.pass("miss", |p| r.router.encode_miss(p))?;
    }
    Ok(())
}
