//! Chunked prefill ([`GpuLlama::prefill`]): a prompt through the model a chunk of tokens
//! ([`super::ModelOptions::prefill_chunk`]) a forward pass, its K/V appended a chunk at a time,
//! causal attention over the pool.

use super::schedule::Pause;
use super::{GpuLlama, GpuMoe, Layer, Recording, Scratch, attention_output, record, shared_expert};
use crate::config::LlamaConfig;
use crate::ops::{GpuMatrix, ModelKernels, MoeGroups, Recorded};
use crate::{Error, Result};
use expertkv_core::append::format::NewToken;
use expertkv_core::config::{Codec, KvDtype};
use expertkv_core::runtime::Runtime;
use expertkv_core::runtime::dispatch::dispatches_encoded;
use expertkv_core::step::{self, Attend, Checks, Recorder, Run, Source};

/// What a chunked prefill uses beside the decode step's buffers: the causal attention, scratch
/// for a chunk of tokens, the last token's hidden state and its logits.
pub(super) struct Prefill {
    attn: expertkv_core::attend::prefill::PrefillAttention,
    s: Scratch,
    h_last: wgpu::Buffer,
    /// With experts: the router's scores, the chosen experts, their weights (1 when MoEfied),
    /// the experts' activations and the choices, for a chunk.
    moe: Option<[wgpu::Buffer; 5]>,
    /// Every token's logits of a chunk (`[chunk][vocab]`), made by the first
    /// [`GpuLlama::prefill_logits`].
    logits_all: Option<wgpu::Buffer>,
    /// The model's kernels with the products tiled ([`ModelKernels::for_prefill`]).
    kernels: ModelKernels,
    /// A MoE file's experts grouped by expert over the chunk
    /// ([`ModelKernels::moe_ffn_grouped`]), where they can be.
    groups: Option<MoeGroups>,
}

impl GpuLlama {
    /// Why a prompt cannot be fed in chunks here (then [`GpuLlama::forward`] feeds it token by
    /// token): chunked prefill runs over raw pages (f16 or f32) with no policy acting between
    /// tokens, that is no evicting scheduler, QUEST or host tier (they act after every token),
    /// no page codec, no route stage and no pipeline router over the experts (a MoE file's own
    /// router or a MoEfication's top k is fine). `None` when it can.
    pub fn chunked_prefill_refusal(&self) -> Option<&'static str> {
        self.kv_order_refusal().or_else(|| {
            self.moe
                .as_ref()
                .is_some_and(|m| m.cache.is_some())
                .then_some("the expert cache fetches each step's experts between a layer's router and its FFN")
        })
    }

    /// Why K/V cannot be put into the pool other than token by token through the decode step
    /// (a chunked prefill's or a restored prefix's): a policy acting between tokens (an evicting
    /// scheduler, QUEST, a host tier), a page codec, the route stage or a pipeline router over
    /// the experts (both place a token's K/V by its routing). `None` when it can.
    pub fn kv_order_refusal(&self) -> Option<&'static str> {
        if self.kv.scheduler.is_some() || self.kv.quest.is_some() || self.kv.flexgen.is_some() {
            Some("a scheduler acts after every token")
        } else if self.kv.pool.cfg.codec != Codec::None {
            Some("a page codec is on")
        } else if self.labels.is_some() {
            Some("the route stage labels every token")
        } else if self.moe.as_ref().is_some_and(|m| m.routed.is_some()) {
            Some("one of the pipeline's routers chooses the experts step by step")
        } else {
            None
        }
    }

    /// Feed `ids` to sequence `seq` (from its current position) a chunk of tokens
    /// ([`super::ModelOptions::prefill_chunk`]) a forward pass: each chunk's Q/K/V for all its
    /// tokens in one product per layer, its K/V appended to the pool a chunk at a time, causal
    /// attention over the sequence's pages ([`expertkv_core::attend::prefill`]), the FFN over
    /// the chunk; returns the last token's logits (`[vocab]`). The other sequences are
    /// untouched; the result equals feeding the tokens one [`GpuLlama::forward`] at a time,
    /// within f32 rounding. Refused, before any GPU work, where
    /// [`GpuLlama::chunked_prefill_refusal`] says why.
    pub async fn prefill(&mut self, rt: &Runtime, seq: u32, ids: &[u32]) -> Result<Vec<f32>> {
        self.prefill_chunks(rt, seq, ids, false).await
    }

    /// [`GpuLlama::prefill`] returning every token's logits (`[ids.len()][vocab]`, in order), as
    /// feeding the tokens one [`GpuLlama::forward`] at a time gives them (within f32 rounding):
    /// a text's perplexity a chunk a pass. The LM head runs on every token of a chunk (its
    /// logits, `prefill_chunk x vocab` floats, read back after each chunk); refused where that
    /// buffer exceeds the device's storage binding (a smaller chunk fits).
    pub async fn prefill_logits(&mut self, rt: &Runtime, seq: u32, ids: &[u32]) -> Result<Vec<f32>> {
        self.prefill_chunks(rt, seq, ids, true).await
    }

    /// [`GpuLlama::prefill`], with every token's logits when `every`.
    async fn prefill_chunks(&mut self, rt: &Runtime, seq: u32, ids: &[u32], every: bool) -> Result<Vec<f32>> {
        if let Some(why) = self.chunked_prefill_refusal() {
            return Err(Error::Input(format!("chunked prefill: {why}; feed the prompt token by token")));
        }
        if seq >= self.n_seqs || ids.is_empty() {
            return Err(Error::Input(format!("prefill: {} tokens for sequence {seq} of {}", ids.len(), self.n_seqs)));
        }
        if let Some(t) = ids.iter().find(|&&t| t >= self.cfg.vocab_size) {
            return Err(Error::Input(format!("token id {t} is outside the vocabulary ({})", self.cfg.vocab_size)));
        }
        let pc = &self.kv.pool.cfg;
        let cap = (pc.ring_capacity - 1) * pc.page_size - pc.page_size;
        let at = self.positions[seq as usize];
        if u64::from(at) + ids.len() as u64 > u64::from(cap.min(self.max_context)) {
            return Err(Error::Input(format!(
                "prefill: {} tokens from position {at} do not fit the context of {} tokens",
                ids.len(),
                cap.min(self.max_context)
            )));
        }
        let chunk_tokens = self.prefill_chunk;
        if self.prefill.is_none() {
            // A chunk's widest scratch (the step's widest buffer, or a MoE layer's activations:
            // the chosen experts' neurons) must fit one storage binding.
            let c = u64::from(chunk_tokens);
            let moe_act = self
                .moe
                .as_ref()
                .map(|m| u64::from(m.top_k) * u64::from(m.layers.iter().map(|(_, f)| f.max_size).max().unwrap_or(1).max(1)));
            let widest = u64::from(Scratch::widest_per_token(&self.cfg)).max(moe_act.unwrap_or(0));
            rt.fits_binding("a prefill chunk's scratch (a smaller prefill chunk fits)", c * widest * 4)?;
            let group = self.cfg.head_count / self.cfg.head_count_kv;
            use expertkv_core::attend::prefill::{PREFILL_CHUNK_PAGES, PrefillAttention};
            let attn = PrefillAttention::new(rt, &self.kv.pool, group, chunk_tokens, PREFILL_CHUNK_PAGES).await?;
            let s = Scratch::new(rt, &self.cfg, chunk_tokens, 1);
            let h_last = rt.storage("prefill last hidden", u64::from(self.cfg.embedding_length) * 4);
            let moe = self.moe.as_ref().zip(moe_act).map(|(m, act)| {
                let (e, k) = (u64::from(m.n_experts), u64::from(m.top_k));
                [
                    rt.storage("prefill moe scores", c * e * 4),
                    rt.storage("prefill moe sel", c * k * 4),
                    rt.storage_init("prefill moe weights", &vec![1f32; (c * k) as usize]),
                    rt.storage("prefill moe act", c * act * 4),
                    rt.storage("prefill moe choices", c * k * u64::from(self.cfg.block_count) * 4),
                ]
            });
            // A MoE file's experts grouped by expert where they can be (their per-pair outputs
            // within a storage binding; else the per-token kernels).
            let groups = self.moe.as_ref().and_then(|m| {
                let groupable = m.layers.iter().all(|(_, f)| f.groupable());
                let out = c * u64::from(m.top_k) * u64::from(self.cfg.embedding_length) * 4;
                let fits = rt.fits_binding("the grouped experts' outputs", out).is_ok();
                (groupable && fits).then(|| MoeGroups::new(rt, chunk_tokens, m.n_experts, m.top_k, self.cfg.embedding_length))
            });
            let kernels = self.kernels.for_prefill(rt).await?;
            self.prefill = Some(Prefill { attn, s, h_last, moe, logits_all: None, kernels, groups });
        }
        let vocab = u64::from(self.cfg.vocab_size);
        if let Some(pf) = self.prefill.as_mut().filter(|pf| every && pf.logits_all.is_none()) {
            let bytes = u64::from(chunk_tokens) * vocab * 4;
            rt.fits_binding("prefill every token's logits (a smaller prefill chunk fits)", bytes)?;
            pf.logits_all = Some(rt.storage("prefill every token's logits", bytes));
        }
        let d0 = dispatches_encoded();
        let mut all: Vec<f32> = Vec::new();
        for chunk in ids.chunks(chunk_tokens as usize) {
            let cbs = self.encode_prefill_chunk(rt, seq, chunk, every)?;
            rt.queue.submit(cbs);
            rt.check("model prefill")?;
            if let Some(buf) = self.prefill.as_ref().and_then(|pf| pf.logits_all.as_ref()).filter(|_| every) {
                all.extend(rt.read::<f32>(buf, 0, chunk.len() as u64 * vocab).await?);
            }
            // The chunk's expert choices into the counts a decode step adds to.
            if let (Some(moe), Some([.., log])) = (self.moe.as_mut(), self.prefill.as_ref().and_then(|pf| pf.moe.as_ref())) {
                let per_layer = chunk.len() * moe.top_k as usize;
                let chosen: Vec<u32> = rt.read(log, 0, (per_layer * self.cfg.block_count as usize) as u64).await?;
                moe.count(&chosen, per_layer);
            }
            if let Some(t) = &mut self.timer {
                t.collect(rt, "prefill").await?;
            }
            self.positions[seq as usize] += chunk.len() as u32;
            self.step += 1;
            if self.trace.is_some() {
                self.trace_pass(rt, chunk.len() as u32, None, Some(seq)).await?;
            }
        }
        self.dispatches = (dispatches_encoded() - d0) / ids.len().div_ceil(chunk_tokens as usize) as u64;
        self.kv.pool.check_errors(rt, chunk_tokens * self.cfg.block_count).await?;
        if every {
            return Ok(all);
        }
        let Some(pf) = &self.prefill else { unreachable!("made above") };
        rt.read(&pf.s.logits, 0, vocab).await
    }

    /// One prefill chunk of sequence `seq` recorded into one command buffer (see
    /// [`GpuLlama::prefill`]): the decode step's stage sequence over the chunk, with causal
    /// attention, the LM head on its last token, or on all of them when `every`.
    fn encode_prefill_chunk(&mut self, rt: &Runtime, seq: u32, chunk: &[u32], every: bool) -> Result<Vec<wgpu::CommandBuffer>> {
        let c = self.cfg.clone();
        let n = chunk.len() as u32;
        let first = self.positions[seq as usize];
        let k = self.kv.pool.cfg.top_k as usize;
        let Some(pf) = &mut self.prefill else { return Err(Error::Input("prefill: not set up".into())) };
        pf.attn.stage(rt, seq, first, n)?;
        let positions: Vec<u32> = (first..first + n).collect();
        rt.queue.write_buffer(&pf.s.tokens, 0, bytemuck::cast_slice(chunk));
        rt.queue.write_buffer(&pf.s.positions, 0, bytemuck::cast_slice(&positions));
        let new: Vec<NewToken> = (0..c.block_count)
            .flat_map(|l| {
                positions.iter().map(move |&position| NewToken {
                    layer: l,
                    seq,
                    position,
                    experts: (0..k as u32).collect(),
                    gates: vec![1.0; k],
                })
            })
            .collect();
        self.kv.prepare(rt, &new, n, self.step, 0, None)?;
        let f16 = self.kv.pool.cfg.dtype == KvDtype::F16;
        let (embed, output, out_norm) = (&self.io.0, self.io.1.as_ref(), &self.io.2);
        let Some(pf) = &self.prefill else { return Err(Error::Input("prefill: not set up".into())) };
        let recording = record(
            rt,
            &pf.kernels,
            &c,
            &self.layers,
            (embed, output, out_norm),
            &pf.s,
            (&pf.attn.queries, pf.attn.output()),
            n,
            f16,
            false,
        )?;
        let source = ChunkProducts {
            rt,
            cfg: &c,
            pf,
            rec: &recording,
            layers: &self.layers,
            moe: self.moe.as_ref(),
            head: (output.unwrap_or(embed), out_norm, &self.kernels),
            n,
            every,
        };
        let run = Run { per_layer: n, attend: Attend::Prefill(&pf.attn), evict: false, miss: false, checks: Checks::default() };
        let mut rec = Recorder::new(rt, "model prefill", self.timer.as_mut().map(|t| &mut t.timer));
        step::record(&self.kv, &source, &mut rec, run)?;
        Ok(rec.finish().into_iter().map(|seg| seg.cb).collect())
    }
}

/// A prefill chunk's products as the step's source: the decode step's, over the chunk's tokens
/// with the tiled kernels, a MoE file's experts grouped by expert where they can be, the LM head
/// on the chunk's last token (or every token's).
struct ChunkProducts<'a> {
    rt: &'a Runtime,
    cfg: &'a LlamaConfig,
    pf: &'a Prefill,
    rec: &'a Recording,
    layers: &'a [Layer],
    moe: Option<&'a GpuMoe>,
    /// The LM head, the final norm's gain, and the decode step's kernels (a single token's head).
    head: (&'a GpuMatrix, &'a wgpu::Buffer, &'a ModelKernels),
    n: u32,
    every: bool,
}

impl Source<Pause> for ChunkProducts<'_> {
    fn begin(&self, rec: &mut Recorder<'_, Pause>) -> Result<()> {
        rec.pass("embed", |p| self.rec.embed.encode(p));
        Ok(())
    }

    fn layer_inputs(&self, rec: &mut Recorder<'_, Pause>, layer: u32) -> Result<()> {
        rec.pass("attention inputs", |p| self.rec.attention_inputs[layer as usize].encode(p));
        Ok(())
    }

    fn kv_words(&self, _layer: u32) -> (&wgpu::Buffer, u64) {
        (&self.pf.s.kv_words, 0)
    }

    fn layer_output(&self, rec: &mut Recorder<'_, Pause>, l: u32) -> Result<()> {
        let (rt, c, pf, n) = (self.rt, self.cfg, self.pf, self.n);
        let (Some(moe), Some([scores, sel, wts, act, log])) = (self.moe, &pf.moe) else {
            rec.pass("output and FFN", |p| self.rec.ffn[l as usize].encode(p));
            return Ok(());
        };
        // The experts over the chunk, as `install_moe` records them for a step.
        let (w, (router, ffn_l)) = (&self.layers[l as usize], &moe.layers[l as usize]);
        let (kern, s, e, k) = (&pf.kernels, &pf.s, moe.n_experts, moe.top_k);
        let mut p = Recorded::default();
        attention_output(rt, kern, c, w, s, pf.attn.output(), n, &mut p)?;
        kern.matvec(rt, &mut p, router, &s.xn, scores, n)?;
        // Every layer's choices kept, for the expert counts (read after the chunk).
        kern.moe_topk(rt, &mut p, scores, sel, log, l * n * k, n, e, k)?;
        if let Some(share) = super::softmax_share(c, moe.native) {
            kern.moe_weights(rt, &mut p, scores, sel, wts, n, e, k, share)?;
        }
        match &pf.groups {
            Some(g) => kern.moe_ffn_grouped(rt, &mut p, ffn_l, (&s.xn, sel, wts, act, &s.h), g, n, k, true)?,
            None => kern.moe_ffn(rt, &mut p, ffn_l, &s.xn, sel, wts, act, &s.h, n, k, true)?,
        }
        shared_expert(rt, kern, c, w, s, n, &mut p)?;
        rec.pass("output and experts", |pass| p.encode(pass));
        Ok(())
    }

    fn end(&self, rec: &mut Recorder<'_, Pause>) -> Result<()> {
        // The LM head on every token (tiled), or on the chunk's last token only (the decode
        // step's matrix-vector kernel: one token).
        let (rt, c, pf, n) = (self.rt, self.cfg, self.pf, self.n);
        let (head, out_norm, step_kernels) = self.head;
        let mut p = Recorded::default();
        match pf.logits_all.as_ref().filter(|_| self.every) {
            Some(all) => pf.kernels.matvec_norm(rt, &mut p, head, &pf.s.h, out_norm, c.rms_norm_eps, &[(all, head.rows)], n)?,
            None => {
                let h = u64::from(c.embedding_length) * 4;
                rec.enc().copy_buffer_to_buffer(&pf.s.h, u64::from(n - 1) * h, &pf.h_last, 0, h);
                step_kernels.matvec_norm(rt, &mut p, head, &pf.h_last, out_norm, c.rms_norm_eps, &[(&pf.s.logits, head.rows)], 1)?;
            }
        }
        rec.pass("head", |pass| p.encode(pass));
        Ok(())
    }
}
