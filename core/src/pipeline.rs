//! The decode pipeline as it stands: every step appends each sequence's new token at every
//! layer into its shard, rebuilds the page lists and runs decode attention per layer, all on the
//! GPU; the host reads back only the pool's counters and ring sizes for the report.

use serde::{Deserialize, Serialize};

use crate::attend::{AttendOptions, Attention};
use crate::config::{KvDtype, PoolConfig, ShardMap};
use crate::error::{Error, Result};
use crate::gpu_data::PoolCtl;
use crate::pool::KvPool;
use crate::reference::pool::{NewToken, PoolModel, encode_values};
use crate::reference::{attend_decode, pool::decode_words};
use crate::runtime::Runtime;
use crate::timer::GpuTimer;
use crate::workload::{GenToken, Workload, WorkloadConfig};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DemoConfig {
    pub workload: WorkloadConfig,
    pub steps: u32,
    pub page_size: u32,
    pub dtype: KvDtype,
    pub n_shards: u32,
    pub shard_map: ShardMap,
    /// Pages in the pool; `None`: enough for prompt + steps with headroom.
    pub pool_pages: Option<u32>,
    pub chunk_pages: u32,
    /// Keep a CPU reference of the pool in lockstep and check placement and attention.
    pub verify: bool,
}

impl Default for DemoConfig {
    fn default() -> Self {
        DemoConfig {
            workload: WorkloadConfig::default(),
            steps: 16,
            page_size: 16,
            dtype: KvDtype::F16,
            n_shards: 4,
            shard_map: ShardMap::Pikv { n_tok: 4, n_exp: 4 },
            pool_pages: None,
            chunk_pages: 8,
            verify: true,
        }
    }
}

impl DemoConfig {
    pub fn pool_config(&self) -> PoolConfig {
        let w = &self.workload;
        let tokens = w.prompt_len + self.steps;
        let pages_per_seq_layer = tokens.div_ceil(self.page_size) + self.n_shards;
        let ring = (tokens.div_ceil(self.page_size).div_ceil(self.n_shards) * 3 / 2 + 4).max(4);
        PoolConfig {
            layers: w.layers,
            kv_heads: w.kv_heads,
            head_dim: w.head_dim,
            page_size: self.page_size,
            dtype: self.dtype,
            n_pages: self
                .pool_pages
                .unwrap_or(w.n_seqs * w.layers * pages_per_seq_layer),
            max_seqs: w.n_seqs,
            n_shards: self.n_shards,
            ring_capacity: ring,
            top_k: w.top_k,
            shard_map: self.shard_map,
            max_buffer_bytes: None,
        }
    }
}

/// GPU time of each stage of one step (milliseconds).
#[derive(Clone, Debug, Default, Serialize)]
pub struct StageTimes {
    pub append_ms: f64,
    pub gather_ms: f64,
    pub attend_ms: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct StepReport {
    pub step: u32,
    /// Tokens cached per sequence and layer after the step.
    pub context: u32,
    pub gpu: Option<StageTimes>,
    pub host_ms: f64,
    /// Bytes of the pages in use (what the cache occupies).
    pub kv_bytes_resident: u64,
    /// Bytes of K/V actually stored in them (tokens x bytes per token).
    pub kv_bytes_tokens: u64,
    pub pages_in_use: u32,
    pub pages_total: u32,
    /// Pages held by each shard index, summed over layers and sequences.
    pub shard_pages: Vec<u32>,
    pub ring_overflows: u32,
}

/// What the CPU reference check found.
#[derive(Clone, Debug, Serialize)]
pub struct VerifyReport {
    pub tokens_checked: u64,
    pub placement_identical: bool,
    pub attention_max_abs_err: f64,
    pub attention_tolerance: f64,
}

pub struct Pipeline {
    pub cfg: DemoConfig,
    pub pool: KvPool,
    pub attn: Attention,
    pub workload: Workload,
    model: Option<PoolModel>,
    timer: Option<GpuTimer>,
    step: u32,
    last_queries: Vec<f32>,
}

fn kv_words(tokens: &[GenToken], dtype: KvDtype) -> Vec<u32> {
    let mut words = Vec::new();
    for t in tokens {
        encode_values(&t.k, dtype, &mut words);
        encode_values(&t.v, dtype, &mut words);
    }
    words
}

impl Pipeline {
    pub async fn new(rt: &Runtime, cfg: DemoConfig) -> Result<Pipeline> {
        let pool_cfg = cfg.pool_config();
        let workload = Workload::new(cfg.workload.clone())?;
        let pool = KvPool::new(rt, pool_cfg.clone()).await?;
        let attn = Attention::new(
            rt,
            &pool,
            AttendOptions {
                group: cfg.workload.group,
                n_seqs: cfg.workload.n_seqs,
                chunk_pages: cfg.chunk_pages,
                mass: true,
                variant: None,
                ..Default::default()
            },
        )
        .await?;
        // Some drivers compile on first dispatch: run the kernels once over the empty pool (no
        // page is touched) so that the first step's time is the step's.
        pool.gather(rt)?;
        attn.run(rt, 0, 0)?;
        rt.wait()?;
        let timer = GpuTimer::new(rt, 2 + cfg.workload.layers);
        let model = cfg.verify.then(|| PoolModel::new(&pool_cfg));
        Ok(Pipeline {
            cfg,
            pool,
            attn,
            workload,
            model,
            timer,
            step: 0,
            last_queries: Vec::new(),
        })
    }

    fn append(&mut self, rt: &Runtime, tokens: &[GenToken], timed: bool) -> Result<()> {
        let words = kv_words(tokens, self.pool.cfg.dtype);
        let new: Vec<NewToken> = tokens.iter().map(|t| t.token.clone()).collect();
        let ts = if timed {
            self.timer.as_ref().and_then(|t| t.pass(0))
        } else {
            None
        };
        self.pool.append_timed(rt, &new, &words, self.step, ts)?;
        if let Some(m) = &mut self.model {
            m.append(&new, &words, self.step)?;
        }
        Ok(())
    }

    /// Append the prompt of every sequence. `progress(done, total)` after each batch.
    pub async fn prefill(
        &mut self,
        rt: &Runtime,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<()> {
        let batches = self
            .workload
            .prompt_batches(self.pool.max_append_tokens(rt).min(4096));
        let total: u64 = batches.iter().map(|b| b.len() as u64).sum();
        let mut done = 0;
        for b in &batches {
            self.append(rt, b, false)?;
            done += b.len() as u64;
            progress(done, total);
        }
        rt.wait()?;
        self.pool.check_errors(rt, 0).await?;
        Ok(())
    }

    /// One decode step: append, gather, attend every layer.
    pub async fn step(&mut self, rt: &Runtime) -> Result<StepReport> {
        #[cfg(not(target_arch = "wasm32"))]
        let t0 = std::time::Instant::now();
        let tokens = self.workload.next_tokens();
        self.append(rt, &tokens, true)?;
        let layers = self.pool.cfg.layers;
        for layer in 0..layers {
            let q = self.workload.queries(layer);
            self.attn.set_queries(rt, &q)?;
            self.attn.prepare(rt, layer, self.step);
            let mut enc = rt
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("decode step"),
                });
            if layer == 0 {
                let ts = self.timer.as_ref().and_then(|t| t.pass(1));
                self.pool.encode_gather(rt, &mut enc, 0, layers, ts);
            }
            {
                let ts = self.timer.as_ref().and_then(|t| t.pass(2 + layer));
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("attend"),
                    timestamp_writes: ts,
                });
                self.attn.encode(&mut pass);
            }
            if layer + 1 == layers
                && let Some(t) = &self.timer
            {
                t.resolve(&mut enc, 2 + layers);
            }
            rt.queue.submit([enc.finish()]);
            if layer + 1 == layers {
                self.last_queries = q;
            }
        }
        rt.wait()?;
        let ctl = self
            .pool
            .check_errors(rt, (self.cfg.workload.n_seqs * layers).div_ceil(1))
            .await?;
        let gpu = match &self.timer {
            Some(t) => {
                let ms = t.read_ms(rt, 2 + layers).await?;
                Some(StageTimes {
                    append_ms: ms[0],
                    gather_ms: ms[1],
                    attend_ms: ms[2..].iter().sum(),
                })
            }
            None => None,
        };
        #[cfg(not(target_arch = "wasm32"))]
        let host_ms = t0.elapsed().as_secs_f64() * 1e3;
        #[cfg(target_arch = "wasm32")]
        let host_ms = f64::NAN;
        let report = self.report(rt, ctl, gpu, host_ms).await?;
        self.step += 1;
        Ok(report)
    }

    async fn report(
        &self,
        rt: &Runtime,
        ctl: PoolCtl,
        gpu: Option<StageTimes>,
        host_ms: f64,
    ) -> Result<StepReport> {
        let cfg = &self.pool.cfg;
        let rings: Vec<crate::gpu_data::RingState> = rt.read_all(&self.pool.rings).await?;
        let mut shard_pages = vec![0u32; cfg.n_shards as usize];
        for (key, r) in rings.iter().enumerate() {
            shard_pages[key % cfg.n_shards as usize] += r.count;
        }
        let pages_in_use = cfg.n_pages - ctl.free_top;
        let context = self.workload.position(0);
        let tokens = u64::from(context) * u64::from(cfg.max_seqs) * u64::from(cfg.layers);
        Ok(StepReport {
            step: self.step,
            context,
            gpu,
            host_ms,
            kv_bytes_resident: u64::from(pages_in_use) * cfg.page_bytes(),
            kv_bytes_tokens: tokens * cfg.token_kv_bytes(),
            pages_in_use,
            pages_total: cfg.n_pages,
            shard_pages,
            ring_overflows: ctl.ring_overflows,
        })
    }

    /// Compare the GPU pool with the CPU reference (exactly) and the last layer's attention with
    /// the f64 reference (within the storage precision's tolerance).
    pub async fn verify(&self, rt: &Runtime) -> Result<Option<VerifyReport>> {
        let Some(model) = &self.model else {
            return Ok(None);
        };
        let snap = self.pool.snapshot(rt).await?;
        let kv = self.pool.read_kv(rt).await?;
        let placement_identical = snap.rings == model.rings
            && snap.ring_pages == model.ring_pages
            && snap.page_meta == model.page_meta
            && snap.free_stack == model.free_stack
            && snap.ctl.free_top == model.ctl.free_top
            && kv == model.kv;
        let layer = self.pool.cfg.layers - 1;
        let out = self.attn.read_output(rt).await?;
        let reference = attend_decode(
            model,
            layer,
            self.cfg.workload.n_seqs,
            &self.last_queries,
            self.cfg.workload.group,
            f64::from(self.attn.scale()),
        );
        let max_abs = out
            .iter()
            .zip(&reference.out)
            .map(|(a, b)| (f64::from(*a) - b).abs())
            .fold(0.0, f64::max);
        let tol = match self.pool.cfg.dtype {
            KvDtype::F32 => 1e-4,
            KvDtype::F16 => 2e-3,
        };
        let _ = decode_words;
        let tokens_checked = (0..self.cfg.workload.n_seqs)
            .map(|s| model.tokens(layer, s).len() as u64)
            .sum();
        if !placement_identical {
            return Err(Error::Gpu {
                during: "verification".into(),
                message: "GPU pool state differs from the CPU reference".into(),
            });
        }
        Ok(Some(VerifyReport {
            tokens_checked,
            placement_identical,
            attention_max_abs_err: max_abs,
            attention_tolerance: tol,
        }))
    }
}
