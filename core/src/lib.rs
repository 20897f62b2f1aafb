//! expertkv-core: the paged, sharded KV pool of MoE decoding on wgpu, its kernels, their CPU
//! references, the synthetic workload and the decode pipeline.

pub mod attend;
pub mod bench;
pub mod config;
pub mod digest;
pub mod error;
pub mod evict;
pub mod flexgen;
pub mod forward;
pub mod gguf;
pub mod gpu_data;
pub mod model;
pub mod ops;
pub mod pipeline;
pub mod plan;
pub mod pool;
pub mod probe;
pub mod quest;
pub mod reference;
pub mod rng;
pub mod route;
pub mod router_config;
pub mod runtime;
pub mod scheduler_config;
pub mod timer;
pub mod tokenizer;
pub mod trace;
pub mod workload;

pub use config::{KvDtype, PoolConfig, ShardMap};
pub use error::{Error, Result};
pub use runtime::{Runtime, RuntimeOptions, ShaderChecks, Tier};
