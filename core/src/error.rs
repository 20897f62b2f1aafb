//! The one error type of `expertkv-core`.

/// Everything that can go wrong in the library. Messages name what is wrong and what to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No adapter on the allowed backends matched [`crate::RuntimeOptions`].
    #[error("no GPU adapter matches {wanted}; adapters seen: {seen}")]
    NoAdapter {
        /// The backends (and adapter name filter, if any) that were asked for.
        wanted: String,
        /// Every adapter the instance listed, as "name (backend, device type)", or a hint to
        /// install a driver when it listed none.
        seen: String,
    },

    /// The chosen adapter refused to open a device with the requested features and limits.
    #[error("the device request to adapter `{adapter}` failed: {message}")]
    RequestDevice {
        /// The adapter's name.
        adapter: String,
        /// wgpu's reason.
        message: String,
    },

    /// A configuration value is out of range or unknown; caught before anything touches the GPU.
    #[error("invalid configuration: `{field}` = {value}: {reason}")]
    Config {
        /// The offending field or option, as the user spells it (`head_dim`, `codec.rank`, `backend`).
        field: &'static str,
        /// The value given, as text.
        value: String,
        /// What the field allows.
        reason: String,
    },

    /// A kernel's pipeline could not be built: a `//!define` did not resolve, the device lacks a
    /// feature it needs (subgroups, shader-f16), or WGSL validation failed.
    #[error("kernel `{kernel}` failed to build: {message}")]
    Pipeline {
        /// The kernel's label (`attend/split_subgroup`, say).
        kernel: &'static str,
        /// Why it failed to build.
        message: String,
    },

    /// The device was lost (driver reset, destroyed device); everything on it is gone.
    #[error("the GPU device was lost ({reason}): {message}. Cached state on it is gone; create a new Runtime and pool")]
    DeviceLost {
        /// wgpu's [`wgpu::DeviceLostReason`], in its `Debug` form.
        reason: String,
        /// The driver's message (or a note that it gave none).
        message: String,
    },

    /// A GPU failure outside any pipeline build: an uncaptured validation error, an allocation
    /// that ran out of memory, a failed wait, no timestamp queries for a benchmark, or GPU
    /// results that disagree with the CPU reference.
    #[error("GPU error during {during}: {message}")]
    Gpu {
        /// The operation that was running (`append/append`, `KV pool allocation`, `wait`).
        during: String,
        /// wgpu's error text (several uncaptured errors joined with "; "), or what the check found.
        message: String,
    },

    /// Mapping a staging buffer to read GPU data back to the host failed.
    #[error("reading back `{label}` failed: {message}")]
    Readback {
        /// What was being read back.
        label: String,
        /// wgpu's map error.
        message: String,
    },

    /// An append needed more free raw pages than the pool had; the GPU refused the whole batch.
    #[error(
        "KV pool exhausted: the batch needs {needed} new pages but only {free} are free (pool of {total} pages); \
         nothing was written. Enlarge the pool (--pages), release sequences, or set an eviction budget"
    )]
    PoolExhausted {
        /// New pages the batch needed, as the caller of [`crate::KvPool::check_errors`] estimated
        /// it (0 when the caller does not know).
        needed: u32,
        /// Raw pages on the free stack when the batch was refused.
        free: u32,
        /// Raw pages in the pool (`PoolConfig::n_pages`).
        total: u32,
    },

    /// An argument that does not fit the object it was given to (wrong lengths, out-of-range
    /// layer or sequence, a call out of order); the text says which and why.
    #[error("bad input: {0}")]
    Input(String),

    /// A buffer would exceed one of the adapter's limits; a smaller configuration may fit.
    #[error("{what} needs {needed} bytes, over this adapter's limit {limit_name} = {limit} bytes")]
    Limit {
        /// The buffer or object that does not fit (`one KV page`, `page lists`).
        what: String,
        /// Bytes it needs.
        needed: u64,
        /// The wgpu limit it exceeds (`max_storage_buffer_binding_size`).
        limit_name: &'static str,
        /// That limit on this adapter, in bytes.
        limit: u64,
    },

    /// A device handed over with a limit below what the kernels need ([`crate::Runtime::from_device`]).
    #[error(
        "the device's {limit_name} is {has}, below the {needed} expertkv's kernels need (WebGPU's default): \
         create it with Runtime::device_descriptor(&adapter) or the adapter's own limits"
    )]
    DeviceLimit {
        /// The wgpu limit (`max_storage_buffers_per_shader_stage`).
        limit_name: &'static str,
        /// What the device was created with.
        has: u64,
        /// The least the kernels need.
        needed: u64,
    },

    /// A model file's bytes are not what its format says (truncated, out-of-range count, offset or
    /// type). `offset` is the byte in the file where the bad field starts.
    #[error("malformed GGUF file at byte {offset}: {what}")]
    Format {
        /// Byte offset in the file of the bad field.
        offset: u64,
        /// What is wrong there, with the context it was read in.
        what: String,
    },

    /// A well-formed model file that expertkv cannot use as asked: a missing or mistyped metadata
    /// key, an unsupported tensor type, architecture or tokenizer.
    #[error("model: {0}")]
    Model(String),
}

/// `std::result::Result` with [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An [`Error::Config`] for `field`, with `value` written through `Display`.
    pub fn config(field: &'static str, value: impl std::fmt::Display, reason: impl Into<String>) -> Self {
        Error::Config { field, value: value.to_string(), reason: reason.into() }
    }
}
