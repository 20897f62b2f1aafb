#![warn(missing_docs)]
//! expertkv-model: trained models from GGUF files, feeding the KV manager of `expertkv-core`.
//!
//! - [`gguf`]: the GGUF container (header, metadata, tensor table), its CPU dequantisation and a
//!   writer for test files; [`config`]: a model's hyper-parameters from its metadata;
//!   [`tokenizer`]: the vocabulary's byte-level BPE.
//! - [`weights`]: the weights of a Llama-family model (llama, qwen2, qwen3, qwen3moe, olmoe, qwen2moe) ([`Matrix`] keeps the stored bytes);
//!   [`cpu`]: the f32 reference forward pass with its own KV cache, over [`math`]'s building blocks; [`moe`]: MoEfication of its
//!   FFNs into routed groups of neurons, or a MoE file's own experts; [`moe_file`]: a
//!   MoEfication written as a MoE file; [`synthetic`]: small random
//!   models written as GGUF files for tests.
//! - [`text`]: text in, text out for one sequence; [`batch`]: many prompts continuously
//!   batched through one model of several sequences.
//! - [`ops`] and [`forward`]: the GPU forward pass ([`forward::GpuLlama`]), whose K/V go into
//!   `expertkv-core`'s paged pool and whose attention is the core's; [`gpu_data`]: the host
//!   mirrors of the model kernels' structs; [`reference`](mod@reference): the model kernels' CPU references.
//!
//! The GPU forward pass checks itself against [`CpuModel::forward_layers`] /
//! [`CpuModel::forward_probed`] and the building blocks ([`cpu::rms_norm`], [`cpu::rope_norm`],
//! [`cpu::matvec`]).

pub mod batch;
pub mod budget;
pub mod config;
pub mod cpu;
#[doc(hidden)]
pub mod exercise;
pub mod experts;
pub mod forward;
pub mod gguf;
pub mod gpu_data;
pub mod labels;
pub mod math;
mod matrix;
pub mod moe;
pub mod moe_file;
pub mod ops;
pub mod reference;
pub mod synthetic;
pub mod text;
pub mod tokenizer;
pub mod weights;

#[cfg(test)]
mod test_fixtures;

pub use config::{Gating, LlamaConfig};
pub use cpu::{CpuModel, KvCache, Probe, Stage};
pub use expertkv_core::{Error, Result};
pub use moe::{MoeConfig, MoeLayer, Moefication};
pub use synthetic::SyntheticModel;
pub use weights::{LayerWeights, LlamaWeights, LoadOptions, Matrix};
