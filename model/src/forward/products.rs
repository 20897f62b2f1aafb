//! The model's own products as the decode step's source ([`expertkv_core::step::Source`]): the
//! embedding before the first layer, each layer's attention inputs (and the route stage's
//! scores) before the K/V side's stages and its output projection and FFN after them, the LM
//! head after the last layer. The dispatches were recorded at load ([`super::Recording`],
//! [`super::GpuMoe`]); this replays them into the step's recording.

use super::schedule::Pause;
use super::{GpuMoe, Recording, Scratch};
use crate::Result;
use crate::labels::KvLabels;
use expertkv_core::route::Router;
use expertkv_core::step::{Recorder, Source, StepStage};

/// A decode step's products (see the module docs).
pub(super) struct Products<'a> {
    pub rec: &'a Recording,
    pub s: &'a Scratch,
    pub moe: Option<&'a GpuMoe>,
    /// The route stage's scores and the router they go to.
    pub labels: Option<(&'a KvLabels, &'a Router)>,
    /// Sequences decoded together.
    pub n: u32,
}

impl Source<Pause> for Products<'_> {
    fn begin(&self, rec: &mut Recorder<'_, Pause>) -> Result<()> {
        rec.pass("embed", |p| self.rec.embed.encode(p));
        Ok(())
    }

    fn layer_inputs(&self, rec: &mut Recorder<'_, Pause>, layer: u32) -> Result<()> {
        rec.pass("attention inputs", |p| self.rec.attention_inputs[layer as usize].encode(p));
        if let Some((labels, router)) = self.labels {
            labels.encode_scores(rec, router, layer);
        }
        Ok(())
    }

    fn kv_words(&self, _layer: u32) -> (&wgpu::Buffer, u64) {
        (&self.s.kv_words, 0)
    }

    fn layer_output(&self, rec: &mut Recorder<'_, Pause>, layer: u32) -> Result<()> {
        let l = layer as usize;
        let Some(moe) = self.moe else {
            rec.pass("output and FFN", |p| self.rec.ffn[l].encode(p));
            return Ok(());
        };
        match &moe.routed {
            None if moe.cache.is_some() => {
                // The host reads the layer's choices and fetches the missing experts here.
                rec.pass("output and router", |p| moe.recorded[l].encode(p));
                // What the host reads next, copied into the layer's staging buffer.
                let mut at = 0;
                for (src, first, words) in moe.sync_ranges(l, self.n) {
                    rec.enc().copy_buffer_to_buffer(src, first * 4, &moe.sync[l], at * 4, words * 4);
                    at += words;
                }
                rec.cut(Pause::Experts(layer));
                rec.pass("output and experts", |p| moe.experts[l].encode(p));
                rec.tag(StepStage::Output(layer));
                // The next layer's predicted experts are copied from here.
                rec.cut(Pause::Ahead(layer));
            }
            None => {
                rec.pass("output and experts", |p| moe.recorded[l].encode(p));
                rec.tag(StepStage::Output(layer));
            }
            Some(r) => {
                let (e, k) = (u64::from(moe.n_experts), u64::from(moe.top_k));
                let (li, nn) = (layer as u64, u64::from(self.n));
                rec.pass("output and experts", |p| r.before[l].encode(p));
                rec.enc().copy_buffer_to_buffer(&moe.scores, 0, &r.router.logits, li * nn * e * 4, nn * e * 4);
                rec.pass("output and experts", |p| r.router.encode(p, layer, self.n));
                rec.enc().copy_buffer_to_buffer(&r.router.experts, li * nn * k * 4, &moe.sel, 0, nn * k * 4);
                rec.pass("output and experts", |p| r.after[l].encode(p));
                rec.tag(StepStage::Output(layer));
            }
        }
        Ok(())
    }

    fn end(&self, rec: &mut Recorder<'_, Pause>) -> Result<()> {
        rec.pass("head", |p| self.rec.head.encode(p));
        Ok(())
    }
}
