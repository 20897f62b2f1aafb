//! A sequence's K/V by position, out of the pool and back in: what a page store keeps of a
//! prompt's prefix ([`GpuLlama::read_prefix`]) and how another process's model takes it up
//! instead of prefilling those tokens ([`GpuLlama::restore_prefix`]).
//!
//! The words are the append's own format: per token, K then V of every KV head in the pool's
//! storage words. Reading copies the pages that hold the positions (found in the pool's ring
//! tables and slot metadata) into one staging buffer per layer and reads it once; restoring
//! appends the tokens through the pool's append passes, so they land where a prefill would
//! put them.

use super::GpuLlama;
use crate::{Error, Result};
use expertkv_core::append::PoolSnapshot;
use expertkv_core::append::format::NewToken;
use expertkv_core::gpu_data::meta;
use expertkv_core::runtime::Runtime;

impl GpuLlama {
    /// Why a stored prefix cannot be taken up here: the same conditions as chunked prefill
    /// (raw pages, no policy acting between tokens, no route stage, no expert cache), since a
    /// restored prefix must stand where this model's own prefill would have put it, bit for bit
    /// (a model that must feed its prompt token by token computes its K/V in another order).
    /// `None` when it can. [`GpuLlama::read_prefix`] and [`GpuLlama::restore_prefix`]
    /// themselves ask less ([`GpuLlama::kv_order_refusal`]: a model's own K/V, carried across
    /// [`GpuLlama::reconfigure_live`], needs no prefill to match).
    pub fn prefix_refusal(&self) -> Option<&'static str> {
        self.chunked_prefill_refusal()
    }

    /// Words per token of one layer in [`GpuLlama::read_prefix`]'s format: K then V of every KV
    /// head.
    pub fn prefix_token_words(&self) -> usize {
        (2 * self.kv.pool.cfg.kv_heads * self.kv.pool.cfg.vec_words()) as usize
    }

    /// The K/V of positions `0..n` of sequence `seq`, per layer: `[layer][position][K heads,
    /// V heads][storage words]`. Every position must be in the pool (a prefilled prompt's are).
    pub async fn read_prefix(&self, rt: &Runtime, seq: u32, n: u32) -> Result<Vec<Vec<u32>>> {
        let mut out = self.read_prefixes(rt, &[(seq, n)]).await?;
        Ok(out.pop().unwrap_or_default())
    }

    /// [`GpuLlama::read_prefix`] of several `(sequence, positions)` at once, from one snapshot
    /// of the pool's tables; every request is checked before anything is read.
    pub(super) async fn read_prefixes(&self, rt: &Runtime, wanted: &[(u32, u32)]) -> Result<Vec<Vec<Vec<u32>>>> {
        if let Some(why) = self.kv_order_refusal() {
            return Err(Error::Input(format!("reading a prefix: {why}")));
        }
        for &(seq, n) in wanted {
            if seq >= self.n_seqs || n > self.positions[seq as usize] {
                return Err(Error::Input(format!(
                    "reading {n} positions of sequence {seq}: it holds {} (of {} sequences)",
                    self.positions.get(seq as usize).copied().unwrap_or(0),
                    self.n_seqs
                )));
            }
        }
        let snap = self.kv.pool.snapshot(rt).await?;
        let mut out = Vec::with_capacity(wanted.len());
        for &(seq, n) in wanted {
            out.push(self.prefix_words(rt, &snap, seq, n).await?);
        }
        Ok(out)
    }

    /// One sequence's positions `0..n`, found in `snap` (the pool's tables now), per layer.
    async fn prefix_words(&self, rt: &Runtime, snap: &PoolSnapshot, seq: u32, n: u32) -> Result<Vec<Vec<u32>>> {
        let c = &self.kv.pool.cfg;
        let (r, ns, mw, vw) = (c.ring_capacity as usize, c.n_shards as usize, c.meta_words() as usize, c.vec_words() as usize);
        let (pw, ppb) = (u64::from(c.page_words()), self.kv.pool.geo.pages_per_buffer);
        let hkv = c.kv_heads as usize;
        let tw = 2 * hkv * vw;
        let mut out = Vec::with_capacity(c.layers as usize);
        for layer in 0..c.layers {
            // (page, slot) of every position of every KV head.
            let mut at = vec![(u32::MAX, 0u32); n as usize * hkv];
            for h in 0..hkv {
                let list = ((layer * c.max_seqs + seq) * c.kv_heads) as usize + h;
                for s in 0..ns {
                    let key = list * ns + s;
                    let ring = snap.rings[key];
                    for k in 0..ring.count as usize {
                        let page = snap.ring_pages[key * r + (ring.head as usize + k) % r];
                        let fill = snap.page_meta[page as usize].fill;
                        for slot in 0..fill {
                            let pos = snap.slot_meta[(page * c.page_size + slot) as usize * mw + meta::POSITION];
                            if pos < n {
                                at[pos as usize * hkv + h] = (page, slot);
                            }
                        }
                    }
                }
            }
            if let Some(i) = at.iter().position(|a| a.0 == u32::MAX) {
                return Err(Error::Input(format!(
                    "reading a prefix: position {} of layer {layer}, KV head {} is not in the pool",
                    i / hkv,
                    i % hkv
                )));
            }
            // The pages, copied into one staging buffer in order of first use.
            let mut pages: Vec<u32> = at.iter().map(|a| a.0).collect();
            pages.sort_unstable();
            pages.dedup();
            let staging = rt.storage("prefix staging", pages.len() as u64 * pw * 4);
            let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("prefix read") });
            for (i, &p) in pages.iter().enumerate() {
                let b = (p / ppb) as usize;
                enc.copy_buffer_to_buffer(&self.kv.pool.kv_buffers[b], u64::from(p % ppb) * pw * 4, &staging, i as u64 * pw * 4, pw * 4);
            }
            rt.queue.submit([enc.finish()]);
            let words: Vec<u32> = rt.read(&staging, 0, pages.len() as u64 * pw).await?;
            let block = c.page_size as usize * vw;
            let mut layer_words = vec![0u32; n as usize * tw];
            for pos in 0..n as usize {
                for h in 0..hkv {
                    let (page, slot) = at[pos * hkv + h];
                    let i = pages.binary_search(&page).map_err(|_| Error::Input("prefix page lost".into()))?;
                    for kv in 0..2 {
                        let src = i * pw as usize + kv * block + slot as usize * vw;
                        let dst = pos * tw + (kv * hkv + h) * vw;
                        layer_words[dst..dst + vw].copy_from_slice(&words[src..src + vw]);
                    }
                }
            }
            out.push(layer_words);
        }
        Ok(out)
    }

    /// Put the K/V of positions `0..n` (per layer, [`GpuLlama::read_prefix`]'s format) into
    /// sequence `seq`, which must be empty, and advance its position to `n`: the pool then
    /// holds what prefilling those tokens would have left, and decoding or a prefill goes on
    /// from position `n`. Refused, with nothing changed, on a shape that is not this model's.
    pub async fn restore_prefix(&mut self, rt: &Runtime, seq: u32, n: u32, kv: &[Vec<u32>]) -> Result<()> {
        if let Some(why) = self.kv_order_refusal() {
            return Err(Error::Input(format!("restoring a prefix: {why}")));
        }
        if seq >= self.n_seqs || self.positions[seq as usize] != 0 {
            return Err(Error::Input(format!("restoring a prefix into sequence {seq}: it must exist and be empty")));
        }
        // The restored pages are not a step's appends: the next checked step starts afresh.
        self.carried_pool = None;
        let tw = self.prefix_token_words();
        if kv.len() != self.cfg.block_count as usize || kv.iter().any(|l| l.len() != n as usize * tw) {
            return Err(Error::Input(format!(
                "restoring a prefix of {n} tokens: {} layers of {} words each expected",
                self.cfg.block_count,
                n as usize * tw
            )));
        }
        if n == 0 {
            return Ok(());
        }
        if n >= self.max_context {
            return Err(Error::Input(format!("a prefix of {n} tokens leaves no room in a context of {}", self.max_context)));
        }
        let k = self.kv.pool.cfg.top_k as usize;
        let batch = self.kv.pool.max_append_tokens(rt).clamp(1, 4096) as usize;
        // Token records ordered [layer][position], appended a batch at a time.
        let all: Vec<(u32, u32)> = (0..self.cfg.block_count).flat_map(|l| (0..n).map(move |p| (l, p))).collect();
        let appended = self.append_prefix(rt, seq, n, kv, &all, batch, k).await;
        if let Err(e) = appended {
            // Nothing of a refused prefix stays: the pool's error flags are read (and cleared),
            // the sequence's pages go back, and the append's error is the one returned.
            let _ = self.kv.pool.check_errors(rt, n * self.cfg.block_count).await;
            let _ = self.kv.pool.release_sequence(rt, seq);
            return Err(e);
        }
        self.positions[seq as usize] = n;
        self.step += 1;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    async fn append_prefix(
        &mut self,
        rt: &Runtime,
        seq: u32,
        n: u32,
        kv: &[Vec<u32>],
        all: &[(u32, u32)],
        batch: usize,
        k: usize,
    ) -> Result<()> {
        let tw = self.prefix_token_words();
        for part in all.chunks(batch) {
            let tokens: Vec<NewToken> = part
                .iter()
                .map(|&(layer, position)| NewToken { layer, seq, position, experts: (0..k as u32).collect(), gates: vec![1.0; k] })
                .collect();
            let mut words = Vec::with_capacity(part.len() * tw);
            for &(l, p) in part {
                words.extend_from_slice(&kv[l as usize][p as usize * tw..(p as usize + 1) * tw]);
            }
            self.kv.pool.append(rt, &tokens, &words, self.step)?;
        }
        self.kv.pool.check_errors(rt, n * self.cfg.block_count).await?;
        Ok(())
    }
}
