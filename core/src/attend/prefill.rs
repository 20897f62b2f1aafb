//! Prefill attention: a chunk of one sequence's queries (a prompt fed many tokens per forward
//! pass) over that sequence's pages, after the chunk's own K/V were appended, causally masked by
//! each slot's position (`attend/prefill.wgsl`), then merged by the decode reduce pass
//! (`attend/reduce.wgsl`, with the chunk's queries in place of sequences). Raw pages only (f16 or
//! f32); a pool with a page codec is refused by name (the model then prefills token by token).

use expertkv_shaders::Kernel;

use crate::append::KvPool;
use crate::error::{Error, Result};
use crate::gpu_data::{AttendParams, PrefillParams};
use crate::runtime::dispatch::CountedDispatch;
use crate::runtime::{Runtime, RuntimeId};

use super::MAX_GROUP;

/// Pages per split workgroup the model uses ([`PrefillAttention::new`]'s `chunk_pages`), as the
/// decode split's default: the partials (a chunk's queries x query heads x context chunks) of a
/// prefill chunk of 256 tokens take what a chunk of 64 took at 8 pages, and the chunk's queries
/// fill the GPU without more context chunks.
pub const PREFILL_CHUNK_PAGES: u32 = 32;

/// One layer's uniforms and bind groups.
struct Layer {
    params: wgpu::Buffer,
    prefill: wgpu::Buffer,
    split: Vec<wgpu::BindGroup>,
    reduce: wgpu::BindGroup,
}

/// Causal attention of up to `max_queries` queries of one sequence per layer (see the module
/// docs).
pub struct PrefillAttention {
    split: wgpu::ComputePipeline,
    reduce: wgpu::ComputePipeline,
    layers: Vec<Layer>,
    /// The chunk's queries, `[query][q_heads][head_dim]` f32: written by the caller (the model's
    /// Q projection and RoPE) before [`PrefillAttention::encode`].
    pub queries: wgpu::Buffer,
    out: wgpu::Buffer,
    max_queries: u32,
    group: u32,
    q_heads: u32,
    kv_heads: u32,
    n_chunks: u32,
    chunk_pages: u32,
    n_buffers: u32,
    scale: f32,
    staged: u32,
    owner: RuntimeId,
}

impl PrefillAttention {
    /// Bytes of the partials [`PrefillAttention::new`] allocates (and refuses past one binding):
    /// queries x query heads x pool buffers x page chunks x (head_dim + 4) floats.
    pub fn partial_bytes(pool: &KvPool, group: u32, max_queries: u32, chunk_pages: u32) -> u64 {
        let cfg = &pool.cfg;
        [max_queries, cfg.kv_heads * group, pool.n_buffers() as u32, cfg.max_pages_per_seq().div_ceil(chunk_pages), cfg.head_dim + 4, 4]
            .into_iter()
            .map(u64::from)
            .product()
    }

    /// For `pool`'s layers, `group` query heads per KV head, chunks of up to `max_queries`
    /// queries, and `chunk_pages` pages per split workgroup (1 to
    /// [`super::MAX_CHUNK_PAGES`]; [`PREFILL_CHUNK_PAGES`] for the model).
    pub async fn new(rt: &Runtime, pool: &KvPool, group: u32, max_queries: u32, chunk_pages: u32) -> Result<PrefillAttention> {
        rt.check_owner(pool.owner(), "the pool")?;
        let cfg = &pool.cfg;
        if cfg.codec != crate::config::Codec::None {
            return Err(Error::config("codec", cfg.codec.name(), "prefill attention reads raw pages only; prefill token by token"));
        }
        if group == 0 || group > MAX_GROUP {
            return Err(Error::config("group", group, format!("query heads per KV head must be in 1..={MAX_GROUP}")));
        }
        if max_queries == 0 || max_queries > 65_535 {
            return Err(Error::config("max_queries", max_queries, "must be in 1..=65535"));
        }
        super::check_chunk_pages(chunk_pages)?;
        let (d, q_heads) = (cfg.head_dim, cfg.kv_heads * group);
        let n_chunks = cfg.max_pages_per_seq().div_ceil(chunk_pages);
        let n_buffers = pool.n_buffers() as u32;
        let (nq, qh) = (u64::from(max_queries), u64::from(q_heads));
        let partial_floats = Self::partial_bytes(pool, group, max_queries, chunk_pages) / 4;
        rt.fits_binding("prefill attention partials", partial_floats * 4)?;
        let split = rt.pipeline(Kernel::AttendPrefill, &[]).await?;
        let reduce = rt.pipeline(Kernel::AttendReduce, &[]).await?;
        let queries = rt.storage("prefill queries", nq * qh * u64::from(d) * 4);
        let partials = rt.storage("prefill partials", partial_floats * 4);
        let out = rt.storage("prefill out", nq * qh * u64::from(d) * 4);
        let stats = rt.storage("prefill stats", nq * qh * 8);
        let dims = rt.uniform("prefill dims", &[d, 0u32, 0, 0]);
        let layers = (0..cfg.layers)
            .map(|_| {
                let params = rt.uniform("prefill params", &AttendParams::default());
                let prefill = rt.uniform("prefill chunk", &PrefillParams::default());
                let split_bgs = pool
                    .kv_buffers
                    .iter()
                    .zip(&pool.window_bufs)
                    .map(|(kv, w)| {
                        rt.bind(
                            Kernel::AttendPrefill.label(),
                            &split,
                            &[
                                &pool.geometry,
                                &params,
                                w,
                                &pool.page_list,
                                &pool.page_counts,
                                &pool.page_meta,
                                kv,
                                &queries,
                                &partials,
                                &pool.slot_meta,
                                &prefill,
                            ],
                        )
                    })
                    .collect();
                let reduce_bg = rt.bind(Kernel::AttendReduce.label(), &reduce, &[&params, &dims, &partials, &out, &stats]);
                Layer { params, prefill, split: split_bgs, reduce: reduce_bg }
            })
            .collect();
        Ok(PrefillAttention {
            split,
            reduce,
            layers,
            queries,
            out,
            max_queries,
            group,
            q_heads,
            kv_heads: cfg.kv_heads,
            n_chunks,
            chunk_pages,
            n_buffers,
            scale: 1.0 / (d as f32).sqrt(),
            staged: 0,
            owner: pool.owner(),
        })
    }

    /// Set every layer up for `n_queries` queries of sequence `seq` at positions
    /// `first_position..` (written through the queue: one staging per submission).
    pub fn stage(&mut self, rt: &Runtime, seq: u32, first_position: u32, n_queries: u32) -> Result<()> {
        rt.check_owner(self.owner, "this prefill attention")?;
        if n_queries == 0 || n_queries > self.max_queries {
            return Err(Error::Input(format!("prefill attention: {n_queries} queries, at most {}", self.max_queries)));
        }
        for (l, layer) in self.layers.iter().enumerate() {
            let p = AttendParams {
                n_seqs: n_queries,
                layer: l as u32,
                group: self.group,
                q_heads: self.q_heads,
                n_chunks: self.n_chunks,
                chunk_pages: self.chunk_pages,
                n_buffers: self.n_buffers,
                write_scores: 0,
                max_tokens: 1,
                step: 0,
                scale: self.scale,
                _pad0: 0,
            };
            rt.queue.write_buffer(&layer.params, 0, bytemuck::bytes_of(&p));
            let c = PrefillParams { seq, first_position, _pad0: 0, _pad1: 0 };
            rt.queue.write_buffer(&layer.prefill, 0, bytemuck::bytes_of(&c));
        }
        self.staged = n_queries;
        Ok(())
    }

    /// Encode `layer`'s attention for the staged chunk: the split pass once per pool buffer, then
    /// the reduce; the output lands in [`PrefillAttention::output`]. The layer's pages (the
    /// chunk's K/V appended) and page lists must be current.
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>, layer: u32) -> Result<()> {
        let Some(l) = self.layers.get(layer as usize) else {
            return Err(Error::Input(format!("prefill attention: layer {layer} of {}", self.layers.len())));
        };
        if self.staged == 0 {
            return Err(Error::Input("prefill attention: nothing staged (call stage first)".into()));
        }
        pass.set_pipeline(&self.split);
        for bg in &l.split {
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_counted(self.n_chunks, self.kv_heads, self.staged);
        }
        pass.set_pipeline(&self.reduce);
        pass.set_bind_group(0, &l.reduce, &[]);
        pass.dispatch_counted(self.q_heads, self.staged, 1);
        Ok(())
    }

    /// The attention output, `[query][q_heads][head_dim]` f32.
    pub fn output(&self) -> &wgpu::Buffer {
        &self.out
    }

    /// Queries per chunk at most.
    pub fn max_queries(&self) -> u32 {
        self.max_queries
    }
}
