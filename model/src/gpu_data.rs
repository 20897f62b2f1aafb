//! Host mirrors of the structs the model kernels (`shaders/wgsl/model/`) share with the host.
//!
//! Each is `#[repr(C)]`, `Pod`, with explicit padding and a compile-time size check, and names the
//! WGSL struct it must match. Change both sides together.

use bytemuck::{Pod, Zeroable};

/// Must match `MatVecParams` in `shaders/wgsl/model/matvec.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct MatVecParams {
    pub rows: u32,
    pub cols: u32,
    pub n_tokens: u32,
    /// 1: y += W x (a residual in the same pass), 0: y = W x.
    pub accumulate: u32,
}
const _: () = assert!(std::mem::size_of::<MatVecParams>() == 16);

/// Must match `MoeParams` in `shaders/wgsl/model/moe.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct MoeParams {
    pub hidden: u32,
    pub ffn: u32,
    pub top_k: u32,
    pub max_size: u32,
    pub n_tokens: u32,
    pub n_experts: u32,
    /// 1: `y +=` the FFN's output (the residual stream), 0: `y =` it.
    pub accumulate: u32,
    pub _pad1: u32,
}
const _: () = assert!(std::mem::size_of::<MoeParams>() == 32);

/// Must match `KvPackParams` in `shaders/wgsl/model/kv_pack.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct KvPackParams {
    pub n_tokens: u32,
    /// K (or V) floats per token: kv_heads x head_dim.
    pub floats: u32,
    /// 1: f16 pairs, 0: f32 bits.
    pub f16: u32,
    pub _pad: u32,
}
const _: () = assert!(std::mem::size_of::<KvPackParams>() == 16);

/// Must match `MoeTopkParams` in `shaders/wgsl/model/router.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct MoeTopkParams {
    pub n_tokens: u32,
    pub n_experts: u32,
    pub top_k: u32,
    /// Where this call's choices start in the log buffer (words).
    pub log_offset: u32,
}
const _: () = assert!(std::mem::size_of::<MoeTopkParams>() == 16);

/// Must match `ModelOpParams` in `shaders/wgsl/model/norm_rope.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct ModelOpParams {
    pub n_tokens: u32,
    pub dim: u32,
    pub n_heads: u32,
    pub _pad0: u32,
    pub eps: f32,
    pub base: f32,
    pub _pad1: u32,
    pub _pad2: u32,
}
const _: () = assert!(std::mem::size_of::<ModelOpParams>() == 32);
