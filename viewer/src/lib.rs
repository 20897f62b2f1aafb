#![warn(missing_docs)]
//! egui panels that draw expertkv pipeline state from snapshots of `expertkv-core` data.
//!
//! - [`state`]: the plain data the panels draw ([`Snapshot`] of one step, [`ViewerState`] with a
//!   ring of recent [`StepReport`](expertkv_core::pipeline::StepReport)s) and the derived grids.
//! - [`capture`]: fills a [`Snapshot`] from a live [`Pipeline`](expertkv_core::pipeline::Pipeline)
//!   through its public readers (router statistics per (layer, expert), shard rings, pool counters).
//! - [`panels`]: expert cache heat (routing frequency, KV occupancy, miss rate per layer and
//!   expert), shard occupancy (per shard, per ring, per tier), evictions over time, the EKVA
//!   budget split, per-stage GPU step time, a replayed trace beside its recording.
//! - [`controls`] and [`app`]: the whole window ([`Viewer`]) and the requests it makes of
//!   whatever drives the pipeline (pause, step, restart, rebuild with a new router, scheduler,
//!   codec, budget or allocator). The native shell is `expertkv view` (eframe, wgpu renderer).

pub mod app;
pub mod capture;
pub mod controls;
pub mod panels;
pub mod state;

pub use app::Viewer;
pub use controls::{ConfigEdit, Controls, Request};
pub use state::{Event, HeatMode, RunInfo, Snapshot, Source, ViewerState};
