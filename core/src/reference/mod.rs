//! Plain CPU references of every kernel (no wgpu here). The GPU must match them: decisions
//! (placements, pages, victims) exactly, floats within a tolerance suited to their precision.

pub mod attend;
pub mod codec;
pub mod evict;
pub mod ops;
pub mod pool;
pub mod quest;
pub mod route;

pub use attend::{
    AttentionOutput, attend_decode, attend_decode_int8_query, attend_decode_int8_query_code_part_over, attend_decode_int8_query_over,
};
pub use pool::{NewToken, PoolModel};
