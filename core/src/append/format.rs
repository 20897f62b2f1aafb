//! The host's data formats for the append kernels: the token record (`common/append.wgsl`), K/V
//! storage words, and the free stack's initial order. The CPU references decode with their own
//! code, so a wrong encoder here shows up as a GPU-vs-CPU mismatch.

use crate::config::KvDtype;

/// One token to append: where it belongs and its routing.
#[derive(Clone, Debug, PartialEq)]
pub struct NewToken {
    /// Layer whose cache receives the token, below the pool's `layers`.
    pub layer: u32,
    /// Sequence (slot of the pool), below the pool's `max_seqs`.
    pub seq: u32,
    /// The token's position in its sequence: chooses its shard (PiKV and token-block maps) and is
    /// kept in its slot's metadata.
    pub position: u32,
    /// Top-k experts, most preferred first (length = the pool's top_k).
    pub experts: Vec<u32>,
    /// Gate weights of `experts`, in the same order (length = top_k, finite).
    pub gates: Vec<f32>,
}

impl NewToken {
    /// Words of the record read by the append kernels: [layer, seq, position, experts, gates].
    pub fn encode_into(&self, top_k: usize, out: &mut Vec<u32>) {
        out.extend([self.layer, self.seq, self.position]);
        for e in 0..top_k {
            out.push(self.experts.get(e).copied().unwrap_or(0));
        }
        for e in 0..top_k {
            out.push(self.gates.get(e).copied().unwrap_or(0.0).to_bits());
        }
    }
}

/// Words per new-token record.
pub fn token_words(top_k: u32) -> u32 {
    3 + 2 * top_k
}

/// The free stack as initialised: popping yields pages 0, 1, 2, ...
pub fn initial_free_stack(n_pages: u32) -> Vec<u32> {
    (0..n_pages).rev().collect()
}

/// Encode f32 values into storage words (f16: round to nearest even, pairs low half first).
pub fn encode_values(values: &[f32], dtype: KvDtype, out: &mut Vec<u32>) {
    match dtype {
        KvDtype::F32 => out.extend(values.iter().map(|v| v.to_bits())),
        KvDtype::F16 => out.extend(values.chunks(2).map(|c| {
            let lo = half::f16::from_f32(c[0]).to_bits() as u32;
            let hi = half::f16::from_f32(c.get(1).copied().unwrap_or(0.0)).to_bits() as u32;
            lo | (hi << 16)
        })),
    }
}
