//! One stored value: a page (the K/V of `page_size` consecutive positions of one layer, every KV
//! head) behind a header that says whose it is, and a checksum over both.
//!
//! Layout, little-endian: magic `EKVP`; format version (u16); K/V dtype (u8: 0 f32, 1 f16);
//! codec (u8: 0 raw, 1 int8, 2 int4); model hash (u64); the chained hash of the prefix before
//! the page (u64); layer, KV heads, head dim, page size, first position (u32 each); the page's
//! token ids (`page_size` u32); payload words (u32) and the payload; [`hash64`] of every byte
//! before it (u64). Version 1 checksummed with FNV-1a a byte at a time, too slow for long
//! prefixes.
//!
//! The payload of a raw page is the append's token-major words (per token, K then V of every
//! KV head). A compressed page holds, per KV head, the pool codec's encoding of that head's page
//! ([`expertkv_core::reference::compress::encode_page`]), decoded on fetch the way the attention
//! kernel decodes it: int8 and int4 (KIVI: keys per channel, values per token in groups of 32)
//! need f16 K/V.

use expertkv_core::append::format::encode_values;
use expertkv_core::config::{Codec, KvDtype, PoolConfig};
use expertkv_core::digest::hash64;
use expertkv_core::reference::compress::{decode_value, encode_page};

use crate::{Result, StoreError};

/// The value format's version; a value of another version is refused.
pub const FORMAT_VERSION: u16 = 2;
const MAGIC: &[u8; 4] = b"EKVP";

/// How a page's K/V are kept in the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize)]
pub enum StoreCodec {
    /// The pool's storage words as they are: a fetched page is bit for bit the stored one.
    #[default]
    Raw,
    /// KIVI 8-bit (f16 K/V only): about half a raw f16 page's bytes.
    Int8,
    /// KIVI 4-bit (f16 K/V only): about a quarter.
    Int4,
}

impl StoreCodec {
    /// Every codec.
    pub const ALL: [StoreCodec; 3] = [StoreCodec::Raw, StoreCodec::Int8, StoreCodec::Int4];

    /// `raw`, `int8` or `int4`.
    pub fn parse(s: &str) -> Result<StoreCodec> {
        match s {
            "raw" | "none" => Ok(StoreCodec::Raw),
            "int8" => Ok(StoreCodec::Int8),
            "int4" => Ok(StoreCodec::Int4),
            _ => Err(StoreError::Options(format!("store codec `{s}`: allowed values are raw, int8, int4"))),
        }
    }

    /// The name [`StoreCodec::parse`] takes.
    pub fn name(self) -> &'static str {
        match self {
            StoreCodec::Raw => "raw",
            StoreCodec::Int8 => "int8",
            StoreCodec::Int4 => "int4",
        }
    }

    fn code(self) -> u8 {
        match self {
            StoreCodec::Raw => 0,
            StoreCodec::Int8 => 1,
            StoreCodec::Int4 => 2,
        }
    }

    fn pool_codec(self) -> Codec {
        match self {
            StoreCodec::Raw => Codec::None,
            StoreCodec::Int8 => Codec::Int8 { group: 32 },
            StoreCodec::Int4 => Codec::Int4 { group: 32 },
        }
    }

    /// Whether pages of this shape can be kept in this codec; the reason when not.
    pub fn check(self, dtype: KvDtype, head_dim: u32) -> Result<()> {
        if self != StoreCodec::Raw && (dtype != KvDtype::F16 || !head_dim.is_multiple_of(32)) {
            return Err(StoreError::Options(format!(
                "store codec {} needs f16 K/V and a head dim that 32 divides (here {} K/V, head dim {head_dim}); use raw",
                self.name(),
                dtype.name()
            )));
        }
        Ok(())
    }
}

/// Who a page belongs to and what it holds: written into the value's header, and compared on
/// fetch field by field.
#[derive(Clone, Debug, PartialEq)]
pub struct PageHeader {
    /// The model file's hash ([`crate::prefix::model_hash`]).
    pub model_hash: u64,
    /// The chained hash of the prefix before this page ([`crate::prefix::chain_hashes`]).
    pub prev_chain: u64,
    /// The layer.
    pub layer: u32,
    /// KV heads of the layer.
    pub kv_heads: u32,
    /// Dimensions per head.
    pub head_dim: u32,
    /// Positions per page.
    pub page_size: u32,
    /// The pool's K/V storage.
    pub dtype: KvDtype,
    /// How the payload is kept.
    pub codec: StoreCodec,
    /// Position of the page's first token.
    pub first_position: u32,
    /// The page's token ids.
    pub tokens: Vec<u32>,
}

impl PageHeader {
    /// Storage words per position (K then V of every KV head).
    pub fn token_words(&self) -> usize {
        2 * self.kv_heads as usize * self.vec_words()
    }

    fn vec_words(&self) -> usize {
        (self.head_dim * self.dtype.bytes() / 4) as usize
    }

    fn codec_cfg(&self) -> PoolConfig {
        PoolConfig {
            head_dim: self.head_dim,
            page_size: self.page_size,
            dtype: self.dtype,
            kv_heads: 1,
            codec: self.codec.pool_codec(),
            ..PoolConfig::default()
        }
    }
}

fn dtype_code(d: KvDtype) -> u8 {
    match d {
        KvDtype::F32 => 0,
        KvDtype::F16 => 1,
    }
}

/// The value of a page: `words` are its `page_size` positions in the append's token-major
/// format ([`PageHeader::token_words`] each).
pub fn encode(h: &PageHeader, words: &[u32]) -> Result<Vec<u8>> {
    h.codec.check(h.dtype, h.head_dim)?;
    let (p, tw, vw, hkv) = (h.page_size as usize, h.token_words(), h.vec_words(), h.kv_heads as usize);
    if words.len() != p * tw || h.tokens.len() != p {
        return Err(StoreError::Options(format!(
            "a page of {} words and {} tokens; {} and {p} expected",
            words.len(),
            h.tokens.len(),
            p * tw
        )));
    }
    let payload: Vec<u32> = match h.codec {
        StoreCodec::Raw => words.to_vec(),
        _ => {
            let cfg = h.codec_cfg();
            let mut out = Vec::new();
            for head in 0..hkv {
                // The head's page in the pool's layout: K of every slot, then V.
                let mut raw = vec![0u32; 2 * p * vw];
                for kv in 0..2 {
                    for s in 0..p {
                        let src = s * tw + (kv * hkv + head) * vw;
                        raw[(kv * p + s) * vw..(kv * p + s + 1) * vw].copy_from_slice(&words[src..src + vw]);
                    }
                }
                out.extend(encode_page(&cfg, &raw, &[]));
            }
            out
        }
    };
    let mut b = Vec::with_capacity(64 + 4 * (p + payload.len()));
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    b.push(dtype_code(h.dtype));
    b.push(h.codec.code());
    b.extend_from_slice(&h.model_hash.to_le_bytes());
    b.extend_from_slice(&h.prev_chain.to_le_bytes());
    for x in [h.layer, h.kv_heads, h.head_dim, h.page_size, h.first_position] {
        b.extend_from_slice(&x.to_le_bytes());
    }
    for t in &h.tokens {
        b.extend_from_slice(&t.to_le_bytes());
    }
    b.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    for w in &payload {
        b.extend_from_slice(&w.to_le_bytes());
    }
    Ok(seal(b))
}

/// `body` with its checksum ([`hash64`], u64) appended: how every stored value ends (pages
/// here, spilled pages in [`crate::spill`]).
pub(crate) fn seal(mut body: Vec<u8>) -> Vec<u8> {
    let sum = hash64(&body);
    body.extend_from_slice(&sum.to_le_bytes());
    body
}

/// The body of a value [`seal`]ed, if its checksum is right (`None`: damaged, or too short to
/// hold one).
pub(crate) fn unseal(bytes: &[u8]) -> Option<&[u8]> {
    let (body, sum) = bytes.split_at_checked(bytes.len().checked_sub(8)?)?;
    (hash64(body).to_le_bytes() == sum).then_some(body)
}

/// Reads little-endian fields off a value, every read bounds-checked.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> std::result::Result<&[u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len()).ok_or_else(|| format!("truncated at byte {}", self.at))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> std::result::Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> std::result::Result<u16, String> {
        Ok(u16::from_le_bytes([self.take(1)?[0], self.take(1)?[0]]))
    }
    fn u32(&mut self) -> std::result::Result<u32, String> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> std::result::Result<u64, String> {
        let lo = u64::from(self.u32()?);
        Ok(lo | (u64::from(self.u32()?) << 32))
    }
    /// `n` u32 words (bounds checked before anything is allocated).
    fn words(&mut self, n: usize) -> std::result::Result<Vec<u32>, String> {
        let bytes = n.checked_mul(4).ok_or_else(|| format!("{n} words at byte {}", self.at))?;
        Ok(self.take(bytes)?.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }
}

/// The page's token-major words if `bytes` is a value written for exactly `want` (every header
/// field equal, the checksum right); else why it is refused.
pub fn decode(bytes: &[u8], want: &PageHeader) -> std::result::Result<Vec<u32>, String> {
    if bytes.len() < 12 {
        return Err(format!("{} bytes is too short for a page", bytes.len()));
    }
    let body = unseal(bytes).ok_or("checksum mismatch")?;
    let mut r = Reader { b: body, at: 0 };
    if r.take(4)? != MAGIC {
        return Err("not an expertkv page".into());
    }
    let version = r.u16()?;
    if version != FORMAT_VERSION {
        return Err(format!("format version {version}, this expertkv reads {FORMAT_VERSION}"));
    }
    let (dtype, codec) = (r.u8()?, r.u8()?);
    let (model, prev) = (r.u64()?, r.u64()?);
    let fields = [r.u32()?, r.u32()?, r.u32()?, r.u32()?, r.u32()?];
    if model != want.model_hash {
        return Err(format!("another model's page (model hash {model:016x}, ours {:016x})", want.model_hash));
    }
    if dtype != dtype_code(want.dtype) || codec != want.codec.code() {
        return Err(format!("dtype/codec {dtype}/{codec}, ours {}/{}", dtype_code(want.dtype), want.codec.code()));
    }
    if prev != want.prev_chain || fields != [want.layer, want.kv_heads, want.head_dim, want.page_size, want.first_position] {
        return Err(format!("a page of another prefix or shape (layer, heads, dim, page, position {fields:?})"));
    }
    let p = want.page_size as usize;
    let tokens = r.words(p)?;
    if tokens != want.tokens {
        return Err("the page's token ids differ from the prompt's (a hash collision)".into());
    }
    let n = r.u32()? as usize;
    let payload = r.words(n)?;
    if r.at != body.len() {
        return Err(format!("{} bytes past the payload", body.len() - r.at));
    }
    let (tw, vw, hkv) = (want.token_words(), want.vec_words(), want.kv_heads as usize);
    match want.codec {
        StoreCodec::Raw => {
            if payload.len() != p * tw {
                return Err(format!("{} payload words, a raw page has {}", payload.len(), p * tw));
            }
            Ok(payload)
        }
        _ => {
            let cfg = want.codec_cfg();
            let per_head = cfg.codec.page_words(cfg.page_size, cfg.head_dim) as usize;
            if payload.len() != per_head * hkv {
                return Err(format!("{} payload words, {} expected", payload.len(), per_head * hkv));
            }
            let d = want.head_dim as usize;
            let mut out = vec![0u32; p * tw];
            let mut vals = vec![0f32; d];
            let mut w = Vec::with_capacity(vw);
            for head in 0..hkv {
                let page = &payload[head * per_head..(head + 1) * per_head];
                for kv in 0..2 {
                    for s in 0..p {
                        for (i, v) in vals.iter_mut().enumerate() {
                            *v = decode_value(&cfg, page, &[], kv, s, i);
                        }
                        w.clear();
                        encode_values(&vals, want.dtype, &mut w);
                        let dst = s * tw + (kv * hkv + head) * vw;
                        out[dst..dst + vw].copy_from_slice(&w);
                    }
                }
            }
            Ok(out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use expertkv_core::rng::Rng;

    fn header(codec: StoreCodec, dtype: KvDtype, rng: &mut Rng) -> PageHeader {
        PageHeader {
            model_hash: rng.next_u64(),
            prev_chain: rng.next_u64(),
            layer: 3,
            kv_heads: 2,
            head_dim: 64,
            page_size: 16,
            dtype,
            codec,
            first_position: 32,
            tokens: (0..16).map(|_| rng.below(1000)).collect(),
        }
    }

    fn page(h: &PageHeader, rng: &mut Rng) -> (Vec<f32>, Vec<u32>) {
        let vals: Vec<f32> =
            (0..h.page_size as usize * 2 * h.kv_heads as usize * h.head_dim as usize).map(|_| rng.normal() as f32).collect();
        let mut w = Vec::new();
        encode_values(&vals, h.dtype, &mut w);
        (vals, w)
    }

    /// Every codec round-trips (raw bit for bit, int8/int4 within their step), and a value is
    /// refused when any header field, a byte of the payload or the length differs.
    #[test]
    fn values_round_trip_and_foreign_values_are_refused() {
        let seed = 0x5701e;
        let mut rng = Rng::new(seed);
        for (codec, dtype) in [
            (StoreCodec::Raw, KvDtype::F32),
            (StoreCodec::Raw, KvDtype::F16),
            (StoreCodec::Int8, KvDtype::F16),
            (StoreCodec::Int4, KvDtype::F16),
        ] {
            let h = header(codec, dtype, &mut rng);
            let (vals, words) = page(&h, &mut rng);
            let v = encode(&h, &words).expect("encode");
            let back = decode(&v, &h).unwrap_or_else(|e| panic!("seed {seed}: {codec:?}: {e}"));
            if codec == StoreCodec::Raw {
                assert_eq!(back, words, "seed {seed}: {codec:?} {dtype:?}");
                if dtype == KvDtype::F16 {
                    assert!(v.len() < 4 * words.len() + 200);
                }
            } else {
                use expertkv_core::reference::compress::{f16_value, quant_params};
                let f16 = |w: u32, i: usize| half::f16::from_bits((if i & 1 == 1 { w >> 16 } else { w & 0xffff }) as u16).to_f32();
                // Each value within half a step of its KIVI group (a key: its channel over the
                // page's slots; a value: its 32 dimensions of one slot), the step as the codec
                // keeps it (the group's range over 15 or 255 levels, rounded up to f16), plus the
                // decoded value's own rounding to f16 (2^-11 of it), against the f16 values the
                // pool held. (This was 0.9 absolute for int4, about three steps.)
                let (p, hkv, d) = (h.page_size as usize, h.kv_heads as usize, h.head_dim as usize);
                let at = |s: usize, kv: usize, head: usize, i: usize| s * 2 * hkv * d + (kv * hkv + head) * d + i;
                let held = |e: usize| half::f16::from_f32(vals[e]).to_f32();
                let mut worst = 0f32;
                for (s, kv, head, i) in
                    (0..p).flat_map(|s| (0..2).flat_map(move |kv| (0..hkv).flat_map(move |hd| (0..d).map(move |i| (s, kv, hd, i)))))
                {
                    let group: Vec<f32> = if kv == 0 {
                        (0..p).map(|t| held(at(t, 0, head, i))).collect()
                    } else {
                        (i / 32 * 32..i / 32 * 32 + 32).map(|j| held(at(s, 1, head, j))).collect()
                    };
                    let (lo, hi) = group.iter().fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
                    let step = f16_value(quant_params(codec.pool_codec(), lo, hi) >> 16);
                    let e = at(s, kv, head, i);
                    let (x, got) = (held(e), f16(back[e / 2], e));
                    let bound = 0.5 * step * 1.0001 + got.abs() * 2f32.powi(-11) + 1e-7;
                    assert!(
                        (got - x).abs() <= bound,
                        "seed {seed}: {codec:?}: slot {s}, {} of head {head}, dim {i}: {x} decoded as {got}, over half a step ({step})",
                        ["K", "V"][kv]
                    );
                    worst = worst.max((got - x).abs());
                }
                assert!(worst > 0.0, "seed {seed}: {codec:?} decoded exactly: not compressed?");
                let raw_bytes = 4 * words.len();
                assert!(
                    v.len() * 100 < raw_bytes * if codec == StoreCodec::Int8 { 65 } else { 40 },
                    "{codec:?}: {} bytes of {raw_bytes}",
                    v.len()
                );
            }
            // Each field of the header in turn.
            let others = [
                PageHeader { model_hash: h.model_hash ^ 1, ..h.clone() },
                PageHeader { prev_chain: h.prev_chain ^ 1, ..h.clone() },
                PageHeader { layer: h.layer + 1, ..h.clone() },
                PageHeader { first_position: h.first_position + 16, ..h.clone() },
                PageHeader { tokens: h.tokens.iter().rev().copied().collect(), ..h.clone() },
                PageHeader { codec: if codec == StoreCodec::Raw { StoreCodec::Int8 } else { StoreCodec::Raw }, ..h.clone() },
            ];
            for o in &others {
                assert!(decode(&v, o).is_err(), "seed {seed}: {codec:?}: read as {o:?}");
            }
            let mut bad = v.clone();
            let i = 60 + rng.below((v.len() - 70) as u32) as usize;
            bad[i] ^= 0x10;
            assert_eq!(decode(&bad, &h), Err("checksum mismatch".into()), "seed {seed}: byte {i}");
            assert!(decode(&v[..v.len() / 2], &h).is_err());
            let mut old = v.clone();
            old[4] = 9;
            let n = old.len() - 8;
            let sum = hash64(&old[..n]);
            old[n..].copy_from_slice(&sum.to_le_bytes());
            assert!(decode(&old, &h).is_err_and(|e| e.contains("version")), "seed {seed}");
        }
        assert!(StoreCodec::Int8.check(KvDtype::F32, 64).is_err());
        assert!(StoreCodec::parse("zstd").is_err());
    }
}
