//! Plain CPU references of every kernel (no wgpu here), one file per stage of the decode step.
//! The GPU must match them: decisions (placements, pages, victims) exactly, floats within a
//! tolerance suited to their precision. The references read the host's inputs (token records,
//! K/V words) through their own decoders, never through the host code they check.

pub mod append;
pub mod attend;
pub mod compress;
pub mod evict;
pub mod quest;
pub mod recall;
pub mod route;
pub mod tier;
pub mod words;

pub use append::PoolModel;
pub use attend::{
    AttentionOutput, attend_decode, attend_decode_int8_query, attend_decode_int8_query_code_part_over, attend_decode_int8_query_over,
};
