//! The one error type of `expertkv-core`.

/// Everything that can go wrong in the library. Messages name what is wrong and what to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no GPU adapter matches {wanted}; adapters seen: {seen}")]
    NoAdapter { wanted: String, seen: String },

    #[error("the device request to adapter `{adapter}` failed: {message}")]
    RequestDevice { adapter: String, message: String },

    #[error("invalid configuration: `{field}` = {value}: {reason}")]
    Config { field: &'static str, value: String, reason: String },

    #[error("kernel `{kernel}` failed to build: {message}")]
    Pipeline { kernel: &'static str, message: String },

    #[error("the GPU device was lost ({reason}): {message}. Cached state on it is gone; create a new Runtime and pool")]
    DeviceLost { reason: String, message: String },

    #[error("GPU error during {during}: {message}")]
    Gpu { during: String, message: String },

    #[error("reading back `{label}` failed: {message}")]
    Readback { label: String, message: String },

    #[error(
        "KV pool exhausted: the batch needs {needed} new pages but only {free} are free (pool of {total} pages); \
         nothing was written. Enlarge the pool (--pages), release sequences, or set an eviction budget"
    )]
    PoolExhausted { needed: u32, free: u32, total: u32 },

    #[error("bad input: {0}")]
    Input(String),

    #[error("{what} needs {needed} bytes, over this adapter's limit {limit_name} = {limit} bytes")]
    Limit { what: String, needed: u64, limit_name: &'static str, limit: u64 },

    /// A model file's bytes are not what its format says (truncated, out-of-range count, offset or
    /// type). `offset` is the byte in the file where the bad field starts.
    #[error("malformed GGUF file at byte {offset}: {what}")]
    Format { offset: u64, what: String },

    /// A well-formed model file that expertkv cannot use as asked: a missing or mistyped metadata
    /// key, an unsupported tensor type, architecture or tokenizer.
    #[error("model: {0}")]
    Model(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn config(field: &'static str, value: impl std::fmt::Display, reason: impl Into<String>) -> Self {
        Error::Config { field, value: value.to_string(), reason: reason.into() }
    }
}
