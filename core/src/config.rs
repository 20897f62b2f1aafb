//! Configuration of the paged, sharded KV pool, validated before anything touches the GPU.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::gpu_data::{Geometry, meta, shard_maps};

/// How K and V are stored in a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    F32,
    /// IEEE half, stored as packed pairs in u32 words (read with `unpack2x16float`, no feature needed).
    F16,
}

impl KvDtype {
    pub fn bytes(self) -> u32 {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(KvDtype::F32),
            "f16" => Ok(KvDtype::F16),
            other => Err(Error::config("dtype", other, "allowed values: f16, f32")),
        }
    }
}

/// Which shard of a (layer, sequence) receives a token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardMap {
    /// PiKV: s(t, e) = (t mod n_tok) XOR (e mod n_exp), e the token's top-1 expert.
    Pikv { n_tok: u32, n_exp: u32 },
    /// s = e mod N: every expert's tokens together.
    ByExpert,
    /// s = (t / block) mod N: runs of consecutive tokens together.
    ByTokenBlock { block: u32 },
}

impl ShardMap {
    pub fn name(self) -> &'static str {
        match self {
            ShardMap::Pikv { .. } => "pikv",
            ShardMap::ByExpert => "expert",
            ShardMap::ByTokenBlock { .. } => "token-block",
        }
    }

    /// The default map of a given name for `n_shards` shards.
    pub fn parse(name: &str, n_shards: u32) -> Result<Self> {
        match name {
            "pikv" => Ok(ShardMap::Pikv { n_tok: n_shards, n_exp: n_shards }),
            "expert" => Ok(ShardMap::ByExpert),
            "token-block" => Ok(ShardMap::ByTokenBlock { block: 64 }),
            other => Err(Error::config("shard_map", other, "allowed values: pikv, expert, token-block")),
        }
    }

    /// CPU twin of `shard_from_token_expert` in `common/pool.wgsl`.
    pub fn shard_from_token_expert(self, n_shards: u32, position: u32, expert: u32) -> u32 {
        match self {
            ShardMap::Pikv { n_tok, n_exp } => (position % n_tok) ^ (expert % n_exp),
            ShardMap::ByExpert => expert % n_shards,
            ShardMap::ByTokenBlock { block } => (position / block) % n_shards,
        }
    }
}

/// Shape and capacity of a KV pool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PoolConfig {
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Slots (tokens) per page.
    pub page_size: u32,
    pub dtype: KvDtype,
    /// Pages in the whole pool (all layers, sequences and shards draw from it).
    pub n_pages: u32,
    pub max_seqs: u32,
    /// Shards per (layer, sequence).
    pub n_shards: u32,
    /// Page entries per shard ring; a full ring recycles its oldest page.
    pub ring_capacity: u32,
    /// Experts and gates kept per slot.
    pub top_k: u32,
    pub shard_map: ShardMap,
    /// Cap on one pool buffer's size; `None` uses the adapter's storage-binding limit.
    pub max_buffer_bytes: Option<u64>,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            layers: 1,
            kv_heads: 8,
            head_dim: 128,
            page_size: 16,
            dtype: KvDtype::F16,
            n_pages: 1024,
            max_seqs: 8,
            n_shards: 8,
            ring_capacity: 64,
            top_k: 2,
            shard_map: ShardMap::Pikv { n_tok: 8, n_exp: 8 },
            max_buffer_bytes: None,
        }
    }
}

pub const MAX_HEAD_DIM: u32 = 256;
pub const MAX_PAGE_SIZE: u32 = 64;
pub const MAX_SHARDS: u32 = 256;
pub const MAX_TOP_K: u32 = 8;

impl PoolConfig {
    /// u32 words of one token's K (or V) vector for one head.
    pub fn vec_words(&self) -> u32 {
        match self.dtype {
            KvDtype::F16 => self.head_dim / 2,
            KvDtype::F32 => self.head_dim,
        }
    }

    /// Bytes of one page: K and V of one KV head for `page_size` slots (pages are head-major).
    pub fn page_bytes(&self) -> u64 {
        2 * u64::from(self.page_size) * u64::from(self.vec_words()) * 4
    }

    /// Bytes of K and V of one token of one layer.
    pub fn token_kv_bytes(&self) -> u64 {
        2 * u64::from(self.kv_heads) * u64::from(self.head_dim) * u64::from(self.dtype.bytes())
    }

    pub fn meta_words(&self) -> u32 {
        meta::words(self.top_k as usize) as u32
    }

    /// Shard rings: one per (layer, sequence, KV head, shard).
    pub fn n_keys(&self) -> u32 {
        self.n_lists() * self.n_shards
    }

    /// Page lists: one per (layer, sequence, KV head).
    pub fn n_lists(&self) -> u32 {
        self.layers * self.max_seqs * self.kv_heads
    }

    pub fn max_pages_per_seq(&self) -> u32 {
        self.n_shards * self.ring_capacity
    }

    /// Check every field on its own and in combination; the error names the field.
    pub fn validate(&self) -> Result<()> {
        let pos = |field: &'static str, v: u32| {
            if v == 0 { Err(Error::config(field, v, "must be at least 1")) } else { Ok(()) }
        };
        pos("layers", self.layers)?;
        pos("kv_heads", self.kv_heads)?;
        pos("max_seqs", self.max_seqs)?;
        pos("n_pages", self.n_pages)?;
        pos("top_k", self.top_k)?;
        let align = match self.dtype {
            KvDtype::F16 => 8,
            KvDtype::F32 => 4,
        };
        if self.head_dim == 0 || self.head_dim > MAX_HEAD_DIM || !self.head_dim.is_multiple_of(align) {
            return Err(Error::config(
                "head_dim",
                self.head_dim,
                format!("must be a multiple of {align} for {} storage, at most {MAX_HEAD_DIM}", self.dtype.name()),
            ));
        }
        if self.page_size == 0 || self.page_size > MAX_PAGE_SIZE {
            return Err(Error::config("page_size", self.page_size, format!("must be in 1..={MAX_PAGE_SIZE}")));
        }
        if !self.n_shards.is_power_of_two() || self.n_shards > MAX_SHARDS {
            return Err(Error::config("n_shards", self.n_shards, format!("must be a power of two, at most {MAX_SHARDS}")));
        }
        if self.ring_capacity < 2 {
            return Err(Error::config("ring_capacity", self.ring_capacity, "must be at least 2 pages"));
        }
        if self.top_k > MAX_TOP_K {
            return Err(Error::config("top_k", self.top_k, format!("must be at most {MAX_TOP_K}")));
        }
        match self.shard_map {
            ShardMap::Pikv { n_tok, n_exp } => {
                for (field, v) in [("shard_map.n_tok", n_tok), ("shard_map.n_exp", n_exp)] {
                    if !v.is_power_of_two() || v > self.n_shards {
                        return Err(Error::config(
                            field,
                            v,
                            format!("must be a power of two at most n_shards = {} so that the XOR stays a shard", self.n_shards),
                        ));
                    }
                }
            }
            ShardMap::ByExpert => {}
            ShardMap::ByTokenBlock { block } => pos("shard_map.block", block)?,
        }
        // Every index the kernels compute must fit in u32.
        let keys = u64::from(self.layers) * u64::from(self.max_seqs) * u64::from(self.kv_heads) * u64::from(self.n_shards);
        if keys * u64::from(self.ring_capacity) > u64::from(u32::MAX) {
            return Err(Error::config(
                "ring_capacity",
                self.ring_capacity,
                "layers x max_seqs x kv_heads x n_shards x ring_capacity overflows u32",
            ));
        }
        let slots = u64::from(self.n_pages) * u64::from(self.page_size) * u64::from(self.meta_words());
        if slots > u64::from(u32::MAX) {
            return Err(Error::config("n_pages", self.n_pages, "slot metadata index overflows u32; use fewer pages"));
        }
        if let Some(b) = self.max_buffer_bytes
            && b < self.page_bytes()
        {
            return Err(Error::config("max_buffer_bytes", b, format!("smaller than one page ({} bytes)", self.page_bytes())));
        }
        Ok(())
    }

    /// Pages each pool buffer holds under a per-buffer byte cap (also kept under 4 GiB of words).
    pub fn pages_per_buffer(&self, cap_bytes: u64) -> u32 {
        let cap = self.max_buffer_bytes.map_or(cap_bytes, |b| b.min(cap_bytes));
        let by_bytes = cap / self.page_bytes();
        let by_index = u64::from(u32::MAX) / (u64::from(self.page_words()) + 1);
        by_bytes.min(by_index).min(u64::from(self.n_pages)) as u32
    }

    pub fn page_words(&self) -> u32 {
        2 * self.page_size * self.vec_words()
    }

    pub fn geometry(&self, pages_per_buffer: u32) -> Geometry {
        let (shard_map, n_tok, n_exp, token_block) = match self.shard_map {
            ShardMap::Pikv { n_tok, n_exp } => (shard_maps::PIKV, n_tok, n_exp, 1),
            ShardMap::ByExpert => (shard_maps::EXPERT, 1, 1, 1),
            ShardMap::ByTokenBlock { block } => (shard_maps::TOKEN_BLOCK, 1, 1, block),
        };
        Geometry {
            page_size: self.page_size,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            vec_words: self.vec_words(),
            page_words: self.page_words(),
            n_pages: self.n_pages,
            pages_per_buffer,
            ring_capacity: self.ring_capacity,
            n_shards: self.n_shards,
            max_seqs: self.max_seqs,
            layers: self.layers,
            top_k: self.top_k,
            shard_map,
            n_tok,
            n_exp,
            token_block,
            meta_words: self.meta_words(),
            max_pages_per_seq: self.max_pages_per_seq(),
            f16_kv: u32::from(self.dtype == KvDtype::F16),
            _pad0: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid() {
        PoolConfig::default().validate().unwrap();
    }

    #[test]
    fn bad_fields_are_named() {
        let mut c = PoolConfig { head_dim: 100, ..Default::default() };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("head_dim"), "{e}");
        c.head_dim = 128;
        c.n_shards = 6;
        assert!(c.validate().unwrap_err().to_string().contains("n_shards"));
        c.n_shards = 8;
        c.shard_map = ShardMap::Pikv { n_tok: 16, n_exp: 8 };
        assert!(c.validate().unwrap_err().to_string().contains("n_tok"));
    }

    #[test]
    fn pikv_map_stays_in_range() {
        let m = ShardMap::Pikv { n_tok: 8, n_exp: 4 };
        for t in 0..100 {
            for e in 0..64 {
                assert!(m.shard_from_token_expert(8, t, e) < 8);
            }
        }
    }

    #[test]
    fn page_bytes_match_layout() {
        let c = PoolConfig::default();
        // 2 (K, V) x 16 slots x 128 dims x 2 bytes: one head
        assert_eq!(c.page_bytes(), 2 * 16 * 128 * 2);
        assert_eq!(u64::from(c.page_words()) * 4, c.page_bytes());
    }
}
