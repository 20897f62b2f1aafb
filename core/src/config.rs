//! Configuration of the paged, sharded KV pool, validated before anything touches the GPU.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::gpu_data::{Geometry, meta, shard_maps};

/// How K and V are stored in a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// IEEE single, one value per u32 word.
    F32,
    /// IEEE half, stored as packed pairs in u32 words (read with `unpack2x16float`, no feature needed).
    F16,
}

impl KvDtype {
    /// Bytes per stored value: 4 or 2.
    pub fn bytes(self) -> u32 {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
        }
    }

    /// The name `parse` reads: `f32` or `f16`.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
        }
    }

    /// `f32` or `f16`; anything else is an [`Error::Config`].
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(KvDtype::F32),
            "f16" => Ok(KvDtype::F16),
            other => Err(Error::config("dtype", other, "allowed values: f16, f32")),
        }
    }
}

/// Which shard of a (layer, sequence) receives a token (each (layer, sequence, KV head) has
/// one ring per shard).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardMap {
    /// PiKV: s(t, e) = (t mod n_tok) XOR (e mod n_exp), e the token's top-1 expert.
    Pikv {
        /// Token-position modulus; a power of two, at most `n_shards`.
        n_tok: u32,
        /// Expert-id modulus; a power of two, at most `n_shards`.
        n_exp: u32,
    },
    /// s = e mod N: every expert's tokens together.
    ByExpert,
    /// s = (t / block) mod N: runs of consecutive tokens together.
    ByTokenBlock {
        /// Consecutive token positions per block (at least 1; 64 from `parse`).
        block: u32,
    },
}

impl ShardMap {
    /// The name `parse` reads: `pikv`, `expert` or `token-block`.
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
    /// Transformer layers the pool holds K/V for (default 1).
    pub layers: u32,
    /// K/V heads per layer (default 8); query heads share them in groups.
    pub kv_heads: u32,
    /// Dimensions per head (default 128): at most [`MAX_HEAD_DIM`], a multiple of 8 for f16
    /// storage and of 4 for f32.
    pub head_dim: u32,
    /// Slots (tokens) per page.
    pub page_size: u32,
    /// How raw pages store K and V (default f16; the codecs need f16).
    pub dtype: KvDtype,
    /// Pages in the whole pool (all layers, sequences and shards draw from it).
    pub n_pages: u32,
    /// Sequences the pool has page lists and rings for (default 8); sequence ids are `0..max_seqs`.
    pub max_seqs: u32,
    /// Shards per (layer, sequence): one ring each per KV head.
    pub n_shards: u32,
    /// Page entries per shard ring; a full ring recycles its oldest page.
    pub ring_capacity: u32,
    /// Experts and gates kept per slot.
    pub top_k: u32,
    /// Which shard of its (layer, sequence, KV head) each token goes to.
    pub shard_map: ShardMap,
    /// Cap on one pool buffer's size; `None` uses the adapter's storage-binding limit.
    pub max_buffer_bytes: Option<u64>,
    /// How full pages (not a ring's newest) are stored; `Codec::None` keeps them raw.
    #[serde(default)]
    pub codec: Codec,
    /// Compressed pages (a second pool; ids follow the raw pages').
    #[serde(default)]
    pub codec_pages: u32,
}

/// Page codecs: a page that fills (and is no longer a ring's newest) is encoded on the GPU into a
/// compressed page of the codec's size and the raw page freed; attention decodes in-kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "name", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Codec {
    /// No compression: full pages stay raw.
    #[default]
    None,
    /// KIVI 8-bit: keys per channel (over the page's slots), values per token in groups of
    /// `group` dimensions; min and scale as f16.
    Int8 {
        /// Value dimensions per (min, scale) group; must divide `head_dim` (32 from `parse`).
        group: u32,
    },
    /// KIVI 4-bit, same layout with 4-bit codes.
    Int4 {
        /// Value dimensions per (min, scale) group; must divide `head_dim` (32 from `parse`).
        group: u32,
    },
    /// FastV as the PiKV article describes it: keys keep their first `keep` dimensions.
    FastvDims {
        /// Key dimensions kept: even, in 2..=`head_dim` (32 from `parse`).
        keep: u32,
    },
    /// Truncated SVD: a rank-`rank` orthonormal basis U of each (layer, KV head)'s key and value
    /// subspace, computed on the GPU from a calibration window (the d x d Gram matrix and
    /// subspace iteration); pages keep the coefficients U^T x as f16. Attention scores against
    /// U^T q and reconstructs values with U, in-kernel.
    LowRank {
        /// Basis vectors per (layer, KV head), for K and for V: even, at most `head_dim - 2` and
        /// [`MAX_RANK`] (32 from `parse`).
        rank: u32,
    },
    /// LoRA-style: one down/up projection pair per layer (shared by its KV heads), fitted once
    /// from the layer's pooled calibration window. With an orthonormal down projection the
    /// least-squares up projection is its transpose, so the pair is (U^T, U).
    Lora {
        /// Rank of each layer's projection pair, for K and for V: even, at most `head_dim - 2`
        /// and [`MAX_RANK`] (32 from `parse`).
        rank: u32,
    },
}

/// The codec names [`Codec::parse`] accepts, for help and error messages.
pub const CODEC_NAMES: &str = "none, int8, int4, fastv-dims, low-rank, lora";

/// `Geometry::codec`; must match `CODEC_*` in `shaders/wgsl/common/compress.wgsl`.
pub mod codec_ids {
    /// [`super::Codec::None`]: no compressed pages.
    pub const NONE: u32 = 0;
    /// [`super::Codec::Int8`].
    pub const INT8: u32 = 1;
    /// [`super::Codec::Int4`].
    pub const INT4: u32 = 2;
    /// [`super::Codec::FastvDims`].
    pub const FASTV_DIMS: u32 = 3;
    /// [`super::Codec::LowRank`].
    pub const LOW_RANK: u32 = 4;
    /// [`super::Codec::Lora`].
    pub const LORA: u32 = 5;
}

impl Codec {
    /// The codec's name as `parse` reads it (`int8`, `low-rank`, ...), without parameters.
    pub fn name(&self) -> &'static str {
        match self {
            Codec::None => "none",
            Codec::Int8 { .. } => "int8",
            Codec::Int4 { .. } => "int4",
            Codec::FastvDims { .. } => "fastv-dims",
            Codec::LowRank { .. } => "low-rank",
            Codec::Lora { .. } => "lora",
        }
    }

    /// The codec's id in [`codec_ids`], as kernels see it in `Geometry::codec`.
    pub fn id(&self) -> u32 {
        match self {
            Codec::None => codec_ids::NONE,
            Codec::Int8 { .. } => codec_ids::INT8,
            Codec::Int4 { .. } => codec_ids::INT4,
            Codec::FastvDims { .. } => codec_ids::FASTV_DIMS,
            Codec::LowRank { .. } => codec_ids::LOW_RANK,
            Codec::Lora { .. } => codec_ids::LORA,
        }
    }

    /// The codec as `Codec::parse` reads it back: `int4:group=32`, `low-rank:rank=16`, `none`.
    pub fn spec(&self) -> String {
        match *self {
            Codec::None => "none".into(),
            Codec::Int8 { group } | Codec::Int4 { group } => format!("{}:group={group}", self.name()),
            Codec::FastvDims { keep } => format!("fastv-dims:keep={keep}"),
            Codec::LowRank { rank } | Codec::Lora { rank } => format!("{}:rank={rank}", self.name()),
        }
    }

    /// Whether the codec needs a basis fitted on a calibration window before it can encode.
    pub fn is_low_rank(&self) -> bool {
        matches!(self, Codec::LowRank { .. } | Codec::Lora { .. })
    }

    /// The rank of a low-rank codec.
    pub fn rank(&self) -> Option<u32> {
        match *self {
            Codec::LowRank { rank } | Codec::Lora { rank } => Some(rank),
            _ => None,
        }
    }

    /// `name` or `name:key=value,...` (int8/int4: group; fastv-dims: keep; low-rank/lora: rank).
    pub fn parse(spec: &str) -> Result<Codec> {
        let (name, rest) = spec.split_once(':').unwrap_or((spec, ""));
        let mut c = match name.trim() {
            "none" => Codec::None,
            "int8" => Codec::Int8 { group: 32 },
            "int4" => Codec::Int4 { group: 32 },
            "fastv-dims" | "fastv" => Codec::FastvDims { keep: 32 },
            "low-rank" | "svd" => Codec::LowRank { rank: 32 },
            "lora" => Codec::Lora { rank: 32 },
            other => return Err(Error::config("codec", other, format!("allowed values: {CODEC_NAMES}"))),
        };
        for kv in rest.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = kv.split_once('=').ok_or_else(|| Error::config("codec", spec, format!("`{kv}` is not key=value")))?;
            let n: u32 = v.trim().parse().map_err(|_| Error::config("codec", spec, format!("`{}` needs a whole number", k.trim())))?;
            match (&mut c, k.trim()) {
                (Codec::Int8 { group } | Codec::Int4 { group }, "group") => *group = n,
                (Codec::FastvDims { keep }, "keep") => *keep = n,
                (Codec::LowRank { rank } | Codec::Lora { rank }, "rank") => *rank = n,
                _ => return Err(Error::config("codec", spec, format!("codec `{}` has no parameter `{}`", c.name(), k.trim()))),
            }
        }
        Ok(c)
    }

    /// Bits per stored code (quantisers).
    fn bits(&self) -> u32 {
        match self {
            Codec::Int8 { .. } => 8,
            Codec::Int4 { .. } => 4,
            _ => 16,
        }
    }

    /// u32 words of one compressed page of `page_size` slots of `head_dim` dimensions.
    pub fn page_words(&self, page_size: u32, head_dim: u32) -> u32 {
        match *self {
            Codec::None => 0,
            Codec::Int8 { group } | Codec::Int4 { group } => {
                let b = self.bits();
                // K: per-channel (min, scale) f16 pairs; codes. V: per (slot, group) pairs; codes.
                head_dim + 2 * page_size * head_dim * b / 32 + page_size * (head_dim / group.max(1))
            }
            Codec::FastvDims { keep } => page_size * keep / 2 + page_size * head_dim / 2,
            // K then V coefficients, f16 pairs.
            Codec::LowRank { rank } | Codec::Lora { rank } => page_size * rank,
        }
    }
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
            codec: Codec::None,
            codec_pages: 0,
        }
    }
}

/// Largest `head_dim`: the attention kernels keep a query group's head in workgroup memory.
pub const MAX_HEAD_DIM: u32 = 256;
/// Largest `page_size` in slots: the attention kernels keep a page's scores in workgroup memory.
pub const MAX_PAGE_SIZE: u32 = 64;
/// Largest `n_shards`: `append/gather_pages.wgsl` keeps one offset per shard in workgroup memory.
pub const MAX_SHARDS: u32 = 256;
/// Largest `top_k`: experts and gates kept per slot.
pub const MAX_TOP_K: u32 = 8;
/// Largest rank of the low-rank codecs (`compress/basis.wgsl`, `attend/split_lowrank.wgsl`).
pub const MAX_RANK: u32 = 64;

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

    /// u32 words of metadata per slot: position, last access, access count, `top_k` experts,
    /// `top_k` gates and the attention mass.
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

    /// Longest page list of one (layer, sequence, KV head): every shard ring full,
    /// `n_shards * ring_capacity` pages.
    pub fn max_pages_per_seq(&self) -> u32 {
        self.n_shards * self.ring_capacity
    }

    /// Check every field on its own and in combination; the error names the field.
    pub fn validate(&self) -> Result<()> {
        self.validate_codec()?;
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
        let slots = u64::from(self.n_ids()) * u64::from(self.page_size) * u64::from(self.meta_words());
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

    fn validate_codec(&self) -> Result<()> {
        match self.codec {
            Codec::None => return Ok(()),
            Codec::Int8 { group } | Codec::Int4 { group } => {
                if group == 0 || !self.head_dim.is_multiple_of(group) {
                    return Err(Error::config("codec.group", group, format!("must divide head_dim = {}", self.head_dim)));
                }
                if !self.head_dim.is_multiple_of(8) {
                    return Err(Error::config("head_dim", self.head_dim, "the quantisers need a multiple of 8"));
                }
            }
            Codec::FastvDims { keep } => {
                if keep == 0 || keep > self.head_dim || !keep.is_multiple_of(2) {
                    return Err(Error::config("codec.keep", keep, format!("must be even, in 2..={}", self.head_dim)));
                }
            }
            Codec::LowRank { rank } | Codec::Lora { rank } => {
                // rank = head_dim would store as many bytes as the raw page: no compression.
                let max = self.head_dim.saturating_sub(2).min(MAX_RANK);
                if rank == 0 || rank > max || !rank.is_multiple_of(2) {
                    return Err(Error::config(
                        "codec.rank",
                        rank,
                        format!("must be even, in 2..={max} (below head_dim {})", self.head_dim),
                    ));
                }
            }
        }
        if self.dtype != KvDtype::F16 {
            return Err(Error::config("codec", self.codec.name(), "codecs encode f16 pages; use dtype f16"));
        }
        if self.codec_pages == 0 {
            return Err(Error::config("codec_pages", 0, "a codec needs compressed pages"));
        }
        Ok(())
    }

    /// Page ids in use: raw pages, then compressed pages.
    pub fn n_ids(&self) -> u32 {
        self.n_pages + if self.codec == Codec::None { 0 } else { self.codec_pages }
    }

    /// f32 words of the low-rank basis: per (layer, KV head), K then V, `rank` rows of
    /// `head_dim` (row j = basis vector j); LoRA's once per layer (shared by its KV heads); 0 for
    /// other codecs.
    pub fn basis_words(&self) -> u64 {
        self.codec
            .rank()
            .map_or(0, |r| u64::from(self.layers) * u64::from(self.basis_heads()) * 2 * u64::from(r) * u64::from(self.head_dim))
    }

    /// Bases stored per layer: one per KV head, LoRA's one for the layer.
    pub fn basis_heads(&self) -> u32 {
        if matches!(self.codec, Codec::Lora { .. }) { 1 } else { self.kv_heads }
    }

    /// Bytes of one compressed page (0 without a codec).
    pub fn codec_page_bytes(&self) -> u64 {
        u64::from(self.codec.page_words(self.page_size, self.head_dim)) * 4
    }

    /// Pages each pool buffer holds under a per-buffer byte cap (also kept under 4 GiB of words).
    pub fn pages_per_buffer(&self, cap_bytes: u64) -> u32 {
        let cap = self.max_buffer_bytes.map_or(cap_bytes, |b| b.min(cap_bytes));
        let by_bytes = cap / self.page_bytes();
        let by_index = u64::from(u32::MAX) / (u64::from(self.page_words()) + 1);
        by_bytes.min(by_index).min(u64::from(self.n_pages)) as u32
    }

    /// Bytes [`crate::append::KvPool::new`] allocates for this pool on a device whose storage
    /// bindings hold `max_binding` bytes: its K/V pages (raw and compressed) and the tables of
    /// page state (rings, page tables and lists, slot metadata, page generations, free stacks, the
    /// low-rank basis).
    /// Not included: per-step scratch (sized by each append), uniforms and the release pass's
    /// per-ring counts (a word per ring). Equal to
    /// [`crate::append::KvPool::pool_bytes_allocated`] once allocated.
    pub fn pool_bytes(&self, max_binding: u64) -> u64 {
        let buf = crate::runtime::storage_size;
        let ppb = self.pages_per_buffer(max_binding).max(1);
        let mut kv = 0;
        let mut first = 0;
        while first < self.n_pages {
            let count = ppb.min(self.n_pages - first);
            kv += buf(u64::from(count) * self.page_bytes());
            first += count;
        }
        let codec_pages = u64::from(self.n_ids() - self.n_pages);
        let slots = u64::from(self.n_ids()) * u64::from(self.page_size);
        let tables = [
            u64::from(self.n_keys()) * 16,
            u64::from(self.n_keys()) * u64::from(self.ring_capacity) * 4,
            u64::from(self.n_ids()) * 8,
            u64::from(self.n_pages) * 4,
            std::mem::size_of::<crate::gpu_data::PoolCtl>() as u64,
            codec_pages * self.codec_page_bytes(),
            codec_pages * 4,
            self.basis_words() * 4,
            slots * u64::from(self.meta_words()) * 4,
            u64::from(self.n_pages) * 4,
            u64::from(self.n_lists()) * u64::from(self.max_pages_per_seq()) * 4,
            u64::from(self.n_lists()) * 4,
        ];
        kv + tables.into_iter().map(buf).sum::<u64>()
    }

    /// Pages the pool holds, raw and compressed, by its control block's free-stack tops.
    pub fn pages_in_use(&self, ctl: &crate::gpu_data::PoolCtl) -> u32 {
        (self.n_pages - ctl.free_top) + (self.n_ids() - self.n_pages - ctl.codec_free_top)
    }

    /// u32 words of one raw page: K then V of one KV head for `page_size` slots
    /// ([`PoolConfig::page_bytes`] / 4).
    pub fn page_words(&self) -> u32 {
        2 * self.page_size * self.vec_words()
    }

    /// The uniform the kernels read the pool's shape from, for pool buffers of
    /// `pages_per_buffer` pages ([`PoolConfig::pages_per_buffer`]).
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
            codec: self.codec.id(),
            codec_pages: if self.codec == Codec::None { 0 } else { self.codec_pages },
            codec_page_words: self.codec.page_words(self.page_size, self.head_dim),
            codec_param: match self.codec {
                Codec::FastvDims { keep } => keep,
                Codec::LowRank { rank } | Codec::Lora { rank } => rank,
                _ => 0,
            },
            v_group: match self.codec {
                Codec::Int8 { group } | Codec::Int4 { group } => group,
                _ => 0,
            },
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

    /// Low-rank bases: one per (layer, KV head); LoRA's one per layer, stored once.
    #[test]
    fn basis_words_per_head_and_per_layer() {
        let c = PoolConfig { layers: 30, kv_heads: 3, head_dim: 64, codec: Codec::LowRank { rank: 16 }, ..Default::default() };
        assert_eq!(c.basis_words(), 30 * 3 * 2 * 16 * 64);
        let l = PoolConfig { codec: Codec::Lora { rank: 16 }, ..c.clone() };
        assert_eq!((l.basis_heads(), l.basis_words()), (1, 30 * 2 * 16 * 64));
        assert_eq!(PoolConfig { codec: Codec::Int4 { group: 32 }, ..c }.basis_words(), 0);
    }

    #[test]
    fn page_bytes_match_layout() {
        let c = PoolConfig::default();
        // 2 (K, V) x 16 slots x 128 dims x 2 bytes: one head
        assert_eq!(c.page_bytes(), 2 * 16 * 128 * 2);
        assert_eq!(u64::from(c.page_words()) * 4, c.page_bytes());
    }
}
