#![allow(clippy::unwrap_used, clippy::expect_used)]
//! GPU-vs-CPU tests of every kernel, on whatever adapter the machine has (Mesa lavapipe in CI).
//! Inputs are fresh random draws from printed seeds (`EXPERTKV_TEST_SEED` replays one);
//! outputs are poisoned before each run; decisions must match the CPU reference exactly.

mod common;

mod codec;

mod attend;
mod buffers;
mod copy;
mod errors;
mod evict;
mod model;
mod ops;
mod pipeline;
mod quest;
mod route;
mod shard;
