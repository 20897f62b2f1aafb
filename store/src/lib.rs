//! expertkv's remote page tier: the K/V pages of a prompt's prefix kept in a key-value store
//! that several processes share, so that a second process given a prompt with the same prefix
//! fetches those pages instead of prefilling them.
//!
//! - [`PageStore`]: the one trait a backend implements (batched gets and puts, stats, clear).
//!   [`RedisStore`] talks to Redis or Valkey through the `redis` crate; [`MemoryStore`] keeps the
//!   values in this process (tests, and a store with no server).
//! - [`value`]: every value is a page of one layer (every KV head) with a header (format version,
//!   model hash, layer, shape, codec, token range and ids, checksum). A value that fails any
//!   check is refused and counted, never used.
//! - [`prefix`]: keys from the model file's hash and the chained hash of the prompt's token ids
//!   (one per full page, as LMCache keys its chunks), and [`PrefixStore`], which fetches the
//!   longest stored prefix into a model's pool and stores a prompt's full pages.
//!
//! A store that fails mid-run (the server killed, a timeout) is reported once and switched off:
//! the run goes on with its GPU and host tiers, and nothing already in the pool is lost.

pub mod prefix;
pub mod redis_store;
pub mod spill;
pub mod value;

pub use prefix::{PrefixStore, StoreOptions, StoreReport};
pub use redis_store::RedisStore;
pub use spill::StoreSpill;
pub use value::StoreCodec;

#[cfg(test)]
mod tests {
    use super::*;

    /// Namespaces that a SCAN pattern could reach past are refused; passwords never reach a
    /// message.
    #[test]
    fn namespaces_are_plain_names_and_passwords_are_redacted() {
        for ok in ["expertkv", "team-a_1", "x"] {
            assert!(check_namespace(ok).is_ok(), "{ok}");
        }
        for bad in ["", "*", "a?", "a[b]", "a:b", "a b", "a\\", &"n".repeat(65)] {
            assert!(check_namespace(bad).is_err(), "{bad}");
        }
        assert_eq!(redact("redis://:s3cret@127.0.0.1:6379/0"), "redis://***@127.0.0.1:6379/0");
        assert_eq!(redact("redis://127.0.0.1:6379/0"), "redis://127.0.0.1:6379/0");
        let mut m = MemoryStore::new();
        assert!(m.clear("*").is_err() && m.stats("a?").is_err());
    }
}

use std::collections::HashMap;

/// What can go wrong with a store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store's address could not be parsed or reached, or it refused the connection.
    #[error("the KV page store at {addr} could not be reached: {message}")]
    Connect {
        /// The address tried.
        addr: String,
        /// What the client said.
        message: String,
    },
    /// The store answered with an error, or the connection broke mid-request.
    #[error("the KV page store at {addr} failed: {message}")]
    Server {
        /// The store's address.
        addr: String,
        /// What the client said.
        message: String,
    },
    /// Bad options (a URL of another scheme, a zero TTL, a codec the pool cannot take).
    #[error("KV page store: {0}")]
    Options(String),
    /// The model or the pool refused (reading or restoring a prefix).
    #[error(transparent)]
    Model(#[from] expertkv_core::Error),
}

impl StoreError {
    /// As the model's error type (a model error as it was; the store's own as bad input).
    pub fn into_core(self) -> expertkv_core::Error {
        match self {
            StoreError::Model(e) => e,
            other => expertkv_core::Error::Input(other.to_string()),
        }
    }
}

/// Result of the store's operations.
pub type Result<T> = std::result::Result<T, StoreError>;

/// What a store holds under a namespace.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct StoreStats {
    /// The store's address.
    pub addr: String,
    /// Keys under the namespace.
    pub keys: u64,
    /// Bytes of their values.
    pub value_bytes: u64,
    /// Distinct model hashes among the keys.
    pub models: u64,
    /// Memory the server uses in all (Redis `used_memory`), where it says.
    pub server_used_bytes: Option<u64>,
    /// The server's memory bound (`maxmemory`, 0 for none), where it says.
    pub server_max_bytes: Option<u64>,
}

/// A key-value store of pages: batched, so a prefix's pages cross in a few round trips.
pub trait PageStore: Send {
    /// Where the store is (for messages).
    fn addr(&self) -> String;
    /// The values of `keys`, in order (`None` for a key the store does not hold).
    fn get_many(&mut self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>>;
    /// Which of `keys` the store holds.
    fn exists_many(&mut self, keys: &[String]) -> Result<Vec<bool>>;
    /// Store every (key, value), each expiring after `ttl_s` seconds if given.
    fn put_many(&mut self, items: &[(String, Vec<u8>)], ttl_s: Option<u64>) -> Result<()>;
    /// Delete `keys`; returns how many existed.
    fn remove_many(&mut self, keys: &[String]) -> Result<u64>;
    /// Keys and bytes under `namespace`.
    fn stats(&mut self, namespace: &str) -> Result<StoreStats>;
    /// Delete every key under `namespace`; returns how many.
    fn clear(&mut self, namespace: &str) -> Result<u64>;
}

/// Keys under `namespace` have this prefix.
pub fn namespace_prefix(namespace: &str) -> String {
    format!("{namespace}:")
}

/// A namespace is a plain name: not empty, at most 64 bytes, no `:` (the key separator) and no
/// glob or space characters (a SCAN pattern must not reach past it).
pub fn check_namespace(namespace: &str) -> Result<()> {
    let bad = |c: char| matches!(c, ':' | '*' | '?' | '[' | ']' | '\\') || c.is_whitespace() || c.is_control();
    if namespace.is_empty() || namespace.len() > 64 || namespace.chars().any(bad) {
        return Err(StoreError::Options(format!(
            "namespace `{namespace}`: give 1 to 64 characters without `:`, `*`, `?`, `[`, `]`, `\\` or spaces"
        )));
    }
    Ok(())
}

/// `url` with its password (if any) replaced by `***`, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s + 3 => format!("{}***{}", &url[..s + 3], &url[at..]),
        _ => url.to_string(),
    }
}

/// The model hash in a prefix key `{namespace}:{model}:...` (`None` for a spill key).
fn key_model(key: &str) -> Option<&str> {
    key.split(':').nth(1).filter(|m| *m != "spill")
}

/// A store in this process's memory (no expiry: `ttl_s` is ignored).
#[derive(Default)]
pub struct MemoryStore {
    map: HashMap<String, Vec<u8>>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every key, sorted.
    pub fn keys(&self) -> Vec<String> {
        let mut k: Vec<String> = self.map.keys().cloned().collect();
        k.sort();
        k
    }
}

impl PageStore for MemoryStore {
    fn addr(&self) -> String {
        "memory".into()
    }

    fn get_many(&mut self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>> {
        Ok(keys.iter().map(|k| self.map.get(k).cloned()).collect())
    }

    fn exists_many(&mut self, keys: &[String]) -> Result<Vec<bool>> {
        Ok(keys.iter().map(|k| self.map.contains_key(k)).collect())
    }

    fn put_many(&mut self, items: &[(String, Vec<u8>)], _ttl_s: Option<u64>) -> Result<()> {
        for (k, v) in items {
            self.map.insert(k.clone(), v.clone());
        }
        Ok(())
    }

    fn remove_many(&mut self, keys: &[String]) -> Result<u64> {
        Ok(keys.iter().filter(|k| self.map.remove(*k).is_some()).count() as u64)
    }

    fn stats(&mut self, namespace: &str) -> Result<StoreStats> {
        check_namespace(namespace)?;
        let p = namespace_prefix(namespace);
        let mine: Vec<(&String, &Vec<u8>)> = self.map.iter().filter(|(k, _)| k.starts_with(&p)).collect();
        let mut models: Vec<&str> = mine.iter().filter_map(|(k, _)| key_model(k)).collect();
        models.sort_unstable();
        models.dedup();
        Ok(StoreStats {
            addr: self.addr(),
            keys: mine.len() as u64,
            value_bytes: mine.iter().map(|(_, v)| v.len() as u64).sum(),
            models: models.len() as u64,
            server_used_bytes: None,
            server_max_bytes: None,
        })
    }

    fn clear(&mut self, namespace: &str) -> Result<u64> {
        check_namespace(namespace)?;
        let p = namespace_prefix(namespace);
        let before = self.map.len();
        self.map.retain(|k, _| !k.starts_with(&p));
        Ok((before - self.map.len()) as u64)
    }
}
