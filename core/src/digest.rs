//! A checksum of a run's decisions, equal wherever the run is equal: the routing (experts chosen
//! per sequence and layer, appended and resident counts per expert), the scheduler's evictions
//! and compactions, and the pool's placement (rings, page owners, the free stack) after every
//! step. Floats (scores, attention outputs, the K/V bytes) stay out of the hash: they may differ
//! in the last bit between adapters while every decision agrees. They go into a fingerprint
//! beside it instead, compared within a tolerance: three sums of each step's attention output
//! (its last layer's), so that a broken reduce pass or corrupted K/V changes the run's result
//! even where every decision stays the same. A rounded hash of the outputs would not do: a
//! value near a rounding boundary rounds differently on two adapters whose outputs agree to
//! the last few bits. The browser test compares the page's checksum and fingerprint with the
//! native run's (`expertkv demo --checksum`).

use crate::error::Result;
use crate::pipeline::Pipeline;
use crate::runtime::Runtime;

/// FNV-1a's 64-bit offset basis: the hash of nothing, where [`fnv1a`] starts.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// A 64-bit hash of `bytes` for large inputs (whole model files, stored pages): FNV-1a's step
/// over 8-byte little-endian words in four interleaved lanes, each step followed by an
/// xor-shift of the state's high half into its low half, then the lanes, the tail bytes
/// and the length through [`fnv1a`]. Each lane's step is a bijection of its state for a given
/// word, so a change within one word always reaches its lane's final state. About six times
/// faster than [`fnv1a`], which takes a byte a step; like it, a checksum against damage, no
/// defence against a chosen collision.
pub fn hash64(bytes: &[u8]) -> u64 {
    let mut lanes = [FNV_OFFSET, FNV_OFFSET ^ 1, FNV_OFFSET ^ 2, FNV_OFFSET ^ 3];
    let mut blocks = bytes.chunks_exact(32);
    for block in &mut blocks {
        for (lane, w) in lanes.iter_mut().zip(block.chunks_exact(8)) {
            let mut word = [0u8; 8];
            word.copy_from_slice(w);
            let w = u64::from_le_bytes(word);
            // The multiply carries a change only upwards; the shift brings the high half back
            // down, so changes in the top bits of two words cannot cancel. Both are bijections.
            let x = (*lane ^ w).wrapping_mul(FNV_PRIME);
            *lane = x ^ (x >> 32);
        }
    }
    let mut h = FNV_OFFSET;
    for lane in lanes {
        h = fnv1a(h, &lane.to_le_bytes());
    }
    fnv1a(fnv1a(h, blocks.remainder()), &(bytes.len() as u64).to_le_bytes())
}

/// FNV-1a (64-bit) continued from `hash` over `bytes` (start from [`FNV_OFFSET`]): the decision
/// digest's mixing, the synthetic models' per-tensor seeds, the MoEfication cache's key.
pub fn fnv1a(hash: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(hash, |h, &b| (h ^ u64::from(b)).wrapping_mul(FNV_PRIME))
}

/// FNV-1a (64-bit) over the decisions of every step absorbed so far, and the fingerprint of the
/// steps' attention outputs ([`DecisionDigest::fingerprint`]).
#[derive(Clone, Debug, PartialEq)]
pub struct DecisionDigest {
    hash: u64,
    steps: u32,
    fingerprint: Vec<f64>,
}

impl Default for DecisionDigest {
    fn default() -> Self {
        DecisionDigest { hash: FNV_OFFSET, steps: 0, fingerprint: Vec::new() }
    }
}

/// Sums of one attention output: `[sum |x|, sum x^2, sum s_i x_i]` with fixed signs `s_i = +-1`
/// (from the index's hash), so that a value moved from one element to another changes the third.
pub fn output_fingerprint(out: &[f32]) -> [f64; 3] {
    let mut f = [0f64; 3];
    for (i, &x) in out.iter().enumerate() {
        let x = f64::from(x);
        f[0] += x.abs();
        f[1] += x * x;
        f[2] += fingerprint_sign(i) * x;
    }
    f
}

fn fingerprint_sign(i: usize) -> f64 {
    if fnv1a(FNV_OFFSET, &(i as u64).to_le_bytes()) & 1 == 0 { 1.0 } else { -1.0 }
}

/// The first step and sum where two fingerprints (three sums per step) differ by more than
/// `rtol` of the step's scale (its `sum |x|`, and `sum x^2` for the second sum): `None` when
/// they agree everywhere. Lengths must match.
pub fn fingerprint_difference(a: &[f64], b: &[f64], rtol: f64) -> Option<String> {
    if a.len() != b.len() || !a.len().is_multiple_of(3) {
        return Some(format!("fingerprints of {} and {} sums", a.len(), b.len()));
    }
    for (step, (x, y)) in a.chunks(3).zip(b.chunks(3)).enumerate() {
        let scale = [x[0].abs().max(y[0].abs()), x[1].abs().max(y[1].abs()), x[0].abs().max(y[0].abs())];
        for k in 0..3 {
            let d = (x[k] - y[k]).abs();
            if d.is_nan() || d > rtol * scale[k] {
                return Some(format!("step {step}, sum {k}: {} against {} (tolerance {rtol:e} of {})", x[k], y[k], scale[k]));
            }
        }
    }
    None
}

impl DecisionDigest {
    /// An empty digest: the hash at [`FNV_OFFSET`], no steps, no fingerprint.
    pub fn new() -> Self {
        Self::default()
    }

    /// Mix in one 64-bit word (little-endian bytes).
    pub fn word(&mut self, x: u64) {
        self.hash = fnv1a(self.hash, &x.to_le_bytes());
    }

    fn words(&mut self, xs: impl IntoIterator<Item = u64>) {
        let mut n = 0u64;
        for x in xs {
            self.word(x);
            n += 1;
        }
        // The length ends every list, so [a, b] + [] and [a] + [b] differ.
        self.word(n);
    }

    /// The decisions of the step `p.step()` just ran (call right after it).
    pub async fn absorb_step(&mut self, rt: &Runtime, p: &Pipeline) -> Result<()> {
        for r in p.trace_records(rt).await? {
            self.words([u64::from(r.step), u64::from(r.layer)]);
            self.words(r.experts.iter().map(|&e| u64::from(e)));
            self.words([r.pages_read, r.pages_in_use, r.tokens_evicted, r.slots_moved, r.pages_freed]);
        }
        let stats = p.router().read_stats(rt).await?;
        self.words(stats.iter().flat_map(|s| [u64::from(s.appended), u64::from(s.resident), u64::from(s.count)]));
        let snap = p.kv.pool.snapshot(rt).await?;
        self.words(snap.rings.iter().flat_map(|r| [u64::from(r.head), u64::from(r.count), u64::from(r.fill)]));
        self.words(snap.page_meta.iter().flat_map(|m| [u64::from(m.owner), u64::from(m.fill)]));
        let top = (snap.ctl.free_top as usize).min(snap.free_stack.len());
        self.words(snap.free_stack[..top].iter().map(|&x| u64::from(x)));
        let c = snap.ctl;
        self.words([c.free_top, c.codec_free_top, c.tokens_appended, c.pages_released, c.pages_evicted, c.ring_overflows].map(u64::from));
        self.fingerprint.extend(output_fingerprint(&p.kv.attn.read_output(rt).await?));
        self.steps += 1;
        Ok(())
    }

    /// Three sums of every absorbed step's attention output ([`output_fingerprint`]), in step
    /// order; compare two with [`fingerprint_difference`].
    pub fn fingerprint(&self) -> &[f64] {
        &self.fingerprint
    }

    /// The 64-bit hash of every decision absorbed so far.
    pub fn value(&self) -> u64 {
        self.hash
    }

    /// Steps absorbed.
    pub fn steps(&self) -> u32 {
        self.steps
    }

    /// `0x` and 16 hex digits.
    pub fn hex(&self) -> String {
        format!("{:#018x}", self.hash)
    }
}

#[cfg(test)]
mod tests {
    /// Every single-byte change of a random buffer (the tail past the last 32-byte block too),
    /// the same damage to the top byte of two words of one lane, and a change of length change
    /// `hash64`.
    #[test]
    fn hash64_sees_every_byte_and_the_length() {
        let seed = 0x64a5;
        let mut rng = crate::rng::Rng::new(seed);
        let bytes: Vec<u8> = (0..1003).map(|_| rng.below(256) as u8).collect();
        let h = hash64(&bytes);
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 1 << rng.below(8);
            assert_ne!(hash64(&b), h, "seed {seed}: byte {i}");
        }
        // Two words of one lane (32 bytes apart) damaged in their top bits, where a multiply
        // alone would let the changes cancel.
        for i in 0..bytes.len() / 32 - 1 {
            let mut b = bytes.clone();
            b[32 * i + 7] ^= 0x80;
            b[32 * i + 39] ^= 0x80;
            assert_ne!(hash64(&b), h, "seed {seed}: top bits of words {i} and {}", i + 4);
            let mut b = bytes.clone();
            let m = 1 + rng.below(255) as u8;
            b[32 * i + 7] ^= m;
            b[32 * i + 39] ^= m;
            assert_ne!(hash64(&b), h, "seed {seed}: top bytes of words {i} and {} by {m:#x}", i + 4);
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_ne!(hash64(&longer), h);
        assert_ne!(hash64(&bytes[..1000]), hash64(&bytes[..999]));
    }

    use super::*;

    #[test]
    fn order_and_grouping_change_the_digest() {
        let mut a = DecisionDigest::new();
        a.words([1, 2]);
        a.words([]);
        let mut b = DecisionDigest::new();
        b.words([1]);
        b.words([2]);
        let mut c = DecisionDigest::new();
        c.words([2, 1]);
        c.words([]);
        assert_ne!(a.value(), b.value());
        assert_ne!(a.value(), c.value());
        let mut a2 = DecisionDigest::new();
        a2.words([1, 2]);
        a2.words([]);
        assert_eq!(a.value(), a2.value());
        assert_eq!(a.hex().len(), 18);
    }

    #[test]
    fn fingerprints_agree_within_rounding_and_differ_otherwise() {
        let out: Vec<f32> = (0..256).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let a = output_fingerprint(&out);
        // The last bits moved everywhere: within the tolerance.
        let nudged: Vec<f32> = out.iter().map(|x| x * (1.0 + 1e-6)).collect();
        assert_eq!(fingerprint_difference(&a, &output_fingerprint(&nudged), 1e-4), None);
        // One element dropped, one scaled, two of unequal signs swapped: each found.
        let mut dropped = out.clone();
        dropped[3] = 0.0;
        let mut scaled = out.clone();
        scaled[100] *= 1.5;
        let j = (1..256).find(|&j| fingerprint_sign(j) != fingerprint_sign(0) && out[j] != out[0]).expect("an index of the other sign");
        let mut swapped = out.clone();
        swapped.swap(0, j);
        for (name, bad) in [("dropped", dropped), ("scaled", scaled), ("swapped", swapped)] {
            assert!(fingerprint_difference(&a, &output_fingerprint(&bad), 1e-4).is_some(), "{name}");
        }
        assert!(fingerprint_difference(&a, &a[..2], 1e-4).is_some(), "lengths differ");
        assert!(fingerprint_difference(&[f64::NAN, 0.0, 0.0], &[f64::NAN, 0.0, 0.0], 1e-4).is_some(), "NaN never agrees");
    }

    #[test]
    fn fnv1a_matches_the_published_vector() {
        // FNV-1a 64 of the single byte "a" is 0xaf63dc4c8601ec8c.
        let mut d = DecisionDigest::new();
        d.hash ^= u64::from(b'a');
        d.hash = d.hash.wrapping_mul(FNV_PRIME);
        assert_eq!(d.value(), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(FNV_OFFSET, b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
