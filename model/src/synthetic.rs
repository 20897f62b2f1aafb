//! Small random Llama-architecture models written as GGUF files in memory: what the tests of
//! paths no shipped model covers run on (a Mixture-of-Experts file with llama.cpp's
//! `ffn_gate_inp` / `ffn_*_exps` tensors; SmolLM2 is dense).
//!
//! Every tensor is drawn from its own generator, seeded by the model's seed and the tensor's
//! name, so two files of one seed share every tensor they both have: a dense file and a MoE file
//! whose experts are all copies of the dense FFN ([`SyntheticModel::identical_experts`]) differ in
//! the FFN's layout only, and since the chosen experts' weights sum to 1, in nothing they compute.
//! Norms are F32; the matrices are F32 or, like trained files, Q8_0 or Q4_1 blocks quantised
//! from the same draws ([`SyntheticModel::weights`]). The tokenizer is byte-level BPE over the
//! 256 byte tokens, no merges.

use crate::gguf::GgmlType;
use crate::gguf::writer::GgufWriter;
use expertkv_core::digest::{FNV_OFFSET, fnv1a};
use expertkv_core::rng::Rng;

/// The shape and seed of a synthetic model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyntheticModel {
    /// Transformer blocks (`llama.block_count`).
    pub layers: u32,
    /// Hidden features (a multiple of 32, as the GPU kernels read 32-weight blocks).
    pub hidden: u32,
    /// Query heads; the head dimension is `hidden / heads`.
    pub heads: u32,
    /// KV heads (grouped-query attention: a divisor of `heads`).
    pub kv_heads: u32,
    /// Neurons of the dense FFN, or of each expert.
    pub ffn: u32,
    /// 0: a dense FFN; otherwise this many experts and a router per layer.
    pub experts: u32,
    /// `llama.expert_used_count`.
    pub top_k: u32,
    /// Every expert a copy of the dense FFN of the same seed.
    pub identical_experts: bool,
    /// `llama.context_length`: the most tokens per sequence the model may be loaded for.
    pub context: u32,
    /// Seed of every tensor's generator (each mixed with the tensor's name).
    pub seed: u64,
    /// How the matrices (embedding, attention, FFN, experts; not the router) are stored: F32,
    /// Q8_0, Q4_1, or Q4_K (the hidden size and FFN a multiple of 256).
    pub weights: GgmlType,
    /// An LM head of its own (`output.weight`) instead of the token embeddings: with tied
    /// embeddings a random model's residual stream is dominated by the last token's embedding,
    /// so greedy decoding repeats that token; an untied head makes each next token a different
    /// function of the whole forward pass.
    pub untied_output: bool,
    /// A SentencePiece-style vocabulary (`tokenizer.ggml.model` = `llama`, as Llama 2, Mistral
    /// and Mixtral files carry): `<unk>`, `<s>`, `</s>`, the 256 byte tokens and a few scored
    /// pieces, instead of the 256-token byte-level BPE one.
    pub sentencepiece: bool,
    /// The architecture written (`general.architecture` and the keys' prefix): `llama`,
    /// `qwen2` (with Q/K/V biases), `qwen3` (with per-head Q/K norms), or with experts
    /// `qwen3moe`, `olmoe` (whole-projection Q/K norms, experts not renormalised) and `qwen2moe`
    /// (Q/K/V biases and a shared expert), in llama.cpp's tensor names and keys.
    pub arch: crate::config::Arch,
    /// Each head's dimension when not `hidden / heads` (written as `attention.key_length` and
    /// `value_length`, as Qwen3 files do).
    pub head_dim: Option<u32>,
}

impl SyntheticModel {
    /// Two layers, hidden 128, two query heads of 64 sharing one KV head, a dense FFN of 96.
    pub fn dense(seed: u64) -> Self {
        SyntheticModel {
            layers: 2,
            hidden: 128,
            heads: 2,
            kv_heads: 1,
            ffn: 96,
            experts: 0,
            top_k: 0,
            identical_experts: false,
            context: 256,
            seed,
            weights: GgmlType::F32,
            untied_output: false,
            sentencepiece: false,
            arch: crate::config::Arch::Llama,
            head_dim: None,
        }
    }

    /// The same model with its matrices stored as `weights` (F32, Q8_0 or Q4_1).
    pub fn with_weights(self, weights: GgmlType) -> Self {
        SyntheticModel { weights, ..self }
    }

    /// [`SyntheticModel::dense`]'s shape with `experts` experts of 96 neurons, `top_k` used.
    pub fn moe(seed: u64, experts: u32, top_k: u32) -> Self {
        SyntheticModel { experts, top_k, ..Self::dense(seed) }
    }

    /// The file's bytes.
    pub fn gguf(&self) -> Vec<u8> {
        let (h, f, e) = (u64::from(self.hidden), u64::from(self.ffn), u64::from(self.experts));
        let hd = self.head_dim.map_or(h / u64::from(self.heads), u64::from);
        let (q, kv) = (u64::from(self.heads) * hd, u64::from(self.kv_heads) * hd);
        let chars: Vec<String> = if self.sentencepiece {
            sentencepiece_vocabulary().into_iter().map(|(t, _, _)| t).collect()
        } else {
            crate::tokenizer::byte_to_char().iter().map(char::to_string).collect()
        };
        let tokens: Vec<&str> = chars.iter().map(String::as_str).collect();
        let vocab = tokens.len() as u64;
        let mut w = GgufWriter::new();
        let a = self.arch.name();
        let k = |key: &str| format!("{a}.{key}");
        w.str("general.architecture", a)
            .str("general.name", "expertkv synthetic")
            .u32(&k("block_count"), self.layers)
            .u32(&k("embedding_length"), self.hidden)
            .u32(&k("feed_forward_length"), if self.own_expert_size() { 4 * self.ffn } else { self.ffn })
            .u32(&k("attention.head_count"), self.heads)
            .u32(&k("attention.head_count_kv"), self.kv_heads)
            .f32(&k("attention.layer_norm_rms_epsilon"), 1e-5)
            .f32(&k("rope.freq_base"), 10_000.0)
            .u32(&k("context_length"), self.context)
            .strs("tokenizer.ggml.tokens", &tokens);
        if self.sentencepiece {
            let v = sentencepiece_vocabulary();
            let types: Vec<i32> = v.iter().map(|t| t.1).collect();
            let scores: Vec<f32> = v.iter().map(|t| t.2).collect();
            w.str("tokenizer.ggml.model", "llama")
                .i32s("tokenizer.ggml.token_type", &types)
                .f32s("tokenizer.ggml.scores", &scores)
                .u32("tokenizer.ggml.bos_token_id", 1)
                .u32("tokenizer.ggml.eos_token_id", 2)
                .bool("tokenizer.ggml.add_bos_token", true);
        } else {
            w.str("tokenizer.ggml.model", "gpt2").str("tokenizer.ggml.pre", "gpt2").strs("tokenizer.ggml.merges", &[]);
        }
        if let Some(d) = self.head_dim {
            w.u32(&k("attention.key_length"), d).u32(&k("attention.value_length"), d);
        }
        if self.experts > 0 && self.own_expert_size() {
            // The experts' own size; the dense size (unused) differs, as in real files.
            w.u32(&k("expert_feed_forward_length"), self.ffn);
        }
        let fs = u64::from(self.shared_ffn());
        if self.arch.shared_expert() {
            w.u32(&k("expert_shared_feed_forward_length"), fs as u32);
        }
        if self.experts > 0 {
            w.u32(&k("expert_count"), self.experts).u32(&k("expert_used_count"), self.top_k);
        }
        let seed = self.seed;
        // `[rows][cols]` (ggml dims `[cols, rows]`), normal with standard deviation `scale`.
        // Tensors past 2^24 values (none a test makes) are drawn in parts of 2^22 on every core,
        // each part its own stream, so a large file takes seconds, the same on any machine.
        let draw = |name: &str, n: u64, scale: f32| -> Vec<f32> {
            let stream = seed ^ fnv1a(FNV_OFFSET, name.as_bytes());
            if n <= 1 << 24 {
                let mut rng = Rng::new(stream);
                return (0..n).map(|_| rng.normal() as f32 * scale).collect();
            }
            const PART: u64 = 1 << 22;
            let parts: Vec<u64> = (0..n.div_ceil(PART)).collect();
            let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
            let mut out = vec![0f32; n as usize];
            std::thread::scope(|s| {
                let per = parts.len().div_ceil(threads);
                for (ids, chunk) in parts.chunks(per).zip(out.chunks_mut(per * PART as usize)) {
                    s.spawn(move || {
                        for (&p, part) in ids.iter().zip(chunk.chunks_mut(PART as usize)) {
                            let mut rng = Rng::new(stream ^ p.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                            part.iter_mut().for_each(|v| *v = rng.normal() as f32 * scale);
                        }
                    });
                }
            });
            out
        };
        let f32s = |w: &mut GgufWriter, name: &str, dims: &[u64], data: Vec<f32>| {
            w.tensor(name, dims, GgmlType::F32, data.iter().flat_map(|v| v.to_le_bytes()).collect());
        };
        let format = self.weights;
        let mat = |w: &mut GgufWriter, name: &str, dims: &[u64], data: Vec<f32>| {
            w.tensor(name, dims, format, quantize(format, &data));
        };
        let fan = |n: u64| 1.0 / (n as f32).sqrt();
        mat(&mut w, "token_embd.weight", &[h, vocab], draw("token_embd.weight", h * vocab, 1.0));
        let gain = |name: &str| draw(name, h, 0.1).into_iter().map(|g| 1.0 + g).collect::<Vec<f32>>();
        f32s(&mut w, "output_norm.weight", &[h], gain("output_norm.weight"));
        if self.untied_output {
            mat(&mut w, "output.weight", &[h, vocab], draw("output.weight", h * vocab, fan(h)));
        }
        for l in 0..self.layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            f32s(&mut w, &n("attn_norm"), &[h], gain(&n("attn_norm")));
            f32s(&mut w, &n("ffn_norm"), &[h], gain(&n("ffn_norm")));
            // Larger query and key weights than 1/sqrt(fan-in), so that attention is not uniform.
            mat(&mut w, &n("attn_q"), &[h, q], draw(&n("attn_q"), h * q, 3.0 * fan(h)));
            mat(&mut w, &n("attn_k"), &[h, kv], draw(&n("attn_k"), h * kv, 3.0 * fan(h)));
            mat(&mut w, &n("attn_v"), &[h, kv], draw(&n("attn_v"), h * kv, fan(h)));
            mat(&mut w, &n("attn_output"), &[q, h], draw(&n("attn_output"), q * h, fan(q)));
            if self.arch.qkv_bias() {
                for (name, len) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)] {
                    let b = format!("blk.{l}.{name}.bias");
                    f32s(&mut w, &b, &[len], draw(&b, len, 0.5));
                }
            }
            if self.arch.qk_norm() {
                // Per head (qwen3) or over the whole projection (olmoe).
                let whole = self.arch.qk_norm_whole();
                for (name, len) in [("attn_q_norm", if whole { q } else { hd }), ("attn_k_norm", if whole { kv } else { hd })] {
                    let g = draw(&n(name), len, 0.2).into_iter().map(|g| 1.0 + g).collect::<Vec<f32>>();
                    f32s(&mut w, &n(name), &[len], g);
                }
            }
            if self.arch.shared_expert() {
                // Its gate's logits spread by a few units, so the sigmoid is neither 0 nor 1.
                f32s(&mut w, &n("ffn_gate_inp_shexp"), &[h], draw(&n("ffn_gate_inp_shexp"), h, 1.5 * fan(h)));
                mat(&mut w, &n("ffn_gate_shexp"), &[h, fs], draw(&n("ffn_gate_shexp"), h * fs, fan(h)));
                mat(&mut w, &n("ffn_up_shexp"), &[h, fs], draw(&n("ffn_up_shexp"), h * fs, fan(h)));
                mat(&mut w, &n("ffn_down_shexp"), &[fs, h], draw(&n("ffn_down_shexp"), fs * h, fan(fs)));
            }
            if self.experts == 0 {
                mat(&mut w, &n("ffn_gate"), &[h, f], draw(&n("ffn_gate"), h * f, fan(h)));
                mat(&mut w, &n("ffn_up"), &[h, f], draw(&n("ffn_up"), h * f, fan(h)));
                mat(&mut w, &n("ffn_down"), &[f, h], draw(&n("ffn_down"), f * h, fan(f)));
                continue;
            }
            // The router's logits spread by several units, so the top k stand clear of the rest.
            f32s(&mut w, &n("ffn_gate_inp"), &[h, e], draw(&n("ffn_gate_inp"), h * e, 0.5));
            for (exps, dense, dims, scale) in [
                ("ffn_gate_exps", "ffn_gate", [h, f, e], fan(h)),
                ("ffn_up_exps", "ffn_up", [h, f, e], fan(h)),
                ("ffn_down_exps", "ffn_down", [f, h, e], fan(f)),
            ] {
                let data = if self.identical_experts {
                    draw(&n(dense), h * f, scale).repeat(e as usize)
                } else {
                    draw(&n(exps), h * f * e, scale)
                };
                mat(&mut w, &n(exps), &dims, data);
            }
        }
        w.finish()
    }
}

impl SyntheticModel {
    /// Whether the experts' size is written as `expert_feed_forward_length` beside a different
    /// dense `feed_forward_length` (qwen3moe, qwen2moe), as those files do.
    fn own_expert_size(&self) -> bool {
        matches!(self.arch, crate::config::Arch::Qwen3Moe | crate::config::Arch::Qwen2Moe)
    }

    /// Neurons of the shared expert (`qwen2moe`): twice an expert's, as a size of its own.
    pub fn shared_ffn(&self) -> u32 {
        if self.arch.shared_expert() { 2 * self.ffn } else { 0 }
    }
}

/// `data` (a multiple of 32 values) as `format`'s bytes: F32 as it is; Q8_0 blocks of an f16
/// scale and 32 signed bytes; Q4_1 blocks of an f16 scale and minimum and 32 nibbles (value `j`
/// in the low nibble of byte `j`, value `16 + j` in its high nibble), as ggml lays them out.
pub(crate) fn quantize(format: GgmlType, data: &[f32]) -> Vec<u8> {
    // Large tensors in parts of whole super-blocks on every core; each block is quantized alone,
    // so the bytes are the same.
    const PART: usize = 1 << 20;
    if data.len() > PART {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let per = data.len().div_ceil(threads).next_multiple_of(256);
        return std::thread::scope(|s| {
            let parts: Vec<_> = data.chunks(per).map(|c| s.spawn(move || quantize_part(format, c))).collect();
            parts.into_iter().flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
        });
    }
    quantize_part(format, data)
}

/// [`quantize`] on one thread.
fn quantize_part(format: GgmlType, data: &[f32]) -> Vec<u8> {
    let f16 = |v: f32| half::f16::from_f32(v);
    match format {
        GgmlType::Q8_0 => data
            .chunks(32)
            .flat_map(|b| {
                let d = f16(b.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0);
                let inv = if d.to_f32() > 0.0 { 1.0 / d.to_f32() } else { 0.0 };
                let mut out = d.to_le_bytes().to_vec();
                out.extend(b.iter().map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8));
                out
            })
            .collect(),
        GgmlType::Q4_1 => data
            .chunks(32)
            .flat_map(|b| {
                let lo = b.iter().copied().fold(f32::INFINITY, f32::min);
                let hi = b.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let (d, m) = (f16((hi - lo) / 15.0), f16(lo));
                let inv = if d.to_f32() > 0.0 { 1.0 / d.to_f32() } else { 0.0 };
                let q = |v: f32| ((v - m.to_f32()) * inv).round().clamp(0.0, 15.0) as u8;
                let mut out = d.to_le_bytes().to_vec();
                out.extend(m.to_le_bytes());
                out.extend((0..16).map(|j| q(b[j]) | (q(b[16 + j]) << 4)));
                out
            })
            .collect(),
        GgmlType::Q4K => data.chunks(256).flat_map(quantize_q4_k).collect(),
        _ => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// One Q4_K block (ggml's `block_q4_K`, 144 bytes) of 256 values: eight sub-blocks of 32, each
/// with a 6-bit scale and a 6-bit minimum relative to the block's f16 `d` and `dmin`, 4-bit
/// values; the scales and minimums packed as `get_scale_min_k4` reads them (sub-blocks 0-3 in
/// the low 6 bits of bytes 0-3 and 4-7, sub-blocks 4-7 in the nibbles of bytes 8-11 and the top
/// two bits of bytes 0-7), the values of sub-blocks 2j and 2j+1 in the low and high nibbles of
/// bytes 32j..32j+32.
fn quantize_q4_k(x: &[f32]) -> Vec<u8> {
    let f16 = |v: f32| half::f16::from_f32(v);
    let (mut scale, mut min) = ([0f32; 8], [0f32; 8]);
    for (i, sub) in x.chunks(32).enumerate() {
        let lo = sub.iter().copied().fold(0f32, f32::min);
        let hi = sub.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        (scale[i], min[i]) = ((hi - lo) / 15.0, -lo);
    }
    let d = f16(scale.iter().copied().fold(0f32, f32::max) / 63.0);
    let dmin = f16(min.iter().copied().fold(0f32, f32::max) / 63.0);
    let q6 = |v: f32, unit: f32| if unit > 0.0 { (v / unit).round().clamp(0.0, 63.0) as u8 } else { 0 };
    let sc: Vec<u8> = scale.iter().map(|&v| q6(v, d.to_f32())).collect();
    let m: Vec<u8> = min.iter().map(|&v| q6(v, dmin.to_f32())).collect();
    let mut out = Vec::with_capacity(144);
    out.extend(d.to_le_bytes());
    out.extend(dmin.to_le_bytes());
    let mut packed = [0u8; 12];
    for j in 0..4 {
        packed[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        packed[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        packed[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4);
    }
    out.extend(packed);
    let q = |i: usize| -> u8 {
        let sub = i / 32;
        let step = d.to_f32() * f32::from(sc[sub]);
        let offset = dmin.to_f32() * f32::from(m[sub]);
        if step > 0.0 { ((x[i] + offset) / step).round().clamp(0.0, 15.0) as u8 } else { 0 }
    };
    for j in 0..4 {
        out.extend((0..32).map(|l| q(64 * j + l) | (q(64 * j + 32 + l) << 4)));
    }
    out
}

/// The synthetic SentencePiece vocabulary: (text, llama.cpp token type, score).
fn sentencepiece_vocabulary() -> Vec<(String, i32, f32)> {
    let mut v = vec![("<unk>".to_string(), 2, 0.0), ("<s>".to_string(), 3, 0.0), ("</s>".to_string(), 3, 0.0)];
    v.extend((0..=255u8).map(|b| (format!("<0x{b:02X}>"), 6, 0.0)));
    let pieces = ["▁", "e", "t", "a", "o", "i", "n", "s", "h", "r", "▁t", "he", "▁the", "▁a", "in", "an", "▁an", "er", "on", "▁s"];
    v.extend(pieces.iter().enumerate().map(|(i, p)| (p.to_string(), 1, -(i as f32) / 4.0)));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Q4_K blocks written here read back through the GGUF dequantiser within half a 4-bit step
    /// of each sub-block plus the rounding of its 6-bit scale and minimum, on random blocks with
    /// an all-positive sub-block and a constant one among them.
    #[test]
    fn q4_k_blocks_round_trip_within_a_step_cpu() {
        let mut rng = Rng::new(41);
        for block in 0..64 {
            let mut x: Vec<f32> = (0..256).map(|_| (rng.normal() * 0.05) as f32).collect();
            x[..32].iter_mut().for_each(|v| *v = v.abs() + 0.01);
            x[32..64].iter_mut().for_each(|v| *v = 0.02);
            let bytes = quantize(GgmlType::Q4K, &x);
            assert_eq!(bytes.len(), 144);
            let mut y = vec![0f32; 256];
            crate::gguf::dequantize(GgmlType::Q4K, &bytes, &mut y).expect("dequantize");
            // The block's 6-bit units: a sub-block's scale and minimum are rounded to multiples of
            // d and dmin, which moves its values by up to 15 d / 2 and dmin / 2 beyond the 4-bit step.
            let range = |xs: &[f32]| {
                let lo = xs.iter().copied().fold(0f32, f32::min);
                (lo, xs.iter().copied().fold(f32::NEG_INFINITY, f32::max))
            };
            let subs: Vec<(f32, f32)> = x.chunks(32).map(range).collect();
            let d = subs.iter().map(|(lo, hi)| (hi - lo) / 15.0).fold(0f32, f32::max) / 63.0;
            let dmin = subs.iter().map(|(lo, _)| -lo).fold(0f32, f32::max) / 63.0;
            for (sub, ((xs, ys), (lo, hi))) in x.chunks(32).zip(y.chunks(32)).zip(&subs).enumerate() {
                let step = (hi - lo) / 15.0;
                let bound = step / 2.0 + 8.0 * d + dmin + 1e-6;
                for (a, b) in xs.iter().zip(ys) {
                    assert!((a - b).abs() <= bound, "block {block}, sub-block {sub}: {a} read back as {b} (bound {bound})");
                }
            }
        }
    }
}
