//! Host mirrors of the structs the model kernels (`shaders/wgsl/model/`) share with the host.
//!
//! Each is `#[repr(C)]`, `Pod`, with explicit padding and a compile-time size check, and names the
//! WGSL struct it must match. Change both sides together.

use bytemuck::{Pod, Zeroable};

/// Must match `MatVecParams` in `shaders/wgsl/model/matvec.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct MatVecParams {
    /// Output features: rows of W and floats per token of y.
    pub rows: u32,
    /// Input features: columns of W and floats per token of x (a multiple of the format's block, 32
    /// or 256).
    pub cols: u32,
    /// Tokens in this call (in groups of [`crate::ops::MATVEC_MAX_TOKENS`], or tiles of
    /// [`crate::ops::MATMUL_TILE`] in the prefill's products).
    pub n_tokens: u32,
    /// 1: y += W x (a residual in the same pass), 0: y = W x.
    pub accumulate: u32,
    /// What the product reads: 0 x, 1 RMSNorm of x times a gain, 2 SwiGLU of x (`[b][2][cols]`).
    pub input: u32,
    /// Rows written to the first output (all rows for one output).
    pub split1: u32,
    /// Rows written to the second output; the rest go to the third.
    pub split2: u32,
    /// `input` 1: the epsilon added to the mean square.
    pub eps: f32,
}
const _: () = assert!(std::mem::size_of::<MatVecParams>() == 32);

/// Must match `MoeParams` in `shaders/wgsl/model/moe.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct MoeParams {
    /// FFN input and output features, floats per token of x and y (a multiple of 32).
    pub hidden: u32,
    /// Neurons of all experts together: the up rows start at row `ffn` of the gate/up matrix.
    pub ffn: u32,
    /// Experts chosen per token.
    pub top_k: u32,
    /// Neurons of the largest expert: slots per (token, choice) in the activation scratch.
    pub max_size: u32,
    /// Tokens in this call.
    pub n_tokens: u32,
    /// Experts of the layer; the offsets buffer has `n_experts + 1` entries.
    pub n_experts: u32,
    /// 1: `y +=` the FFN's output (the residual stream), 0: `y =` it.
    pub accumulate: u32,
    /// 1: a MoE file's experts in slots: the offsets buffer is a slot per expert (`[n_experts]`),
    /// expert e's gate rows `slot * max_size ..`, its up rows `ffn + slot * max_size ..` and its
    /// down rows `slot * hidden ..`; 0: MoEfied experts by offsets.
    pub slotted: u32,
}
const _: () = assert!(std::mem::size_of::<MoeParams>() == 32);

/// Must match `KvPackParams` in `shaders/wgsl/model/kv_pack.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct KvPackParams {
    /// Tokens whose K and V are packed.
    pub n_tokens: u32,
    /// K (or V) floats per token: kv_heads x head_dim.
    pub floats: u32,
    /// 1: f16 pairs, 0: f32 bits.
    pub f16: u32,
    /// Padding to 16 bytes; always 0.
    pub _pad: u32,
}
const _: () = assert!(std::mem::size_of::<KvPackParams>() == 16);

/// Must match `MoeTopkParams` in `shaders/wgsl/model/router.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct MoeTopkParams {
    /// Tokens to route, one invocation each.
    pub n_tokens: u32,
    /// Experts scored per token: the scores are `[n_tokens][n_experts]`.
    pub n_experts: u32,
    /// Experts chosen per token (1 to `n_experts`).
    pub top_k: u32,
    /// Where this call's choices start in the log buffer (words).
    pub log_offset: u32,
    /// `moe_weights`: 1 gives each chosen expert its share of the softmax over all experts, 0
    /// the softmax over the chosen.
    pub share: u32,
    /// Padding to 32 bytes; always 0.
    pub _pad1: u32,
    /// Padding to 32 bytes; always 0.
    pub _pad2: u32,
    /// Padding to 32 bytes; always 0.
    pub _pad3: u32,
}
const _: () = assert!(std::mem::size_of::<MoeTopkParams>() == 32);

/// Must match `ModelOpParams` in `shaders/wgsl/model/norm_rope.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct ModelOpParams {
    /// Tokens in this call (1 for residual, whose `dim` is the whole length).
    pub n_tokens: u32,
    /// rmsnorm and embed: features per token; swiglu: features of each half; rope: head_dim;
    /// residual: values.
    pub dim: u32,
    /// rope: heads per token; unused by the other kernels.
    pub n_heads: u32,
    /// rope: 0 rotates adjacent pairs (llama), 1 pairs half a head apart (NeoX: Qwen).
    pub mode: u32,
    /// rmsnorm: the epsilon added to the mean square.
    pub eps: f32,
    /// rope: the frequency base (`llama.rope.freq_base`).
    pub base: f32,
    /// rope_qk: heads of the second buffer (the keys).
    pub n_heads2: u32,
    /// Padding to 32 bytes; always 0.
    pub _pad2: u32,
}
const _: () = assert!(std::mem::size_of::<ModelOpParams>() == 32);
