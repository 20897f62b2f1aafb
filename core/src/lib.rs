#![warn(missing_docs)]
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
//!
//! # The pool as the KV cache of a forward pass
//!
//! Append each new token's K/V (with its experts, for the shard map), rebuild the page lists,
//! attend, read the output; the CPU reference gives the same answer. (The test suite runs this
//! example; without a GPU, Mesa lavapipe serves.)
//!
//! ```
//! use expertkv_core::attend::{AttendOptions, Attention};
//! use expertkv_core::append::format::encode_values;
//! use expertkv_core::reference::{PoolModel, attend_decode};
//! use expertkv_core::{KvPool, NewToken, PoolConfig, Runtime, RuntimeOptions, ShardMap};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let rt = pollster::block_on(Runtime::new(RuntimeOptions::from_env()?))?;
//! let cfg = PoolConfig {
//!     kv_heads: 2,
//!     head_dim: 64,
//!     n_pages: 64,
//!     max_seqs: 1,
//!     n_shards: 2,
//!     shard_map: ShardMap::Pikv { n_tok: 2, n_exp: 2 },
//!     ..Default::default()
//! };
//! let mut pool = pollster::block_on(KvPool::new(&rt, cfg.clone()))?;
//!
//! // 40 tokens of sequence 0 at layer 0, each routed to two experts; K then V per token,
//! // kv_heads x head_dim values each, stored as the pool's f16 words.
//! let tokens: Vec<NewToken> = (0..40)
//!     .map(|p| NewToken { layer: 0, seq: 0, position: p, experts: vec![p % 4, 4 + p % 3], gates: vec![0.7, 0.3] })
//!     .collect();
//! let values: Vec<f32> = (0..40 * 2 * 2 * 64).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
//! let mut kv_words = Vec::new();
//! encode_values(&values, cfg.dtype, &mut kv_words);
//! pool.append(&rt, &tokens, &kv_words, 0)?;
//! pool.gather(&rt)?;
//!
//! // Decode attention for one query token: 4 query heads per KV head.
//! let attn = pollster::block_on(Attention::new(&rt, &pool, AttendOptions { group: 4, n_seqs: 1, ..Default::default() }))?;
//! let queries: Vec<f32> = (0..attn.q_heads() * cfg.head_dim).map(|i| ((i * 13 % 29) as f32 / 14.0) - 1.0).collect();
//! attn.set_queries(&rt, &queries)?;
//! attn.run(&rt, 0, 0)?;
//! let out = pollster::block_on(attn.read_output(&rt))?;
//!
//! // The same cache on the CPU, in f64.
//! let mut model = PoolModel::new(&cfg);
//! model.append(&tokens, &kv_words, 0)?;
//! let want = attend_decode(&model, 0, 1, &queries, 4, f64::from(attn.scale()));
//! for (got, want) in out.iter().zip(&want.out) {
//!     assert!((f64::from(*got) - want).abs() < 1e-3, "{got} vs {want}");
//! }
//! # Ok(())
//! # }
//! ```

pub mod append;
pub mod attend;
pub mod bench;
pub mod compress;
pub mod config;
#[cfg(not(target_arch = "wasm32"))]
pub mod devices;
pub mod digest;
pub mod error;
pub mod evict;
pub mod gpu_data;
mod page_passes;
pub mod pipeline;
pub mod plan;
pub mod reference;
pub mod rng;
pub mod route;
pub mod runtime;
pub mod step;
pub mod trace;
pub mod workload;

pub use append::KvPool;
pub use append::format::NewToken;
pub use config::{KvDtype, PoolConfig, ShardMap};
pub use error::{Error, Result};
pub use runtime::{Runtime, RuntimeOptions, ShaderChecks, Tier};
