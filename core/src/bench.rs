//! Kernel benchmarks: time with GPU timestamps (host clock where the device has none), report
//! achieved bandwidth next to a copy roofline measured on the same device in the same run.

use expertkv_shaders::Kernel;
use serde::Serialize;

use crate::append::KvPool;
use crate::append::format::{NewToken, encode_values};
use crate::attend::{AttendOptions, Attention};
use crate::config::{Codec, KvDtype, PoolConfig, ShardMap};
use crate::error::{Error, Result};
use crate::gpu_data::CopyParams;
use crate::rng::Rng;
use crate::runtime::Runtime;
use crate::runtime::dispatch::CountedDispatch;
use crate::runtime::timer::{GpuTimer, median};

/// Times of one benchmarked pass over repeated runs, in milliseconds.
#[derive(Clone, Debug, Serialize)]
pub struct Measurement {
    /// Median time of one run, in milliseconds.
    pub median_ms: f64,
    /// Fastest run, in milliseconds.
    pub min_ms: f64,
    /// Timed runs the median and minimum are taken over.
    pub samples: usize,
    /// "gpu-timestamps" or "host-clock".
    pub timing: &'static str,
}

/// Run `encode` (one compute pass's work) `reps` times after `warmup` runs, and time each run.
pub async fn time_passes(rt: &Runtime, warmup: u32, reps: u32, encode: &dyn Fn(&mut wgpu::ComputePass<'_>)) -> Result<Measurement> {
    let run = |timer: Option<&GpuTimer>, n: u32| {
        let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("bench") });
        for i in 0..n {
            let mut pass = enc
                .begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("bench"), timestamp_writes: timer.and_then(|t| t.pass(i)) });
            encode(&mut pass);
        }
        if let Some(t) = timer {
            t.resolve(&mut enc, n);
        }
        rt.queue.submit([enc.finish()]);
    };
    run(None, warmup);
    rt.wait()?;
    if let Some(timer) = GpuTimer::new(rt, reps) {
        run(Some(&timer), reps);
        let ms = timer.read_ms(rt, reps).await?;
        let min = ms.iter().cloned().fold(f64::INFINITY, f64::min);
        return Ok(Measurement { median_ms: median(&ms), min_ms: min, samples: ms.len(), timing: "gpu-timestamps" });
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let mut ms = Vec::with_capacity(reps as usize);
        for _ in 0..reps {
            let t0 = std::time::Instant::now();
            run(None, 1);
            rt.wait()?;
            ms.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        let min = ms.iter().cloned().fold(f64::INFINITY, f64::min);
        Ok(Measurement { median_ms: median(&ms), min_ms: min, samples: ms.len(), timing: "host-clock" })
    }
    #[cfg(target_arch = "wasm32")]
    Err(Error::Gpu { during: "benchmark".into(), message: "no timestamp queries on this device".into() })
}

/// The copy roofline: `bytes` copied from one buffer to another (read + write = 2 x bytes).
pub struct CopyKernel {
    pipeline: wgpu::ComputePipeline,
    bind: wgpu::BindGroup,
    groups: u32,
    /// Bytes copied per run: the size asked for, capped at the adapter's largest storage binding
    /// and rounded down to a multiple of 16.
    pub bytes: u64,
    _src: wgpu::Buffer,
    /// Destination buffer, `bytes` long.
    pub dst: wgpu::Buffer,
}

impl CopyKernel {
    /// Build the copy of `bytes` (capped and rounded as [`CopyKernel::bytes`] says), its source filled
    /// with random words from `seed`; fails below 16 bytes.
    pub async fn new(rt: &Runtime, bytes: u64, seed: u64) -> Result<CopyKernel> {
        let bytes = bytes.min(rt.max_binding_bytes()) / 16 * 16;
        if bytes == 0 {
            return Err(Error::Input("copy size must be at least 16 bytes".into()));
        }
        let n_vec4 = bytes / 16;
        if n_vec4 > u64::from(u32::MAX) {
            return Err(Error::Input("copy size overflows u32 indexing".into()));
        }
        let pipeline = rt.pipeline(Kernel::BenchCopy, &[]).await?;
        let src = rt.storage("bench/copy src", bytes);
        // Random, not zeros: some devices compress or skip zero pages.
        let mut rng = Rng::new(seed);
        let chunk: Vec<u32> = (0..(1 << 18)).map(|_| rng.next_u32()).collect();
        let mut off = 0u64;
        while off < bytes {
            let len = (bytes - off).min(chunk.len() as u64 * 4);
            rt.queue.write_buffer(&src, off, bytemuck::cast_slice(&chunk[..(len / 4) as usize]));
            off += len;
        }
        let dst = rt.storage("bench/copy dst", bytes);
        let groups = (n_vec4.div_ceil(256)).min(65_535) as u32;
        let params = rt.uniform("bench/copy params", &CopyParams { n_vec4: n_vec4 as u32, stride: groups * 256, ..Default::default() });
        let bind = rt.bind(Kernel::BenchCopy.label(), &pipeline, &[&params, &src, &dst]);
        Ok(CopyKernel { pipeline, bind, groups, bytes, _src: src, dst })
    }

    /// Source buffer, `bytes` of random words.
    pub fn src(&self) -> &wgpu::Buffer {
        &self._src
    }

    /// Record one run, a single dispatch, into `pass`.
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.bind, &[]);
        pass.dispatch_counted(self.groups, 1, 1);
    }

    /// Bytes moved per run (read + write).
    pub fn bytes_moved(&self) -> u64 {
        2 * self.bytes
    }
}

/// The compute roofline: `invocations` x `iters` iterations of 8 vec4 FMA chains (64 flops).
pub struct FmaKernel {
    pipeline: wgpu::ComputePipeline,
    bind: wgpu::BindGroup,
    groups: [u32; 2],
    /// Invocations per run: the number asked for, rounded up to whole workgroups of 256 laid out
    /// within the per-dimension limit.
    pub invocations: u32,
    /// Iterations of each invocation's eight FMA chains.
    pub iters: u32,
    /// One `vec4<f32>` per invocation, the sum of its chains (see [`fma_reference`]).
    pub out: wgpu::Buffer,
}

/// Flops per invocation and iteration of `bench/fma.wgsl`.
pub const FMA_FLOPS_PER_ITER: u64 = 64;

impl FmaKernel {
    /// Build the compute roofline for at least `invocations` invocations of `iters` iterations each;
    /// fails if either is 0.
    pub async fn new(rt: &Runtime, invocations: u32, iters: u32) -> Result<FmaKernel> {
        if invocations == 0 || iters == 0 {
            return Err(Error::Input("the compute roofline needs at least one invocation and iteration".into()));
        }
        let wgs = invocations.div_ceil(256);
        let groups = crate::runtime::split_workgroups(wgs);
        let invocations = groups[0] * groups[1] * 256;
        let pipeline = rt.pipeline(Kernel::BenchFma, &[]).await?;
        let out = rt.storage("bench/fma out", u64::from(invocations) * 16);
        let params = rt.uniform("bench/fma params", &crate::gpu_data::FmaParams { iters, ..Default::default() });
        let bind = rt.bind(Kernel::BenchFma.label(), &pipeline, &[&params, &out]);
        Ok(FmaKernel { pipeline, bind, groups, invocations, iters, out })
    }

    /// Record one run, a single dispatch, into `pass`.
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.bind, &[]);
        pass.dispatch_counted(self.groups[0], self.groups[1], 1);
    }

    /// Flops per run: `invocations * iters * FMA_FLOPS_PER_ITER`.
    pub fn flops(&self) -> u64 {
        u64::from(self.invocations) * u64::from(self.iters) * FMA_FLOPS_PER_ITER
    }
}

/// CPU reference of one invocation's output of `bench/fma.wgsl` (f64).
pub fn fma_reference(i: u32, iters: u32) -> [f64; 4] {
    let base = [f64::from(i % 1024) * f64::from(1e-3f32), 0.25, 0.5, 0.75];
    let (m, k) = (f64::from(0.9999f32), f64::from(1e-4f32));
    let mut out = [0f64; 4];
    for chain in 0..8 {
        for (lane, o) in out.iter_mut().enumerate() {
            let mut x = base[lane] + f64::from(chain);
            for _ in 0..iters {
                x = x * m + k;
            }
            *o += x;
        }
    }
    out
}

/// The adapter's measured rooflines.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Roofline {
    /// Device copy, bytes read + written per second / 1e9.
    pub bandwidth_gbps: f64,
    /// f32 FMA throughput, flops per second / 1e9.
    pub compute_gflops: f64,
}

/// Measure both rooflines (`quick`: small sizes for CPU adapters and CI).
pub async fn measure_roofline(rt: &Runtime, quick: bool) -> Result<Roofline> {
    let (warmup, reps) = if quick { (2, 5) } else { (5, 20) };
    let bytes = if quick { 32 << 20 } else { (1u64 << 30).min(rt.max_binding_bytes()) };
    let (ck, cm) = copy_roofline(rt, bytes, warmup, reps).await?;
    let bandwidth_gbps = gbps(ck.bytes_moved(), cm.median_ms);
    drop(ck);
    let (inv, iters) = if quick { (1 << 14, 256) } else { (1 << 22, 1024) };
    let fk = FmaKernel::new(rt, inv, iters).await?;
    let fm = time_passes(rt, warmup, reps, &|p| fk.encode(p)).await?;
    let compute_gflops = fk.flops() as f64 / (fm.median_ms * 1e-3) / 1e9;
    Ok(Roofline { bandwidth_gbps, compute_gflops })
}

/// One benchmark line, as `expertkv bench --json` prints it.
#[derive(Clone, Debug, Serialize)]
pub struct BenchRecord {
    /// What was timed: `copy`, `attend_decode` or `route`.
    pub kernel: String,
    /// The problem size as a label (for attention [`AttendShape::label`]).
    pub shape: String,
    /// Median time of one run, in milliseconds.
    pub median_ms: f64,
    /// Fastest run, in milliseconds.
    pub min_ms: f64,
    /// Bytes one run moves, from which `gbps` is computed (for attention, the K/V bytes the pool
    /// holds for the context).
    pub bytes: u64,
    /// Achieved bandwidth: `bytes` per median run, in GB/s (1e9 bytes per second).
    pub gbps: f64,
    /// The copy roofline measured in the same run, in GB/s.
    pub copy_gbps: f64,
    /// `gbps / copy_gbps`: the share of the copy roofline reached.
    pub ratio_to_copy: f64,
    /// The adapter's name.
    pub adapter: String,
    /// The wgpu backend, as `Debug` prints it (`Vulkan`, `Metal`, ...).
    pub backend: String,
    /// Which variant ran: for attention [`Attention::describe`] (with the codec's pages), for routing
    /// the router's name, for the copy `vec4`.
    pub variant: String,
    /// The kernels' bounds-check mode, as [`crate::runtime::ShaderChecks::name`] names it.
    pub shader_checks: String,
    /// How runs were timed: `gpu-timestamps` or `host-clock`.
    pub timing: String,
    /// Timed runs the median and minimum are taken over.
    pub samples: usize,
}

/// Bandwidth in GB/s (1e9 bytes per second) of moving `bytes` in `ms` milliseconds.
pub fn gbps(bytes: u64, ms: f64) -> f64 {
    bytes as f64 / (ms * 1e-3) / 1e9
}

/// Measure the copy roofline over `bytes`.
pub async fn copy_roofline(rt: &Runtime, bytes: u64, warmup: u32, reps: u32) -> Result<(CopyKernel, Measurement)> {
    let k = CopyKernel::new(rt, bytes, 0x00C0_FFEE).await?;
    let m = time_passes(rt, warmup, reps, &|p| k.encode(p)).await?;
    Ok((k, m))
}

/// How host memory reaches a GPU buffer in [`upload_bandwidth`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UploadPath {
    /// `Queue::write_buffer`: the host copies into wgpu's staging memory, then the GPU copies.
    WriteBuffer,
    /// A copy command from a host-memory buffer ([`Runtime::host_copy_source`]): DMA only, the
    /// path an expert cache's fetches take.
    HostCopy,
}

impl UploadPath {
    /// The path's name in benchmark records.
    pub fn name(self) -> &'static str {
        match self {
            UploadPath::WriteBuffer => "write_buffer",
            UploadPath::HostCopy => "host_copy",
        }
    }
}

/// The words a host-to-GPU benchmark uploads: a pattern over `bytes / 4` words (within one
/// storage binding), and the check of a GPU buffer's first and last 1,024 against it.
#[cfg(not(target_arch = "wasm32"))]
struct UploadPattern {
    words: u64,
    host: Vec<u32>,
}

#[cfg(not(target_arch = "wasm32"))]
impl UploadPattern {
    fn word(i: u32) -> u32 {
        i.wrapping_mul(0x9E37_79B9) ^ 0x5bd1_e995
    }

    /// The pattern for `bytes`, refused (as `what`) past a storage binding or with no timed run.
    fn new(rt: &Runtime, bytes: u64, reps: u32, what: &str) -> Result<UploadPattern> {
        let words = (bytes / 4).max(1);
        if words * 4 > rt.max_binding_bytes() || words > u64::from(u32::MAX) || reps == 0 {
            return Err(Error::Input(format!("{what}: {bytes} bytes, {reps} runs")));
        }
        Ok(UploadPattern { words, host: (0..words as u32).map(Self::word).collect() })
    }

    /// Whether `buf` begins and ends with the pattern's words.
    async fn check(&self, rt: &Runtime, buf: &wgpu::Buffer, what: &str) -> Result<()> {
        let (words, n) = (self.words, self.words.min(1024));
        let head: Vec<u32> = rt.read(buf, 0, n).await?;
        let tail: Vec<u32> = rt.read(buf, words - n, n).await?;
        let want = |first: u64| (first..first + n).map(|i| Self::word(i as u32)).collect::<Vec<u32>>();
        if head != want(0) || tail != want(words - n) {
            return Err(Error::Gpu { during: what.into(), message: "the uploaded words differ from the host's".into() });
        }
        Ok(())
    }
}

/// Host-to-GPU bandwidth over `path`: `bytes` of a host pattern into a GPU buffer, each run timed
/// on the host from the call until the GPU has finished it, median over `reps` after `warmup`;
/// then the buffer's first and last words are read back and checked against the pattern.
#[cfg(not(target_arch = "wasm32"))]
pub async fn upload_bandwidth(rt: &Runtime, path: UploadPath, bytes: u64, warmup: u32, reps: u32) -> Result<Measurement> {
    let up = UploadPattern::new(rt, bytes, reps, "upload bandwidth")?;
    let (words, host) = (up.words, &up.host);
    let buf = rt.storage("bench upload", words * 4);
    let source = (path == UploadPath::HostCopy).then(|| rt.host_copy_source("bench upload (host)", host));
    let mut times = Vec::with_capacity(reps as usize);
    for i in 0..warmup + reps {
        let t0 = std::time::Instant::now();
        match &source {
            Some(src) => {
                let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("bench upload") });
                enc.copy_buffer_to_buffer(src, 0, &buf, 0, words * 4);
                rt.queue.submit([enc.finish()]);
            }
            None => {
                rt.queue.write_buffer(&buf, 0, bytemuck::cast_slice(host));
                rt.queue.submit([]);
            }
        }
        rt.wait()?;
        if i >= warmup {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    up.check(rt, &buf, "upload bandwidth").await?;
    Ok(Measurement {
        median_ms: median(&times),
        min_ms: times.iter().copied().fold(f64::INFINITY, f64::min),
        samples: times.len(),
        timing: "host-clock",
    })
}

/// A host-to-GPU copy and a compute dispatch on wgpu's one queue: each alone, and both in one
/// submission (either order, no resource shared), on the host clock. Whether the two ran at
/// once is what an expert cache's prefetch can gain from: it copies the next layer's experts
/// while this layer computes.
#[derive(Clone, Debug, Serialize)]
pub struct Overlap {
    /// Bytes the copy moves (from a host-memory buffer, [`Runtime::host_copy_source`]).
    pub bytes: u64,
    /// Flops of the compute dispatch ([`FmaKernel`], sized to take about as long as the copy).
    pub flops: u64,
    /// Median milliseconds of an empty submission (the submit and wait every figure below
    /// includes once).
    pub empty_ms: f64,
    /// Median milliseconds of the copy alone.
    pub copy_ms: f64,
    /// Median milliseconds of the dispatch alone.
    pub compute_ms: f64,
    /// Median milliseconds of the copy, then the dispatch, in one submission.
    pub copy_then_compute_ms: f64,
    /// Median milliseconds of the dispatch, then the copy, in one submission.
    pub compute_then_copy_ms: f64,
    /// Runs each median is over (the four interleaved, run by run).
    pub samples: usize,
}

impl Overlap {
    /// The share of the shorter operation hidden under the longer, in the better order, each
    /// time less the empty submission's: 0 when the two ran one after the other, 1 when
    /// together they took as long as the longer one.
    pub fn hidden(&self) -> f64 {
        let net = |ms: f64| (ms - self.empty_ms).max(0.0);
        let together = net(self.copy_then_compute_ms.min(self.compute_then_copy_ms));
        let (copy, compute) = (net(self.copy_ms), net(self.compute_ms));
        (copy + compute - together) / copy.min(compute).max(1e-9)
    }
}

/// Measure [`Overlap`] for a copy of `bytes`: the dispatch's iterations are scaled so it takes
/// about as long as the copy; then `reps` runs of each of the four and of an empty submission
/// (after `warmup`), interleaved
/// so drift falls on all alike. The copied words and the dispatch's outputs are checked against
/// the host's pattern and [`fma_reference`].
#[cfg(not(target_arch = "wasm32"))]
pub async fn copy_compute_overlap(rt: &Runtime, bytes: u64, warmup: u32, reps: u32) -> Result<Overlap> {
    let up = UploadPattern::new(rt, bytes, reps, "copy and compute overlap")?;
    let words = up.words;
    let src = rt.host_copy_source("bench overlap (host)", &up.host);
    let dst = rt.storage("bench overlap", words * 4);
    let invocations = 1 << 20;
    // How long is the copy, and how many iterations take the dispatch as long.
    let timed = |enc: wgpu::CommandEncoder| -> Result<f64> {
        let t0 = std::time::Instant::now();
        rt.queue.submit([enc.finish()]);
        rt.wait()?;
        Ok(t0.elapsed().as_secs_f64() * 1e3)
    };
    let encoder = || rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("bench overlap") });
    let copy = |enc: &mut wgpu::CommandEncoder| enc.copy_buffer_to_buffer(&src, 0, &dst, 0, words * 4);
    let compute = |enc: &mut wgpu::CommandEncoder, k: &FmaKernel| {
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("bench overlap"), timestamp_writes: None });
        k.encode(&mut pass);
    };
    let mut copy_ms = Vec::new();
    for _ in 0..warmup.max(3) {
        let mut enc = encoder();
        copy(&mut enc);
        copy_ms.push(timed(enc)?);
    }
    let probe = FmaKernel::new(rt, invocations, 64).await?;
    let mut probe_ms = Vec::new();
    for _ in 0..warmup.max(3) {
        let mut enc = encoder();
        compute(&mut enc, &probe);
        probe_ms.push(timed(enc)?);
    }
    let iters = (64.0 * median(&copy_ms) / median(&probe_ms).max(1e-6)).clamp(1.0, f64::from(1u32 << 20)) as u32;
    let k = FmaKernel::new(rt, invocations, iters).await?;
    let mut ms: [Vec<f64>; 5] = Default::default();
    for i in 0..warmup + reps {
        let runs: [&dyn Fn(&mut wgpu::CommandEncoder); 5] = [
            &|_| {},
            &|e| copy(e),
            &|e| compute(e, &k),
            &|e| {
                copy(e);
                compute(e, &k);
            },
            &|e| {
                compute(e, &k);
                copy(e);
            },
        ];
        for (run, out) in runs.iter().zip(&mut ms) {
            let mut enc = encoder();
            run(&mut enc);
            let t = timed(enc)?;
            if i >= warmup {
                out.push(t);
            }
        }
    }
    up.check(rt, &dst, "copy and compute overlap").await?;
    let outs: Vec<f32> = rt.read(&k.out, 0, 4 * 64).await?;
    for (i, got) in outs.chunks(4).enumerate() {
        let want = fma_reference(i as u32, iters);
        if got.iter().zip(want).any(|(&g, w)| (f64::from(g) - w).abs() > 1e-3 * w.abs().max(1.0)) {
            return Err(Error::Gpu {
                during: "copy and compute overlap".into(),
                message: format!("invocation {i}: {got:?}, the reference {want:?}"),
            });
        }
    }
    Ok(Overlap {
        bytes: words * 4,
        flops: k.flops(),
        empty_ms: median(&ms[0]),
        copy_ms: median(&ms[1]),
        compute_ms: median(&ms[2]),
        copy_then_compute_ms: median(&ms[3]),
        compute_then_copy_ms: median(&ms[4]),
        samples: reps as usize,
    })
}

/// Shape of one attention benchmark.
#[derive(Clone, Debug, Serialize)]
pub struct AttendShape {
    /// Sequences attended together, each a query for every query head.
    pub batch: u32,
    /// Query heads; a multiple of `kv_heads`.
    pub q_heads: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Dimensions per head.
    pub head_dim: u32,
    /// Context length of every sequence, in tokens.
    pub tokens: u32,
    /// Storage type of raw K and V.
    pub dtype: KvDtype,
    /// Slots per page.
    pub page_size: u32,
    /// How full pages are stored; `Codec::None`: raw pages.
    pub codec: Codec,
    /// 0: fill sequence by sequence in the largest appends (each list's pages end up nearly
    /// contiguous); N: position by position, N positions of every sequence per append, as a
    /// decode pipeline's prefill fills (each list's pages interleaved with every other list's).
    pub interleave: u32,
}

/// Tokens per append while filling a pool with a codec (each batch is compressed before the
/// next, so the raw pool needs room for one batch only).
pub const CODEC_FILL_BATCH: u32 = 8192;

impl AttendShape {
    /// The shape as a report label, e.g. `b8_hq32_hkv8_d128_t4096_f16_p16`, with the codec and
    /// `_i{interleave}` appended when set.
    pub fn label(&self) -> String {
        let codec = match self.codec {
            Codec::None => String::new(),
            c => format!("_{}", c.spec().replace(':', "_").replace('=', "")),
        };
        format!(
            "b{}_hq{}_hkv{}_d{}_t{}_{}_p{}{codec}{}",
            self.batch,
            self.q_heads,
            self.kv_heads,
            self.head_dim,
            self.tokens,
            self.dtype.name(),
            self.page_size,
            if self.interleave > 0 { format!("_i{}", self.interleave) } else { String::new() }
        )
    }

    /// K and V bytes one decode step reads.
    pub fn kv_bytes(&self) -> u64 {
        2 * u64::from(self.batch)
            * u64::from(self.tokens)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.dtype.bytes())
    }

    /// A pool that holds these sequences (8 shards per KV head, PiKV map, rings and pool with
    /// headroom for uneven shards).
    pub fn pool_config(&self) -> PoolConfig {
        let n_shards = 8;
        let pages_per_seq = self.tokens.div_ceil(self.page_size);
        // Shards fill unevenly; leave room in every ring and in the pool.
        let ring = (pages_per_seq.div_ceil(n_shards) * 5 / 4 + 4).max(4);
        if self.codec != Codec::None {
            // Raw pages: every ring's newest (and a spare), plus one fill batch; the rest of the
            // context in compressed pages.
            let keys = self.batch * self.kv_heads * n_shards;
            let raw = 2 * keys + (CODEC_FILL_BATCH * self.kv_heads).div_ceil(self.page_size) + keys;
            return PoolConfig {
                layers: 1,
                kv_heads: self.kv_heads,
                head_dim: self.head_dim,
                page_size: self.page_size,
                dtype: self.dtype,
                n_pages: raw,
                max_seqs: self.batch,
                n_shards,
                ring_capacity: ring,
                top_k: 1,
                shard_map: ShardMap::Pikv { n_tok: n_shards, n_exp: n_shards },
                max_buffer_bytes: None,
                codec: self.codec,
                codec_pages: self.batch * self.kv_heads * (pages_per_seq + n_shards),
            };
        }
        PoolConfig {
            layers: 1,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            page_size: self.page_size,
            dtype: self.dtype,
            n_pages: self.batch * self.kv_heads * (pages_per_seq + 2 * n_shards),
            max_seqs: self.batch,
            n_shards,
            ring_capacity: ring,
            top_k: 1,
            shard_map: ShardMap::Pikv { n_tok: n_shards, n_exp: n_shards },
            max_buffer_bytes: None,
            codec: Codec::None,
            codec_pages: 0,
        }
    }
}

/// Fill sequences `0..batch` of layer 0 with `tokens` random tokens each, through the append
/// path. Random K/V come from a block of distinct random tokens reused cyclically (cheap to make
/// for gigabytes, never zeros). `progress(done, total)` is called after each batch.
pub fn fill_random(
    rt: &Runtime,
    pool: &mut KvPool,
    batch: u32,
    tokens: u32,
    seed: u64,
    interleave: u32,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    let cfg = pool.cfg.clone();
    let mut max_batch = pool.max_append_tokens(rt) as usize;
    if cfg.codec != Codec::None {
        max_batch = max_batch.min(CODEC_FILL_BATCH as usize);
    }
    let mut append = |toks: &[NewToken], kv: &[u32], step: u32| -> Result<()> {
        pool.append(rt, toks, kv, step)?;
        if pool.cfg.codec.is_low_rank() && !pool.calibrated {
            pool.calibrate(rt, crate::compress::DEFAULT_BASIS_ITERS)?;
        }
        pool.compress(rt)?;
        if step % 16 == 15 {
            rt.wait()?;
        }
        Ok(())
    };
    random_tokens(&cfg, (batch, tokens), seed, interleave, max_batch, &mut append, progress)?;
    rt.wait()?;
    Ok(())
}

/// Where [`random_tokens`] hands each batch: `(tokens, kv words, step)`.
pub type AppendFn<'a> = dyn FnMut(&[NewToken], &[u32], u32) -> Result<()> + 'a;

/// The tokens and K/V words [`fill_random`] appends, handed to `append(tokens, kv, step)` in
/// batches of at most `max_batch` (`batch` sequences of `tokens` each, `(batch, tokens)`), for
/// any destination (one pool, or a [`crate::devices::ShardedPool`]).
pub fn random_tokens(
    cfg: &PoolConfig,
    (batch, tokens): (u32, u32),
    seed: u64,
    interleave: u32,
    mut max_batch: usize,
    append: &mut AppendFn<'_>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    let per_token = (cfg.kv_heads * cfg.head_dim * 2) as usize;
    let distinct = 4096usize;
    let mut rng = Rng::new(seed);
    let values: Vec<f32> = (0..distinct * per_token).map(|_| rng.normal() as f32).collect();
    let mut words_block = Vec::new();
    encode_values(&values, cfg.dtype, &mut words_block);
    let wpt = words_block.len() / distinct;
    let total = u64::from(batch) * u64::from(tokens);
    let mut done = 0u64;
    let mut pending: Vec<(u32, u32)> = Vec::new();
    let mut step = 0u32;
    let mut flush = |pending: &mut Vec<(u32, u32)>, step: u32| -> Result<()> {
        let toks: Vec<NewToken> = pending
            .iter()
            .map(|&(seq, pos)| NewToken {
                layer: 0,
                seq,
                position: pos,
                experts: (0..cfg.top_k).map(|i| (pos / 7 + seq + i) % 64).collect(),
                gates: vec![1.0 / cfg.top_k as f32; cfg.top_k as usize],
            })
            .collect();
        let mut kv = Vec::with_capacity(toks.len() * wpt);
        for &(seq, pos) in pending.iter() {
            let i = ((pos as usize) * 31 + seq as usize * 17) % distinct;
            kv.extend_from_slice(&words_block[i * wpt..(i + 1) * wpt]);
        }
        append(&toks, &kv, step)?;
        pending.clear();
        Ok(())
    };
    if interleave > 0 {
        max_batch = max_batch.min((interleave * batch) as usize).max(1);
    }
    let order: Box<dyn Iterator<Item = (u32, u32)>> = if interleave > 0 {
        Box::new((0..tokens).flat_map(|pos| (0..batch).map(move |seq| (seq, pos))))
    } else {
        Box::new((0..batch).flat_map(|seq| (0..tokens).map(move |pos| (seq, pos))))
    };
    for (seq, pos) in order {
        pending.push((seq, pos));
        if pending.len() == max_batch {
            done += pending.len() as u64;
            flush(&mut pending, step)?;
            step += 1;
            if step.is_multiple_of(16) {
                progress(done, total);
            }
        }
    }
    if !pending.is_empty() {
        done += pending.len() as u64;
        flush(&mut pending, step)?;
    }
    progress(done, total);
    Ok(())
}

/// Build a pool for `shape`, fill it, and time decode attention (split + reduce, no mass pass).
pub async fn bench_attend(
    rt: &Runtime,
    shape: &AttendShape,
    base: AttendOptions,
    warmup: u32,
    reps: u32,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<AttendBench> {
    if !shape.q_heads.is_multiple_of(shape.kv_heads) {
        return Err(Error::config("q_heads", shape.q_heads, format!("must be a multiple of kv_heads = {}", shape.kv_heads)));
    }
    let mut pool = KvPool::new(rt, shape.pool_config()).await?;
    fill_random(rt, &mut pool, shape.batch, shape.tokens, 7, shape.interleave, progress)?;
    pool.check_errors(rt, 0).await?;
    pool.gather(rt)?;
    let attn = Attention::new(rt, &pool, AttendOptions { group: shape.q_heads / shape.kv_heads, n_seqs: shape.batch, mass: false, ..base })
        .await?;
    let mut rng = Rng::new(11);
    let q: Vec<f32> = (0..shape.batch * shape.q_heads * shape.head_dim).map(|_| rng.normal() as f32).collect();
    attn.set_queries(rt, &q)?;
    attn.prepare(rt, 0, 0);
    let total = time_passes(rt, warmup, reps, &|p| attn.encode(p)).await?;
    let split = time_passes(rt, warmup, reps, &|p| attn.encode_split(p)).await?;
    let codec_split =
        if pool.cfg.codec != Codec::None { Some(time_passes(rt, warmup, reps, &|p| attn.encode_codec_split(p)).await?) } else { None };
    // Bytes resident (and read by attention): raw pages in use plus compressed pages in use.
    let ctl = pool.read_ctl(rt).await?;
    let c = &pool.cfg;
    let raw_pages = c.n_pages - ctl.free_top;
    let codec_pages = if c.codec == Codec::None { 0 } else { c.codec_pages - ctl.codec_free_top };
    let resident = u64::from(raw_pages) * c.page_bytes() + u64::from(codec_pages) * c.codec_page_bytes();
    let mut variant = attn.describe();
    if c.codec != Codec::None {
        variant = format!("{variant} + {} pages ({codec_pages} compressed, {raw_pages} raw)", c.codec.name());
    }
    Ok(AttendBench { total, split, codec_split, variant, resident_bytes: resident })
}

/// Decode attention timed whole (split + reduce) and split pass alone.
pub struct AttendBench {
    /// Decode attention whole: split and reduce passes.
    pub total: Measurement,
    /// The split pass alone.
    pub split: Measurement,
    /// The compressed pages' split kernel alone.
    pub codec_split: Option<Measurement>,
    /// Which attention kernel ran and its knobs ([`Attention::describe`]), with the codec and the
    /// pages in use when there is one.
    pub variant: String,
    /// K/V bytes the pool holds for the context (what attention reads).
    pub resident_bytes: u64,
}

/// Time routing (bias + top-k, what a decode step's selection costs) of `tokens` tokens over
/// `n_experts` with `top_k`, on random logits, for one router.
pub async fn bench_route(
    rt: &Runtime,
    cfg: crate::route::config::RouterConfig,
    tokens: u32,
    n_experts: u32,
    top_k: u32,
    warmup: u32,
    reps: u32,
) -> Result<Measurement> {
    use crate::route::{RouteShape, Router};
    let router = Router::new(rt, cfg, RouteShape { n_experts, top_k, layers: 1, max_tokens: tokens }, 0.1).await?;
    let mut rng = Rng::new(3);
    let logits: Vec<f32> = (0..u64::from(tokens) * u64::from(n_experts)).map(|_| rng.normal() as f32).collect();
    router.set_logits(rt, 0, &logits)?;
    router.prepare(rt, 0, tokens, 0)?;
    time_passes(rt, warmup, reps, &|p| router.encode_select(p, 0, tokens)).await
}
