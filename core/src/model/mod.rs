//! A trained Llama-architecture model on the CPU: its weights from a GGUF file
//! ([`weights`]), the f32 reference forward pass with its own KV cache ([`cpu`]), and
//! MoEfication of its FFNs into routed groups of neurons, or a MoE file's own experts ([`moe`]), and
//! small random models for tests ([`synthetic`]).
//!
//! A GPU forward pass loads [`LlamaWeights`] (the stored bytes of each [`Matrix`] go to the GPU),
//! and checks itself against [`CpuModel::forward_layers`] / [`CpuModel::forward_probed`] and the
//! building blocks ([`cpu::rms_norm`], [`cpu::rope_norm`], [`cpu::matvec`]).

pub mod cpu;
pub mod moe;
pub mod synthetic;
pub mod weights;

pub use cpu::{CpuModel, KvCache, Probe, Stage};
pub use moe::{Gating, MoeConfig, MoeLayer, Moefication};
pub use synthetic::SyntheticModel;
pub use weights::{LayerWeights, LlamaWeights, LoadOptions, Matrix};
