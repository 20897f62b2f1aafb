//! The shape of the passes that plan jobs over the pool's pages and run one kernel over them
//! (compression and thaw). Its own module below both the pool ([`crate::append`], whose codec
//! state holds one) and the codecs that build them ([`crate::compress`], which extends the
//! pool): the pool must not depend on its codecs back.

use expertkv_shaders::Kernel;

use crate::error::{Error, Result};
use crate::runtime::Runtime;
use crate::runtime::dispatch::CountedDispatch;

/// The shape the compress and thaw passes share: a plan of three passes (count per ring, one
/// main workgroup, assign per ring) that writes the job list and an indirect dispatch, then one
/// kernel over the jobs, dispatched indirectly once per raw pool buffer.
pub(crate) struct PagePasses {
    plan: [(wgpu::ComputePipeline, wgpu::BindGroup); 3],
    per_buffer: (wgpu::ComputePipeline, Vec<wgpu::BindGroup>),
    /// The indirect arguments the plan's main pass writes.
    dispatch: wgpu::Buffer,
    /// Rings (shard keys): the count and assign passes run a workgroup per ring.
    n_keys: u32,
}

impl PagePasses {
    /// The plan's three kernels with their bindings (the main pass writing `dispatch`), and the
    /// per-buffer kernel bound, for each raw pool buffer, to `per_buffer_bindings` in binding
    /// order.
    pub(crate) async fn new<'a>(
        rt: &Runtime,
        plan: [(Kernel, Vec<(u32, &wgpu::Buffer)>); 3],
        per_buffer: Kernel,
        per_buffer_bindings: impl Iterator<Item = Vec<&'a wgpu::Buffer>>,
        dispatch: wgpu::Buffer,
        n_keys: u32,
    ) -> Result<PagePasses> {
        let mut passes = Vec::with_capacity(3);
        for (k, used) in plan {
            let p = rt.pipeline(k, &[]).await?;
            let bg = rt.bind_at(k.label(), &p, &used);
            passes.push((p, bg));
        }
        let plan = passes.try_into().map_err(|_| Error::Input(format!("{} plan passes", per_buffer.label())))?;
        let p = rt.pipeline(per_buffer, &[]).await?;
        let bgs = per_buffer_bindings.map(|b| rt.bind(per_buffer.label(), &p, &b)).collect();
        Ok(PagePasses { plan, per_buffer: (p, bgs), dispatch, n_keys })
    }

    /// Plan (count, main, assign), then the per-buffer kernel over the planned jobs.
    pub(crate) fn encode(&self, pass: &mut wgpu::ComputePass<'_>) {
        let rings = crate::runtime::split_workgroups(self.n_keys);
        for ((p, bg), [x, y]) in self.plan.iter().zip([rings, [1, 1], rings]) {
            pass.set_pipeline(p);
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_counted(x, y, 1);
        }
        pass.set_pipeline(&self.per_buffer.0);
        for bg in &self.per_buffer.1 {
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_indirect_counted(&self.dispatch, 0);
        }
    }
}
