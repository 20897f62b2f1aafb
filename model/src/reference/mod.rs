//! Plain CPU references of the model kernels (no wgpu here); the GPU must match them within a
//! tolerance suited to each weight format's precision.

pub mod ops;
