#![allow(clippy::unwrap_used, clippy::expect_used)]
//! GPU-vs-CPU tests of every kernel, on whatever adapter the machine has (Mesa lavapipe in CI).
//! Inputs are fresh random draws from printed seeds (`EXPERTKV_TEST_SEED` replays one);
//! outputs are poisoned before each run; decisions must match the CPU reference exactly.

mod common;

// By stage of the decode step, as shaders/wgsl/ and core/src/reference/.
mod append;
mod attend;
mod compress;
mod devices;
mod evict;
mod quest;
mod recall;
mod route;

// The decode step as a whole, the model's kernels and forward pass, and the runtime's edges.
mod batch;
mod buffers;
mod churn;
mod copy;
mod errors;
mod experts;
mod faults;
mod labels;
mod model;
mod ops;
mod pipeline;
mod prefill;
mod runtime;
mod store;
