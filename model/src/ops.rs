//! The model's per-token kernels on the GPU (`shaders/wgsl/model/*.wgsl`): matrix-vector products
//! over weights kept in ggml's block formats and dequantised in-kernel, RMSNorm, RoPE, SwiGLU and
//! embedding lookup. A forward pass strings them together around the KV pool's append and
//! attention; each has a CPU reference in [`crate::reference::ops`].

use expertkv_shaders::Kernel;

use crate::gguf::GgmlType;
use crate::gpu_data::{KvPackParams, MatVecParams, ModelOpParams, MoeParams, MoeTopkParams};
use crate::{Error, Result};
use expertkv_core::runtime::Runtime;
use expertkv_core::runtime::dispatch::CountedDispatch;

/// Tokens one matrix-vector workgroup takes (`MAX_TOKENS` in `model/matvec.wgsl`): a call takes
/// any number, in groups of this many (a decode step's sequences; the prefill's products are
/// tiled, [`ModelKernels::for_prefill`]). A call of one token (a decode step at batch 1) runs
/// the kernel built for one (`MAX_TOKENS` 1): no per-token arrays to index, a smaller
/// workgroup array, the same sums in the same order.
pub const MATVEC_MAX_TOKENS: u32 = 8;

/// Tokens and rows of one workgroup of the prefill's tiled products (`TILE` in
/// `model/matmul.wgsl`; see [`ModelKernels::for_prefill`]).
pub const MATMUL_TILE: u32 = 64;

/// How a matrix's weights sit in GPU memory (`common/quant.wgsl`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    /// Plain f32 as stored, handled in blocks of 32 (128 bytes, 32 words).
    F32,
    /// ggml Q8_0, each 34-byte block padded to 36 bytes on upload.
    Q8_0,
    /// ggml Q4_1 as is (20-byte blocks).
    Q4_1,
    /// IEEE halves as stored, blocks of 32 (64 bytes, 16 words).
    F16,
    /// bfloat16 as stored, blocks of 32 (64 bytes, 16 words).
    BF16,
    /// ggml Q4_0, each 18-byte block padded to 20 bytes on upload.
    Q4_0,
    /// ggml's K-quants: super-blocks of 256 weights (Q6_K's 210 bytes padded to 212).
    Q4K,
    /// ggml Q5_K as is (176-byte super-blocks, 44 words).
    Q5K,
    /// ggml Q6_K, each 210-byte super-block padded to 212 bytes (53 words) on upload.
    Q6K,
}

impl WeightFormat {
    /// Every format the kernels read.
    pub const ALL: [WeightFormat; 9] = [
        WeightFormat::F32,
        WeightFormat::Q8_0,
        WeightFormat::Q4_1,
        WeightFormat::F16,
        WeightFormat::BF16,
        WeightFormat::Q4_0,
        WeightFormat::Q4K,
        WeightFormat::Q5K,
        WeightFormat::Q6K,
    ];

    /// The format of tensors stored as `ty`; an error listing the formats the kernels read for any
    /// other type.
    pub fn from_ggml(ty: GgmlType) -> Result<WeightFormat> {
        match ty {
            GgmlType::F32 => Ok(WeightFormat::F32),
            GgmlType::Q8_0 => Ok(WeightFormat::Q8_0),
            GgmlType::Q4_1 => Ok(WeightFormat::Q4_1),
            GgmlType::F16 => Ok(WeightFormat::F16),
            GgmlType::Bf16 => Ok(WeightFormat::BF16),
            GgmlType::Q4_0 => Ok(WeightFormat::Q4_0),
            GgmlType::Q4K => Ok(WeightFormat::Q4K),
            GgmlType::Q5K => Ok(WeightFormat::Q5K),
            GgmlType::Q6K => Ok(WeightFormat::Q6K),
            other => Err(Error::Model(format!(
                "the GPU kernels read F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K weights, not {}",
                other.name()
            ))),
        }
    }

    /// The ggml type of the file's blocks.
    pub fn ggml(self) -> GgmlType {
        match self {
            WeightFormat::F32 => GgmlType::F32,
            WeightFormat::Q8_0 => GgmlType::Q8_0,
            WeightFormat::Q4_1 => GgmlType::Q4_1,
            WeightFormat::F16 => GgmlType::F16,
            WeightFormat::BF16 => GgmlType::Bf16,
            WeightFormat::Q4_0 => GgmlType::Q4_0,
            WeightFormat::Q4K => GgmlType::Q4K,
            WeightFormat::Q5K => GgmlType::Q5K,
            WeightFormat::Q6K => GgmlType::Q6K,
        }
    }

    /// The `FORMAT` define of the kernels (`FORMAT_*` in `common/quant.wgsl`).
    pub fn define(self) -> u32 {
        match self {
            WeightFormat::F32 => 0,
            WeightFormat::Q8_0 => 1,
            WeightFormat::Q4_1 => 2,
            WeightFormat::F16 => 3,
            WeightFormat::BF16 => 4,
            WeightFormat::Q4_0 => 5,
            WeightFormat::Q4K => 6,
            WeightFormat::Q5K => 7,
            WeightFormat::Q6K => 8,
        }
    }

    /// Weights of one block: 32, or 256 for the K-quants. A row's length is a multiple of it.
    pub fn block_weights(self) -> usize {
        match self {
            WeightFormat::Q4K | WeightFormat::Q5K | WeightFormat::Q6K => 256,
            _ => 32,
        }
    }

    /// Bytes of one block in the file.
    pub fn file_block_bytes(self) -> usize {
        match self {
            WeightFormat::F32 => 128,
            WeightFormat::Q8_0 => 34,
            WeightFormat::Q4_1 => 20,
            WeightFormat::F16 | WeightFormat::BF16 => 64,
            WeightFormat::Q4_0 => 18,
            WeightFormat::Q4K => 144,
            WeightFormat::Q5K => 176,
            WeightFormat::Q6K => 210,
        }
    }

    /// Bytes a `rows` x `cols` matrix in this format takes on the GPU (blocks as the kernels
    /// read them; `cols` a whole number of blocks).
    pub fn gpu_bytes(self, rows: u32, cols: u32) -> u64 {
        u64::from(rows) * u64::from(cols) / self.block_weights() as u64 * self.gpu_block_words() as u64 * 4
    }

    /// u32 words of one block on the GPU.
    pub fn gpu_block_words(self) -> usize {
        match self {
            WeightFormat::F32 => 32,
            WeightFormat::Q8_0 => 9,
            WeightFormat::Q4_1 | WeightFormat::Q4_0 => 5,
            WeightFormat::F16 | WeightFormat::BF16 => 16,
            WeightFormat::Q4K => 36,
            WeightFormat::Q5K => 44,
            WeightFormat::Q6K => 53,
        }
    }
}

/// The weight format of tensor `name` of `g` (an error naming it when it is missing or of a
/// type the kernels do not read).
pub fn tensor_format(g: &crate::gguf::Gguf<'_>, name: &str) -> Result<WeightFormat> {
    let ty = g.tensor(name).map(|t| t.ggml_type()).ok_or_else(|| Error::Model(format!("tensor `{name}` is missing")))?;
    WeightFormat::from_ggml(ty)
}

/// The weight format of tensors `a` and `b` of `g`, which must be the same.
pub fn same_format(g: &crate::gguf::Gguf<'_>, a: &str, b: &str) -> Result<WeightFormat> {
    let format = tensor_format(g, a)?;
    if tensor_format(g, b)? != format {
        return Err(Error::Model(format!("`{a}` and `{b}` differ in format")));
    }
    Ok(format)
}

/// A `rows x cols` matrix (row-major: row = output feature) in a block format on the GPU.
pub struct GpuMatrix {
    /// The blocks row after row as [`pack_blocks`] lays them out, [`WeightFormat::gpu_block_words`]
    /// words each.
    pub buffer: wgpu::Buffer,
    /// The block format the kernels dequantise.
    pub format: WeightFormat,
    /// Output features.
    pub rows: u32,
    /// Input features (a multiple of [`WeightFormat::block_weights`]).
    pub cols: u32,
}

/// The file's bytes of a `rows x cols` matrix as the kernels read them (Q8_0 blocks padded).
pub fn pack_blocks(format: WeightFormat, rows: u32, cols: u32, bytes: &[u8]) -> Result<Vec<u32>> {
    let bw = format.block_weights();
    if cols == 0 || !(cols as usize).is_multiple_of(bw) || rows == 0 {
        return Err(Error::Input(format!("a {rows} x {cols} {format:?} matrix: columns must be a positive multiple of {bw}")));
    }
    let blocks = rows as usize * (cols as usize / bw);
    let fb = format.file_block_bytes();
    let want = blocks * fb;
    if bytes.len() != want {
        return Err(Error::Input(format!("{rows} x {cols} {format:?} matrix needs {want} bytes, got {}", bytes.len())));
    }
    let words = |b: &[u8]| b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<u32>>();
    Ok(match format {
        WeightFormat::Q8_0 | WeightFormat::Q4_0 => {
            // The f16 scale alone in the first word, so the codes start on a word.
            let mut out = Vec::with_capacity(blocks * format.gpu_block_words());
            for blk in bytes.chunks_exact(fb) {
                out.push(u32::from(u16::from_le_bytes([blk[0], blk[1]])));
                out.extend(words(&blk[2..]));
            }
            out
        }
        WeightFormat::Q6K => {
            // 210 bytes: two zero bytes after each block's f16 d.
            let mut out = Vec::with_capacity(blocks * format.gpu_block_words());
            let mut padded = [0u8; 212];
            for blk in bytes.chunks_exact(fb) {
                padded[..210].copy_from_slice(blk);
                out.extend(words(&padded));
            }
            out
        }
        _ => words(bytes),
    })
}

impl GpuMatrix {
    /// Packs the file's bytes of a `rows x cols` matrix ([`pack_blocks`]) into a new storage buffer
    /// labelled `label`; an error when the bytes do not match the shape or the buffer is larger
    /// than the device can bind.
    pub fn upload(rt: &Runtime, label: &str, format: WeightFormat, rows: u32, cols: u32, bytes: &[u8]) -> Result<GpuMatrix> {
        let words = pack_blocks(format, rows, cols, bytes)?;
        let size = words.len() as u64 * 4;
        rt.fits_binding(format!("matrix {label}"), size)?;
        Ok(GpuMatrix { buffer: rt.storage_init(label, &words), format, rows, cols })
    }
}

/// One layer's MoEfied FFN on the GPU (`model/moe.wgsl`): the FFN permuted so that every
/// expert's neurons are contiguous. Gate and up rows are the file's block rows copied in expert
/// order (no requantisation); Wdown is held transposed in f32 (`[ffn][hidden]`), since its
/// neurons are columns and a column subset of a block format is not a block format.
pub struct MoeFfn {
    /// `[2 * ffn][hidden]`: gate rows then up rows, in expert order.
    pub gate_up: GpuMatrix,
    /// The down projection (see [`MoeDown`]).
    pub down: MoeDown,
    /// `[n_experts + 1]` u32: expert `e` owns permuted neurons `offsets[e]..offsets[e + 1]`; for
    /// a MoE file's own experts, `[n_experts]`: expert `e`'s slot (past the last: not resident).
    pub offsets: wgpu::Buffer,
    /// Experts in the layer.
    pub n_experts: u32,
    /// Neurons of the largest expert (slots per choice in the activation scratch).
    pub max_size: u32,
    /// Neurons of all experts together (of all slots, for a MoE file's experts).
    pub ffn: u32,
    /// FFN input and output features.
    pub hidden: u32,
}

/// Experts of a layer [`ModelKernels::moe_ffn_grouped`] can group (its counters sit in
/// workgroup memory: `MAX_EXPERTS` in `model/moe_tiled.wgsl`).
pub const MOE_GROUPED_MAX_EXPERTS: u32 = 128;

/// Scratch of [`ModelKernels::moe_ffn_grouped`] for up to `n_tokens` tokens.
pub struct MoeGroups {
    /// `[n_experts][n_tokens]` u32: the (token, choice) pairs that chose each expert.
    pub lists: wgpu::Buffer,
    /// `[n_experts]` u32: how many.
    pub counts: wgpu::Buffer,
    /// `[n_tokens * top_k][hidden]` f32: each pair's down product.
    pub out: wgpu::Buffer,
}

impl MoeGroups {
    /// Scratch for `n_tokens` tokens choosing `top_k` of `n_experts` experts of a `hidden`-wide FFN.
    pub fn new(rt: &Runtime, n_tokens: u32, n_experts: u32, top_k: u32, hidden: u32) -> MoeGroups {
        let (n, e) = (u64::from(n_tokens), u64::from(n_experts));
        MoeGroups {
            lists: rt.storage("model/moe groups lists", e * n * 4),
            counts: rt.storage("model/moe groups counts", e * 4),
            out: rt.storage("model/moe groups out", n * u64::from(top_k) * u64::from(hidden) * 4),
        }
    }
}

/// Where a MoE FFN's down projection lives on the GPU.
pub enum MoeDown {
    /// MoEfied experts (neuron groups of a dense FFN, which split the columns of the file's
    /// quantised blocks): `[ffn][hidden]` f32, Wdown transposed, rows in expert order (the
    /// permutation of `gate_up`).
    Transposed(wgpu::Buffer),
    /// A MoE file's own experts: `ffn_down_exps` as the file stores it, `[n_experts * hidden][ffn /
    /// n_experts]`, dequantised in-kernel.
    Experts(GpuMatrix),
}

impl MoeFfn {
    /// Whether [`ModelKernels::moe_ffn_grouped`] takes these experts: a MoE file's own (in
    /// slots), at most [`MOE_GROUPED_MAX_EXPERTS`] of them.
    pub fn groupable(&self) -> bool {
        matches!(self.down, MoeDown::Experts(_)) && self.n_experts <= MOE_GROUPED_MAX_EXPERTS
    }

    /// The expert kernels' uniform for a call of `n_tokens` tokens choosing `top_k` experts.
    fn params(&self, rt: &Runtime, n_tokens: u32, top_k: u32, accumulate: bool) -> wgpu::Buffer {
        rt.uniform(
            "model/moe params",
            &MoeParams {
                hidden: self.hidden,
                ffn: self.ffn,
                top_k,
                max_size: self.max_size,
                n_tokens,
                n_experts: self.n_experts,
                accumulate: u32::from(accumulate),
                slotted: u32::from(matches!(self.down, MoeDown::Experts(_))),
            },
        )
    }

    /// A MoE file's own experts, every matrix as the file stores it: `gate` and `up`
    /// (`ffn_gate_exps`, `ffn_up_exps`: `[n_experts * f][hidden]` in `format`) and `down`
    /// (`ffn_down_exps`: `[n_experts * hidden][f]` in `down_format`), `n_experts` experts of `f`
    /// neurons each, every one resident (expert e in slot e).
    #[allow(clippy::too_many_arguments)]
    pub fn upload_experts(
        rt: &Runtime,
        label: &str,
        (format, gate, up): (WeightFormat, &[u8], &[u8]),
        (down_format, down): (WeightFormat, &[u8]),
        hidden: u32,
        n_experts: u32,
        f: u32,
    ) -> Result<MoeFfn> {
        let ffn = n_experts.checked_mul(f).ok_or_else(|| Error::Input(format!("{label}: {n_experts} experts of {f} neurons")))?;
        let h = hidden as usize;
        let row_bytes = h / format.block_weights() * format.file_block_bytes();
        if n_experts == 0
            || f == 0
            || h == 0
            || !h.is_multiple_of(format.block_weights())
            || gate.len() != ffn as usize * row_bytes
            || up.len() != gate.len()
        {
            return Err(Error::Input(format!("{label}: gate/up do not match {n_experts} experts of {f} neurons x {hidden} features")));
        }
        if !(f as usize).is_multiple_of(down_format.block_weights()) {
            return Err(Error::Input(format!("{label}: {f} neurons per expert are not whole {down_format:?} blocks")));
        }
        let mut gate_up = Vec::with_capacity(2 * gate.len());
        gate_up.extend_from_slice(gate);
        gate_up.extend_from_slice(up);
        let slots: Vec<u32> = (0..n_experts).collect();
        Ok(MoeFfn {
            gate_up: GpuMatrix::upload(rt, label, format, 2 * ffn, hidden, &gate_up)?,
            down: MoeDown::Experts(GpuMatrix::upload(rt, label, down_format, n_experts * hidden, f, down)?),
            offsets: rt.storage_init(label, &slots),
            n_experts,
            max_size: f,
            ffn,
            hidden,
        })
    }

    /// Bytes its buffers take on the GPU: the experts' (or slots') gate/up and down weights and
    /// the slot table.
    pub fn gpu_bytes(&self) -> u64 {
        let down = match &self.down {
            MoeDown::Transposed(b) => b.size(),
            MoeDown::Experts(m) => m.buffer.size(),
        };
        self.gate_up.buffer.size() + down + self.offsets.size()
    }

    /// Room for `slots` of a MoE file's `n_experts` experts of `f` neurons (gate/up in `format`,
    /// down in `down_format`), none resident: the GPU tier of an expert cache
    /// ([`crate::experts::ExpertCache`] writes experts into slots and the slot table).
    pub fn expert_slots(
        rt: &Runtime,
        label: &str,
        (format, down_format): (WeightFormat, WeightFormat),
        hidden: u32,
        n_experts: u32,
        f: u32,
        slots: u32,
    ) -> Result<MoeFfn> {
        if slots == 0
            || slots > n_experts
            || f == 0
            || !(f as usize).is_multiple_of(down_format.block_weights())
            || !(hidden as usize).is_multiple_of(format.block_weights())
        {
            return Err(Error::Input(format!("{label}: {slots} slots for {n_experts} experts of {f} neurons x {hidden} features")));
        }
        let matrix = |name: &str, fmt: WeightFormat, rows: u32, cols: u32| -> Result<GpuMatrix> {
            let size = fmt.gpu_bytes(rows, cols);
            rt.fits_binding(format!("{label} {name}"), size)?;
            Ok(GpuMatrix { buffer: rt.storage(&format!("{label} {name}"), size), format: fmt, rows, cols })
        };
        Ok(MoeFfn {
            gate_up: matrix("gate/up slots", format, 2 * slots * f, hidden)?,
            down: MoeDown::Experts(matrix("down slots", down_format, slots * hidden, f)?),
            // Nothing resident: every slot index past the last (the kernels read nothing there).
            offsets: rt.storage_init(label, &vec![slots; n_experts as usize]),
            n_experts,
            max_size: f,
            ffn: slots * f,
            hidden,
        })
    }

    /// From the file's `gate` and `up` bytes (`[ffn][hidden]` each, in `format`), Wdown as f32
    /// (`[hidden][ffn]`, row-major as in the file) and the experts (`neurons` grouped by expert,
    /// expert `e` = `neurons[offsets[e]..offsets[e + 1]]`).
    #[allow(clippy::too_many_arguments)]
    pub fn upload(
        rt: &Runtime,
        label: &str,
        format: WeightFormat,
        hidden: u32,
        gate: &[u8],
        up: &[u8],
        down: &[f32],
        neurons: &[u32],
        offsets: &[u32],
    ) -> Result<MoeFfn> {
        let ffn = neurons.len();
        let h = hidden as usize;
        let row_bytes = h / format.block_weights() * format.file_block_bytes();
        if h == 0
            || !h.is_multiple_of(format.block_weights())
            || gate.len() != ffn * row_bytes
            || up.len() != ffn * row_bytes
            || down.len() != ffn * h
        {
            return Err(Error::Input(format!("{label}: FFN matrices do not match {ffn} neurons x {hidden} features")));
        }
        let n_experts = offsets.len().saturating_sub(1);
        let mut seen = vec![false; ffn];
        let ok = n_experts > 0
            && offsets[0] == 0
            && offsets[n_experts] as usize == ffn
            && offsets.windows(2).all(|w| w[0] <= w[1])
            && neurons.iter().all(|&n| (n as usize) < ffn && !std::mem::replace(&mut seen[n as usize], true));
        if !ok {
            return Err(Error::Input(format!("{label}: the experts do not partition the {ffn} neurons")));
        }
        let mut permuted = Vec::with_capacity(2 * ffn * row_bytes);
        for m in [gate, up] {
            for &n in neurons {
                permuted.extend_from_slice(&m[n as usize * row_bytes..(n as usize + 1) * row_bytes]);
            }
        }
        let mut down_t = vec![0f32; ffn * h];
        for (i, &n) in neurons.iter().enumerate() {
            for o in 0..h {
                down_t[i * h + o] = down[o * ffn + n as usize];
            }
        }
        let max_size = offsets.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        Ok(MoeFfn {
            gate_up: GpuMatrix::upload(rt, label, format, 2 * ffn as u32, hidden, &permuted)?,
            down: MoeDown::Transposed(rt.storage_init(label, &down_t)),
            offsets: rt.storage_init(label, offsets),
            n_experts: n_experts as u32,
            max_size,
            ffn: ffn as u32,
            hidden,
        })
    }
}

/// Where the model kernels put their dispatches: straight into a compute pass, or into a
/// [`Recorded`] list built once and replayed every step (the kernels' parameters and buffers do
/// not change between steps, so neither do their uniforms and bind groups).
pub trait DispatchSink {
    /// One dispatch of `pipeline` with `bind_group` at group 0, `workgroups` as (x, y, z) counts.
    fn dispatch(&mut self, pipeline: &wgpu::ComputePipeline, bind_group: wgpu::BindGroup, workgroups: [u32; 3]);
}

impl DispatchSink for wgpu::ComputePass<'_> {
    fn dispatch(&mut self, pipeline: &wgpu::ComputePipeline, bind_group: wgpu::BindGroup, [x, y, z]: [u32; 3]) {
        self.set_pipeline(pipeline);
        self.set_bind_group(0, &bind_group, &[]);
        self.dispatch_counted(x, y, z);
    }
}

/// Dispatches recorded once (each bind group keeps its uniform and buffers alive), encoded into
/// any number of passes.
#[derive(Default)]
pub struct Recorded(Vec<(wgpu::ComputePipeline, wgpu::BindGroup, [u32; 3])>);

impl DispatchSink for Recorded {
    fn dispatch(&mut self, pipeline: &wgpu::ComputePipeline, bind_group: wgpu::BindGroup, workgroups: [u32; 3]) {
        self.0.push((pipeline.clone(), bind_group, workgroups));
    }
}

impl Recorded {
    /// Encodes every recorded dispatch into `pass`, in recording order.
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>) {
        for (p, bg, [x, y, z]) in &self.0 {
            pass.set_pipeline(p);
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_counted(*x, *y, *z);
        }
    }

    /// Dispatches recorded.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The pipeline of `format` among those built.
fn pick(pipes: &[Option<wgpu::ComputePipeline>], format: WeightFormat) -> Result<&wgpu::ComputePipeline> {
    pipes
        .get(format.define() as usize)
        .and_then(Option::as_ref)
        .ok_or_else(|| Error::Input(format!("the model kernels were built without {format:?} weights (ModelKernels::new's formats)")))
}

/// What a matrix-vector product reads (`MatVecParams::input`).
#[derive(Clone, Copy)]
enum MatVecInput<'a> {
    /// x as given.
    Plain,
    /// RMSNorm of x times this gain, with this epsilon.
    Norm(&'a wgpu::Buffer, f32),
    /// `silu(gate) * up` of x = `[b][2][cols]`.
    Swiglu,
}

/// The compiled model kernels.
#[derive(Clone)]
pub struct ModelKernels {
    /// Per weight format (`WeightFormat::define`), for the formats asked for: the
    /// matrix-vector kernel for groups of [`MATVEC_MAX_TOKENS`] tokens and for one token.
    matvec: Vec<Option<wgpu::ComputePipeline>>,
    matvec1: Vec<Option<wgpu::ComputePipeline>>,
    /// The weight formats asked for.
    formats: Vec<WeightFormat>,
    /// The prefill's kernels, built by [`ModelKernels::for_prefill`] (a model that never
    /// prefills in chunks, or the browser's first load, compiles none of them): the tiled
    /// products per weight format, and whether the products run tiled.
    matmul: Vec<Option<wgpu::ComputePipeline>>,
    tiled: bool,
    moe_gate_up: Vec<Option<wgpu::ComputePipeline>>,
    moe_down: wgpu::ComputePipeline,
    moe_down_q: Vec<Option<wgpu::ComputePipeline>>,
    /// A prefill chunk's MoE file experts grouped by expert (`model/moe_tiled.wgsl`), built by
    /// [`ModelKernels::for_prefill`].
    moe_group: Option<wgpu::ComputePipeline>,
    moe_gate_up_tiled: Vec<Option<wgpu::ComputePipeline>>,
    moe_down_tiled: Vec<Option<wgpu::ComputePipeline>>,
    moe_combine: Option<wgpu::ComputePipeline>,
    embed: Vec<Option<wgpu::ComputePipeline>>,
    rmsnorm: wgpu::ComputePipeline,
    rope_qk: wgpu::ComputePipeline,
    swiglu_gated: wgpu::ComputePipeline,
    residual: wgpu::ComputePipeline,
    kv_pack: wgpu::ComputePipeline,
    moe_topk: wgpu::ComputePipeline,
    moe_weights: wgpu::ComputePipeline,
    /// Bound where a matrix-vector product has no gain or a second or third output (the
    /// kernel's layout has them all); never read or written.
    unused: [wgpu::Buffer; 3],
}

impl ModelKernels {
    /// The kernels, the weight-reading ones for each of `formats`.
    pub async fn new(rt: &Runtime, formats: &[WeightFormat]) -> Result<ModelKernels> {
        let n = WeightFormat::ALL.len();
        let (mut matvec, mut matvec1, mut embed) = (vec![None; n], vec![None; n], vec![None; n]);
        let (mut moe_gate_up, mut moe_down_q) = (vec![None; n], vec![None; n]);
        for f in formats {
            let i = f.define() as usize;
            if matvec[i].is_some() {
                continue;
            }
            let d = [("FORMAT", format!("{i}u"))];
            matvec[i] = Some(rt.pipeline_with(Kernel::ModelMatVec, &d, &[]).await?);
            let one = [("FORMAT", format!("{i}u")), ("MAX_TOKENS", "1u".to_string())];
            matvec1[i] = Some(rt.pipeline_with(Kernel::ModelMatVec, &one, &[]).await?);
            embed[i] = Some(rt.pipeline_with(Kernel::ModelEmbed, &d, &[]).await?);
            moe_gate_up[i] = Some(rt.pipeline_with(Kernel::ModelMoeGateUp, &d, &[]).await?);
            moe_down_q[i] = Some(rt.pipeline_with(Kernel::ModelMoeDownQ, &d, &[]).await?);
        }
        Ok(ModelKernels {
            matvec,
            matvec1,
            formats: formats.to_vec(),
            matmul: vec![None; n],
            tiled: false,
            embed,
            moe_gate_up,
            moe_down: rt.pipeline(Kernel::ModelMoeDown, &[]).await?,
            moe_down_q,
            moe_group: None,
            moe_gate_up_tiled: vec![None; n],
            moe_down_tiled: vec![None; n],
            moe_combine: None,
            rmsnorm: rt.pipeline(Kernel::ModelRmsNorm, &[]).await?,
            rope_qk: rt.pipeline(Kernel::ModelRopeQk, &[]).await?,
            swiglu_gated: rt.pipeline(Kernel::ModelSwigluGated, &[]).await?,
            residual: rt.pipeline(Kernel::ModelResidual, &[]).await?,
            kv_pack: rt.pipeline(Kernel::ModelKvPack, &[]).await?,
            moe_topk: rt.pipeline(Kernel::ModelMoeTopk, &[]).await?,
            moe_weights: rt.pipeline(Kernel::ModelMoeWeights, &[]).await?,
            unused: ["gain", "y2", "y3"].map(|b| rt.storage(&format!("model/matvec unused {b}"), 16)),
        })
    }

    /// These kernels with every matrix product tiled (`model/matmul.wgsl`: tiles of
    /// [`MATMUL_TILE`] rows x [`MATMUL_TILE`] tokens, each weight dequantised once a tile where
    /// the matrix-vector kernel reads it once per [`MATVEC_MAX_TOKENS`] tokens): the prefill's
    /// products. Each output is summed over the columns in one fixed order, so a token's
    /// products do not depend on the chunk it came in; they agree with the matrix-vector
    /// kernel's (a decode step's) within f32 rounding. Builds the prefill's kernels (those and
    /// [`ModelKernels::moe_ffn_grouped`]'s) for the formats these kernels were made for.
    pub async fn for_prefill(&self, rt: &Runtime) -> Result<ModelKernels> {
        let mut k = ModelKernels { tiled: true, ..self.clone() };
        for f in &self.formats {
            let i = f.define() as usize;
            if k.matmul[i].is_some() {
                continue;
            }
            let d = [("FORMAT", format!("{i}u"))];
            k.matmul[i] = Some(rt.pipeline_with(Kernel::ModelMatMul, &d, &[]).await?);
            k.moe_gate_up_tiled[i] = Some(rt.pipeline_with(Kernel::ModelMoeGateUpTiled, &d, &[]).await?);
            k.moe_down_tiled[i] = Some(rt.pipeline_with(Kernel::ModelMoeDownTiled, &d, &[]).await?);
        }
        k.moe_group = Some(rt.pipeline(Kernel::ModelMoeGroup, &[]).await?);
        k.moe_combine = Some(rt.pipeline(Kernel::ModelMoeCombine, &[]).await?);
        Ok(k)
    }

    /// Pack `n_tokens` tokens' K and V (`[n_tokens][floats]` f32 each) into the pool's append
    /// layout in `words` (per token K then V; f16 pairs when `f16`, else f32 bits), as
    /// [`expertkv_core::append::format::encode_values`] does on the CPU.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_pack(
        &self,
        rt: &Runtime,
        pass: &mut impl DispatchSink,
        k: &wgpu::Buffer,
        v: &wgpu::Buffer,
        words: &wgpu::Buffer,
        n_tokens: u32,
        floats: u32,
        f16: bool,
    ) -> Result<()> {
        let per = if f16 { floats / 2 } else { floats };
        let need_in = u64::from(n_tokens) * u64::from(floats) * 4;
        let need_out = u64::from(n_tokens) * u64::from(2 * per) * 4;
        if n_tokens == 0 || floats == 0 || (f16 && !floats.is_multiple_of(2)) {
            return Err(Error::Input(format!("kv_pack: {n_tokens} tokens of {floats} floats (f16 needs an even count)")));
        }
        if k.size() < need_in || v.size() < need_in || words.size() < need_out {
            return Err(Error::Input("kv_pack: buffers too small".into()));
        }
        let p = rt.uniform("model/kv_pack params", &KvPackParams { n_tokens, floats, f16: u32::from(f16), _pad: 0 });
        let bg = rt.bind(Kernel::ModelKvPack.label(), &self.kv_pack, &[&p, k, v, words]);
        pass.dispatch(&self.kv_pack, bg, [(2 * per).div_ceil(256), n_tokens, 1]);
        Ok(())
    }

    /// The router's top `top_k` of `n_experts` scores per token (`scores` `[n_tokens][E]`) into
    /// `sel` `[n_tokens][top_k]` and into `log` from word `log_offset`, as
    /// [`crate::moe::top_k`] picks them.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_topk(
        &self,
        rt: &Runtime,
        pass: &mut impl DispatchSink,
        scores: &wgpu::Buffer,
        sel: &wgpu::Buffer,
        log: &wgpu::Buffer,
        log_offset: u32,
        n_tokens: u32,
        n_experts: u32,
        top_k: u32,
    ) -> Result<()> {
        if n_tokens == 0 || top_k == 0 || top_k > n_experts {
            return Err(Error::Input(format!("moe_topk: {n_tokens} tokens, top-{top_k} of {n_experts} experts")));
        }
        let chosen = (u64::from(n_tokens) * u64::from(top_k)) * 4;
        if scores.size() < (u64::from(n_tokens) * u64::from(n_experts)) * 4
            || sel.size() < chosen
            || log.size() < u64::from(log_offset) * 4 + chosen
        {
            return Err(Error::Input("moe_topk: buffers too small".into()));
        }
        let p = rt.uniform("model/router params", &MoeTopkParams { n_tokens, n_experts, top_k, log_offset, ..Default::default() });
        let bg = rt.bind(Kernel::ModelMoeTopk.label(), &self.moe_topk, &[&p, scores, sel, log]);
        pass.dispatch(&self.moe_topk, bg, [n_tokens.div_ceil(64), 1, 1]);
        Ok(())
    }

    /// The chosen experts' weights per token (`scores` `[n_tokens][E]`, `sel` `[n_tokens][top_k]`)
    /// into `wts` `[n_tokens][top_k]`: the softmax of the chosen scores, as
    /// [`crate::moe::softmax_weights`], or with `share` each one's share of the softmax over all
    /// `E`, as [`crate::moe::softmax_share_weights`].
    #[allow(clippy::too_many_arguments)]
    pub fn moe_weights(
        &self,
        rt: &Runtime,
        pass: &mut impl DispatchSink,
        scores: &wgpu::Buffer,
        sel: &wgpu::Buffer,
        wts: &wgpu::Buffer,
        n_tokens: u32,
        n_experts: u32,
        top_k: u32,
        share: bool,
    ) -> Result<()> {
        if n_tokens == 0 || top_k == 0 || top_k > n_experts {
            return Err(Error::Input(format!("moe_weights: {n_tokens} tokens, top-{top_k} of {n_experts} experts")));
        }
        let chosen = (u64::from(n_tokens) * u64::from(top_k)) * 4;
        if scores.size() < (u64::from(n_tokens) * u64::from(n_experts)) * 4 || sel.size() < chosen || wts.size() < chosen {
            return Err(Error::Input("moe_weights: buffers too small".into()));
        }
        let share = u32::from(share);
        let p = rt.uniform("model/router params", &MoeTopkParams { n_tokens, n_experts, top_k, share, ..Default::default() });
        let bg = rt.bind_at(Kernel::ModelMoeWeights.label(), &self.moe_weights, &[(0, &p), (1, scores), (2, sel), (4, wts)]);
        pass.dispatch(&self.moe_weights, bg, [n_tokens.div_ceil(64), 1, 1]);
        Ok(())
    }

    /// `y[b] = W x[b]` for `n_tokens` tokens (x: `[n_tokens][cols]` f32, y: `[n_tokens][rows]`).
    pub fn matvec(
        &self,
        rt: &Runtime,
        pass: &mut impl DispatchSink,
        w: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n_tokens: u32,
    ) -> Result<()> {
        self.matvec_into(rt, pass, w, x, y, n_tokens, false)
    }

    /// `y[b] += W x[b]`: [`ModelKernels::matvec`] with the residual added in the same dispatch.
    pub fn matvec_add(
        &self,
        rt: &Runtime,
        pass: &mut impl DispatchSink,
        w: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n_tokens: u32,
    ) -> Result<()> {
        self.matvec_into(rt, pass, w, x, y, n_tokens, true)
    }

    /// `y[b] = W rmsnorm(x[b]) * g` (`g` the norm's gain, `[cols]`) in one dispatch, the rows
    /// split over `outputs`: a stacked `[Wq; Wk; Wv]` writes Q, K and V with the norm before
    /// them folded in. `outputs` are (buffer, rows) pairs, one to three, whose rows sum to
    /// `W`'s.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_norm(
        &self,
        rt: &Runtime,
        pass: &mut impl DispatchSink,
        w: &GpuMatrix,
        x: &wgpu::Buffer,
        g: &wgpu::Buffer,
        eps: f32,
        outputs: &[(&wgpu::Buffer, u32)],
        n_tokens: u32,
    ) -> Result<()> {
        self.matvec_full(rt, pass, w, x, MatVecInput::Norm(g, eps), outputs, n_tokens, false)
    }

    /// `y[b] += W (silu(gate[b]) * up[b])` with `gate` and `up` side by side in `gu`
    /// (`[n_tokens][2][cols]`): the FFN's down projection with its activation folded in.
    pub fn matvec_swiglu_add(
        &self,
        rt: &Runtime,
        pass: &mut impl DispatchSink,
        w: &GpuMatrix,
        gu: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n_tokens: u32,
    ) -> Result<()> {
        self.matvec_full(rt, pass, w, gu, MatVecInput::Swiglu, &[(y, w.rows)], n_tokens, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn matvec_into(
        &self,
        rt: &Runtime,
        pass: &mut impl DispatchSink,
        w: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n_tokens: u32,
        accumulate: bool,
    ) -> Result<()> {
        self.matvec_full(rt, pass, w, x, MatVecInput::Plain, &[(y, w.rows)], n_tokens, accumulate)
    }

    #[allow(clippy::too_many_arguments)]
    fn matvec_full(
        &self,
        rt: &Runtime,
        pass: &mut impl DispatchSink,
        w: &GpuMatrix,
        x: &wgpu::Buffer,
        input: MatVecInput<'_>,
        outputs: &[(&wgpu::Buffer, u32)],
        n_tokens: u32,
        accumulate: bool,
    ) -> Result<()> {
        if n_tokens == 0 || n_tokens > MATVEC_MAX_TOKENS * 65_535 {
            return Err(Error::Input(format!("matvec takes 1 to {} tokens, got {n_tokens}", MATVEC_MAX_TOKENS * 65_535)));
        }
        if outputs.is_empty() || outputs.len() > 3 || outputs.iter().map(|o| u64::from(o.1)).sum::<u64>() != u64::from(w.rows) {
            return Err(Error::Input(format!("matvec: {} outputs whose rows do not sum to the matrix's {}", outputs.len(), w.rows)));
        }
        let x_floats = u64::from(n_tokens) * u64::from(w.cols) * if matches!(input, MatVecInput::Swiglu) { 2 } else { 1 };
        let short = outputs.iter().any(|(b, r)| b.size() < u64::from(n_tokens) * u64::from(*r) * 4);
        if x.size() < x_floats * 4 || short {
            return Err(Error::Input(format!("matvec: buffers too small for {n_tokens} tokens of a {} x {} matrix", w.rows, w.cols)));
        }
        let (code, g, eps) = match input {
            MatVecInput::Plain => (0, &self.unused[0], 0.0),
            MatVecInput::Norm(g, eps) => (1, g, eps),
            MatVecInput::Swiglu => (2, &self.unused[0], 0.0),
        };
        let p = rt.uniform(
            "model/matvec params",
            &MatVecParams {
                rows: w.rows,
                cols: w.cols,
                n_tokens,
                accumulate: u32::from(accumulate),
                input: code,
                split1: outputs[0].1,
                split2: outputs.get(1).map_or(0, |o| o.1),
                eps,
            },
        );
        let y2 = outputs.get(1).map_or(&self.unused[1], |o| o.0);
        let y3 = outputs.get(2).map_or(&self.unused[2], |o| o.0);
        let buffers = [&p, &w.buffer, x, outputs[0].0, g, y2, y3];
        let (kernel, pipes, rows, tokens) = if self.tiled {
            (Kernel::ModelMatMul, &self.matmul, MATMUL_TILE, MATMUL_TILE)
        } else if n_tokens == 1 {
            (Kernel::ModelMatVec, &self.matvec1, 1, 1)
        } else {
            (Kernel::ModelMatVec, &self.matvec, 1, MATVEC_MAX_TOKENS)
        };
        let pipe = pick(pipes, w.format)?;
        let bg = rt.bind(kernel.label(), pipe, &buffers);
        let [x, y] = expertkv_core::runtime::split_workgroups(w.rows.div_ceil(rows));
        pass.dispatch(pipe, bg, [x, y, n_tokens.div_ceil(tokens)]);
        Ok(())
    }

    /// The expert FFN of `n_tokens` tokens: `x` `[n_tokens][hidden]`, `sel` the chosen experts
    /// `[n_tokens][top_k]` and `wts` their weights, `act` scratch of `n_tokens x top_k x max_size`
    /// floats, `y` `[n_tokens][hidden]`: overwritten, or added to when `accumulate` (the residual
    /// stream, as [`ModelKernels::matvec_add`]).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_ffn(
        &self,
        rt: &Runtime,
        pass: &mut impl DispatchSink,
        m: &MoeFfn,
        x: &wgpu::Buffer,
        sel: &wgpu::Buffer,
        wts: &wgpu::Buffer,
        act: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n_tokens: u32,
        top_k: u32,
        accumulate: bool,
    ) -> Result<()> {
        if n_tokens == 0 || top_k == 0 || top_k > m.n_experts {
            return Err(Error::Input(format!("moe_ffn: {n_tokens} tokens, top-{top_k} of {} experts", m.n_experts)));
        }
        let need = u64::from(n_tokens) * u64::from(top_k) * u64::from(m.max_size) * 4;
        if act.size() < need
            || sel.size() < (u64::from(n_tokens) * u64::from(top_k)) * 4
            || wts.size() < (u64::from(n_tokens) * u64::from(top_k)) * 4
        {
            return Err(Error::Input("moe_ffn: scratch buffers too small".into()));
        }
        let p = m.params(rt, n_tokens, top_k, accumulate);
        let pipe = pick(&self.moe_gate_up, m.gate_up.format)?;
        let bg = rt.bind_at(
            Kernel::ModelMoeGateUp.label(),
            pipe,
            &[(0, &p), (1, &m.gate_up.buffer), (2, x), (3, act), (4, sel), (5, &m.offsets), (8, wts)],
        );
        pass.dispatch(pipe, bg, [m.max_size.div_ceil(4), top_k, n_tokens]);
        match &m.down {
            MoeDown::Transposed(down_t) => {
                let bg = rt.bind_at(
                    Kernel::ModelMoeDown.label(),
                    &self.moe_down,
                    &[(0, &p), (3, act), (4, sel), (5, &m.offsets), (6, down_t), (7, y)],
                );
                pass.dispatch(&self.moe_down, bg, [m.hidden.div_ceil(32), n_tokens, 1]);
            }
            MoeDown::Experts(down) => {
                let pipe = pick(&self.moe_down_q, down.format)?;
                let bg = rt.bind_at(
                    Kernel::ModelMoeDownQ.label(),
                    pipe,
                    &[(0, &p), (1, &down.buffer), (3, act), (4, sel), (5, &m.offsets), (7, y)],
                );
                pass.dispatch(pipe, bg, [m.hidden, n_tokens, 1]);
            }
        }
        Ok(())
    }

    /// [`ModelKernels::moe_ffn`] for a prefill chunk of a MoE file's experts (all resident in
    /// their slots), grouped by expert (`model/moe_tiled.wgsl`): the (token, choice) pairs listed
    /// per expert, each expert's gate/up and down products tiled over its pairs (each weight
    /// dequantised once per 64 of them, where `moe_ffn` reads it once per pair), then each
    /// token's choices summed in order into `y`. Every output is one fixed sum, so a token gives
    /// the same bits in any chunk. Refused for experts it does not take ([`MoeFfn::groupable`]:
    /// `moe_ffn` runs those). Needs the kernels of [`ModelKernels::for_prefill`]; each token's
    /// choices must be distinct experts (a top k's are).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_ffn_grouped(
        &self,
        rt: &Runtime,
        pass: &mut impl DispatchSink,
        m: &MoeFfn,
        (x, sel, wts, act, y): (&wgpu::Buffer, &wgpu::Buffer, &wgpu::Buffer, &wgpu::Buffer, &wgpu::Buffer),
        g: &MoeGroups,
        n_tokens: u32,
        top_k: u32,
        accumulate: bool,
    ) -> Result<()> {
        let (MoeDown::Experts(down), true) = (&m.down, m.groupable()) else {
            return Err(Error::Input(format!(
                "moe_ffn_grouped: takes a MoE file's own experts, at most {MOE_GROUPED_MAX_EXPERTS} (moe_ffn runs the rest)"
            )));
        };
        if n_tokens == 0 || top_k == 0 || top_k > m.n_experts {
            return Err(Error::Input(format!("moe_ffn_grouped: {n_tokens} tokens, top-{top_k} of {} experts", m.n_experts)));
        }
        let pairs = u64::from(n_tokens) * u64::from(top_k);
        if act.size() < pairs * u64::from(m.max_size) * 4
            || sel.size() < pairs * 4
            || wts.size() < pairs * 4
            || g.out.size() < pairs * u64::from(m.hidden) * 4
            || g.lists.size() < u64::from(m.n_experts) * u64::from(n_tokens) * 4
            || g.counts.size() < u64::from(m.n_experts) * 4
        {
            return Err(Error::Input("moe_ffn_grouped: scratch buffers too small".into()));
        }
        let p = m.params(rt, n_tokens, top_k, accumulate);
        let (Some(group), Some(combine)) = (&self.moe_group, &self.moe_combine) else {
            return Err(Error::Input("moe_ffn_grouped: the grouped kernels are built by ModelKernels::for_prefill".into()));
        };
        let bg = rt.bind_at(Kernel::ModelMoeGroup.label(), group, &[(0, &p), (4, sel), (6, &g.lists), (9, &g.counts)]);
        pass.dispatch(group, bg, [1, 1, 1]);
        let tiles = n_tokens.div_ceil(MATMUL_TILE);
        let pipe = pick(&self.moe_gate_up_tiled, m.gate_up.format)?;
        let bg = rt.bind_at(
            Kernel::ModelMoeGateUpTiled.label(),
            pipe,
            &[(0, &p), (1, &m.gate_up.buffer), (2, x), (3, act), (5, &m.offsets), (6, &g.lists), (8, wts), (9, &g.counts)],
        );
        pass.dispatch(pipe, bg, [m.max_size.div_ceil(MATMUL_TILE), tiles, m.n_experts]);
        let pipe = pick(&self.moe_down_tiled, down.format)?;
        let bg = rt.bind_at(
            Kernel::ModelMoeDownTiled.label(),
            pipe,
            &[(0, &p), (1, &down.buffer), (3, act), (5, &m.offsets), (6, &g.lists), (9, &g.counts), (10, &g.out)],
        );
        pass.dispatch(pipe, bg, [m.hidden.div_ceil(MATMUL_TILE), tiles, m.n_experts]);
        let bg = rt.bind_at(Kernel::ModelMoeCombine.label(), combine, &[(0, &p), (7, y), (10, &g.out)]);
        let (gx, gy) = expertkv_core::runtime::grid(n_tokens * m.hidden);
        pass.dispatch(combine, bg, [gx, gy, 1]);
        Ok(())
    }

    /// Rows `tokens[b]` of `w`, dequantised (y: `[n_tokens][cols]`).
    pub fn embed(
        &self,
        rt: &Runtime,
        pass: &mut impl DispatchSink,
        w: &GpuMatrix,
        tokens: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n_tokens: u32,
    ) -> Result<()> {
        let p = rt.uniform("model/embed params", &ModelOpParams { n_tokens, dim: w.cols, ..Default::default() });
        let pipe = pick(&self.embed, w.format)?;
        let bg = rt.bind_at(Kernel::ModelEmbed.label(), pipe, &[(0, &p), (2, y), (3, &w.buffer), (4, tokens)]);
        pass.dispatch(pipe, bg, [n_tokens, 1, 1]);
        Ok(())
    }

    /// `y[b] = x[b] / rms(x[b]) * g` over `dim` features.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm(
        &self,
        rt: &Runtime,
        pass: &mut impl DispatchSink,
        x: &wgpu::Buffer,
        g: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n_tokens: u32,
        dim: u32,
        eps: f32,
    ) {
        let p = rt.uniform("model/rmsnorm params", &ModelOpParams { n_tokens, dim, eps, ..Default::default() });
        let bg = rt.bind_at(Kernel::ModelRmsNorm.label(), &self.rmsnorm, &[(0, &p), (1, x), (2, y), (3, g)]);
        pass.dispatch(&self.rmsnorm, bg, [n_tokens, 1, 1]);
    }

    /// Rotate the queries `q` (`[n_tokens][q_heads][head_dim]`) and the keys `k`
    /// (`[n_tokens][k_heads][head_dim]`) in place by each token's position, in one dispatch:
    /// adjacent pairs, or with `neox` pairs half a head apart.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_qk(
        &self,
        rt: &Runtime,
        pass: &mut impl DispatchSink,
        q: &wgpu::Buffer,
        k: &wgpu::Buffer,
        positions: &wgpu::Buffer,
        n_tokens: u32,
        (q_heads, k_heads): (u32, u32),
        head_dim: u32,
        base: f32,
        neox: bool,
    ) {
        let mode = u32::from(neox);
        let p = rt.uniform(
            "model/rope_qk params",
            &ModelOpParams { n_tokens, dim: head_dim, n_heads: q_heads, n_heads2: k_heads, base, mode, ..Default::default() },
        );
        let bg = rt.bind_at(Kernel::ModelRopeQk.label(), &self.rope_qk, &[(0, &p), (2, q), (3, positions), (5, k)]);
        pass.dispatch(&self.rope_qk, bg, [(n_tokens * (q_heads + k_heads) * head_dim / 2).div_ceil(256), 1, 1]);
    }

    /// `y[b][i] = silu(g) * u * sigmoid(s[b])` with `g`, `u` side by side in `gu`
    /// (`[n_tokens][2][n]`) and `s` one gate logit per token: a shared expert's activations
    /// scaled by its gate.
    #[allow(clippy::too_many_arguments)]
    pub fn swiglu_gated(
        &self,
        rt: &Runtime,
        pass: &mut impl DispatchSink,
        gu: &wgpu::Buffer,
        gate: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n_tokens: u32,
        n: u32,
    ) {
        let p = rt.uniform("model/swiglu_gated params", &ModelOpParams { n_tokens, dim: n, ..Default::default() });
        let bg = rt.bind_at(Kernel::ModelSwigluGated.label(), &self.swiglu_gated, &[(0, &p), (1, gu), (2, y), (3, gate)]);
        pass.dispatch(&self.swiglu_gated, bg, [(n_tokens * n).div_ceil(256), 1, 1]);
    }

    /// `y += x` over `n` values.
    pub fn residual(&self, rt: &Runtime, pass: &mut impl DispatchSink, x: &wgpu::Buffer, y: &wgpu::Buffer, n: u32) {
        let p = rt.uniform("model/residual params", &ModelOpParams { n_tokens: 1, dim: n, ..Default::default() });
        let bg = rt.bind_at(Kernel::ModelResidual.label(), &self.residual, &[(0, &p), (1, x), (2, y)]);
        pass.dispatch(&self.residual, bg, [n.div_ceil(256), 1, 1]);
    }
}
