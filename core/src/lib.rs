//! expertkv-core: the KV manager of MoE decoding on wgpu. The folders follow the decode step, and
//! each names its kernels (`shaders/wgsl/<stage>/`), its CPU reference (`reference/<stage>.rs`)
//! and its tests (`tests/tests/gpu/<stage>.rs`):
//!
//! - [`route`]: top-k expert routing with the cache's statistics (seven routers);
//! - [`append`]: the paged, sharded KV pool and its appends ([`append::KvPool`]), with the token
//!   record and K/V word formats ([`append::format`]);
//! - [`compress`]: page codecs (int8/int4 pages, low-rank and LoRA bases);
//! - [`attend`]: split-K decode attention over the pool (flash-decoding) and the attention mass;
//! - [`evict`]: schedulers (H2O, StreamingLLM, LRU, LRU+, AdaKV, DuoAttention), thresholds,
//!   EKVA's expert budgets, QUEST page selection and FlexGen's host tier.
//!
//! Around them: [`runtime`] (device, capability tier, pipelines, timers), [`pipeline`] (the decode
//! step over a [`workload`]), [`trace`] (record and replay), [`plan`] (capacity planning), [`bench`](mod@bench)
//! and [`reference`](mod@reference) (the CPU oracle of every kernel, and nothing else).

pub mod append;
pub mod attend;
pub mod bench;
pub mod compress;
pub mod config;
pub mod digest;
pub mod error;
pub mod evict;
pub mod gpu_data;
pub mod pipeline;
pub mod plan;
pub mod reference;
pub mod rng;
pub mod route;
pub mod runtime;
pub mod trace;
pub mod workload;

pub use append::KvPool;
pub use append::format::NewToken;
pub use config::{KvDtype, PoolConfig, ShardMap};
pub use error::{Error, Result};
pub use runtime::{Runtime, RuntimeOptions, ShaderChecks, Tier};
