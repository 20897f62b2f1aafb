//! QUEST on the GPU: per-page key bounds, and per query the pages whose bound on q.k is highest;
//! attention then reads only those pages. Pages are selected, never evicted: the cache stays
//! whole, the bytes read per step shrink.

use expertkv_shaders::Kernel;

use crate::append::KvPool;
use crate::attend::Attention;
use crate::error::{Error, Result};
use crate::gpu_data::QuestParams;
use crate::runtime::Runtime;
use crate::runtime::dispatch::CountedDispatch;

/// QUEST over one pool: per-page key bounds and, per layer, the selected page lists that
/// attention reads ([`Attention::with_lists`]).
pub struct Quest {
    /// Pages kept per (layer, sequence, KV head) list.
    pub keep_pages: u32,
    /// Per raw page, f32 `[min d | max d]`: each key dimension's smallest and largest value over
    /// the page's slots.
    pub bounds: wgpu::Buffer,
    /// Selected page ids per (layer, seq, KV head), in the pool's page-list layout
    /// (`max_pages_per_seq` entries each), in list order.
    pub sel_list: wgpu::Buffer,
    /// Selected pages per (layer, seq, KV head) (u32).
    pub sel_counts: wgpu::Buffer,
    params: Vec<wgpu::Buffer>,
    summarize: (wgpu::ComputePipeline, Vec<(wgpu::BindGroup, u32)>),
    select: (wgpu::ComputePipeline, Vec<Option<wgpu::BindGroup>>),
    _buffers: Vec<wgpu::Buffer>,
    lists_per_layer: u32,
}

impl Quest {
    /// Bytes [`Quest::new`] allocates for a pool of configuration `c`: page bounds and tags,
    /// the selected page lists and counts, the page keys (its small uniforms aside). Equal to
    /// [`Quest::bytes_allocated`] once allocated.
    pub fn bytes(c: &crate::config::PoolConfig) -> u64 {
        let list_len = u64::from(c.n_lists()) * u64::from(c.max_pages_per_seq());
        [
            u64::from(c.n_pages) * 2 * u64::from(c.head_dim) * 4,
            u64::from(c.n_pages) * 16,
            list_len * 4,
            u64::from(c.n_lists()) * 4,
            list_len * 4,
        ]
        .into_iter()
        .map(crate::runtime::storage_size)
        .sum()
    }

    /// Bytes its buffers hold (see [`Quest::bytes`]).
    pub fn bytes_allocated(&self) -> u64 {
        self.bounds.size() + self.sel_list.size() + self.sel_counts.size() + self._buffers.iter().map(wgpu::Buffer::size).sum::<u64>()
    }

    /// `budget`: tokens attended per list (rounded up to whole pages).
    pub async fn new(rt: &Runtime, pool: &KvPool, budget: u32) -> Result<Quest> {
        let c = &pool.cfg;
        if budget < c.page_size {
            return Err(Error::config("budget", budget, format!("QUEST needs at least one page ({} tokens)", c.page_size)));
        }
        let d = u64::from(c.head_dim);
        let bounds = rt.storage("quest bounds", u64::from(c.n_pages) * 2 * d * 4);
        rt.fits_binding("QUEST page bounds", bounds.size())?;
        let tags = rt.storage("quest tags", u64::from(c.n_pages) * 16);
        let list_len = u64::from(c.n_lists()) * u64::from(c.max_pages_per_seq());
        let sel_list = rt.storage("quest selected pages", list_len * 4);
        let sel_counts = rt.storage("quest selected counts", u64::from(c.n_lists()) * 4);
        let page_key = rt.storage("quest page keys", list_len * 4);
        let sp = rt.pipeline(Kernel::EvictQuestSummarize, &[]).await?;
        let summarize = pool
            .kv_buffers
            .iter()
            .zip(&pool.window_bufs)
            .zip(&pool.windows)
            .map(|((kv, w), win)| {
                (
                    rt.bind(
                        Kernel::EvictQuestSummarize.label(),
                        &sp,
                        &[&pool.geometry, w, &pool.page_meta, &pool.page_gen, kv, &bounds, &tags],
                    ),
                    win.page_count,
                )
            })
            .collect();
        let sel = rt.pipeline(Kernel::EvictQuestSelect, &[]).await?;
        let params = (0..c.layers).map(|l| rt.uniform(&format!("quest params[{l}]"), &QuestParams::default())).collect();
        rt.check("quest setup")?;
        Ok(Quest {
            keep_pages: budget.div_ceil(c.page_size),
            bounds,
            sel_list,
            sel_counts,
            params,
            summarize: (sp, summarize),
            select: (sel, (0..c.layers).map(|_| None).collect()),
            _buffers: vec![tags, page_key],
            lists_per_layer: c.max_seqs * c.kv_heads,
        })
    }

    /// Bind the attention whose queries select pages (its query buffer is read).
    pub fn bind(&mut self, rt: &Runtime, pool: &KvPool, attn: &Attention) {
        let page_key = &self._buffers[1];
        for (l, slot) in self.select.1.iter_mut().enumerate() {
            *slot = Some(rt.bind(
                Kernel::EvictQuestSelect.label(),
                &self.select.0,
                &[
                    &pool.geometry,
                    &self.params[l],
                    &pool.page_list,
                    &pool.page_counts,
                    &self.bounds,
                    &attn.queries,
                    &self.sel_list,
                    &self.sel_counts,
                    page_key,
                ],
            ));
        }
    }

    /// Stage the selection parameters of `layer`.
    pub fn prepare(&self, rt: &Runtime, layer: u32, attn: &Attention) {
        let p = QuestParams {
            layer,
            keep_pages: self.keep_pages,
            group: attn.opts.group,
            q_heads: attn.q_heads(),
            n_seqs: attn.opts.n_seqs,
            scale: attn.scale(),
            ..Default::default()
        };
        rt.queue.write_buffer(&self.params[layer as usize], 0, bytemuck::bytes_of(&p));
    }

    /// Each list slot's selection key (complemented orderable bound) from the last selection.
    pub fn page_keys(&self) -> &wgpu::Buffer {
        &self._buffers[1]
    }

    /// Refresh the bounds of pages that changed (every layer's).
    pub fn encode_summarize(&self, pass: &mut wgpu::ComputePass<'_>) {
        pass.set_pipeline(&self.summarize.0);
        for (bg, pages) in &self.summarize.1 {
            pass.set_bind_group(0, bg, &[]);
            let [x, y] = crate::runtime::split_workgroups(*pages);
            pass.dispatch_counted(x, y, 1);
        }
    }

    /// Select the pages of `layer` for the queries in the bound attention's buffer.
    pub fn encode_select(&self, pass: &mut wgpu::ComputePass<'_>, layer: u32) -> Result<()> {
        let Some(bg) = &self.select.1[layer as usize] else {
            return Err(Error::Input("QUEST has no attention bound: call bind first".into()));
        };
        pass.set_pipeline(&self.select.0);
        pass.set_bind_group(0, bg, &[]);
        pass.dispatch_counted(self.lists_per_layer, 1, 1);
        Ok(())
    }
}
