//! Storage words decoded by the references (below every other reference module).

/// Decode storage words of one vector into f64 values (the reference's own decoder: the host's
/// encoder, [`crate::append::format::encode_values`], is what it checks).
pub fn decode_words(words: &[u32], dtype: crate::config::KvDtype) -> Vec<f64> {
    match dtype {
        crate::config::KvDtype::F32 => words.iter().map(|w| f64::from(f32::from_bits(*w))).collect(),
        crate::config::KvDtype::F16 => words
            .iter()
            .flat_map(|w| {
                let lo = half::f16::from_bits((*w & 0xffff) as u16);
                let hi = half::f16::from_bits((*w >> 16) as u16);
                [f64::from(lo.to_f32()), f64::from(hi.to_f32())]
            })
            .collect(),
    }
}
