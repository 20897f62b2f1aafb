//! A model's hyper-parameters, read from its GGUF metadata.

use crate::Result;
use crate::gguf::{Gguf, model_err};

/// The transformer families this crate runs (`general.architecture`), each with llama.cpp's
/// tensor names and metadata keys (`<arch>.block_count`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// `llama` (also Mistral and Mixtral): adjacent-pair ("normal") RoPE, no biases.
    Llama,
    /// `qwen2`: Q, K and V projections with biases (`attn_q.bias`, ...), half-offset (NeoX) RoPE.
    Qwen2,
    /// `qwen3`: per-head RMSNorm of queries and keys before RoPE (`attn_q_norm`,
    /// `attn_k_norm`, `[head_dim]`), no biases, NeoX RoPE.
    Qwen3,
    /// `qwen3moe` (Qwen3-30B-A3B and kin): Qwen3's attention and llama.cpp's stacked experts,
    /// each of `expert_feed_forward_length` neurons, the chosen experts' softmax weights
    /// renormalised over the top k (as Mixtral's).
    Qwen3Moe,
}

impl Arch {
    /// The `general.architecture` name, also the metadata keys' prefix.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
        }
    }

    /// Whether RoPE rotates pairs half a head apart (`x[i]`, `x[i + d/2]`, llama.cpp's
    /// `LLAMA_ROPE_TYPE_NEOX`) rather than adjacent ones.
    pub fn rope_neox(self) -> bool {
        !matches!(self, Arch::Llama)
    }

    /// Whether the Q, K and V projections carry biases.
    pub fn qkv_bias(self) -> bool {
        matches!(self, Arch::Qwen2)
    }

    /// Whether queries and keys are RMS-normed per head before RoPE.
    pub fn qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Qwen3Moe)
    }
}

/// The hyper-parameters of a Llama-family model, from its GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// `general.architecture`.
    pub arch: Arch,
    /// `llama.block_count`: transformer layers.
    pub block_count: u32,
    /// `llama.embedding_length`: the hidden size.
    pub embedding_length: u32,
    /// `<arch>.feed_forward_length`: the FFN's inner size (SwiGLU); in a MoE file each
    /// expert's (`<arch>.expert_feed_forward_length` where given).
    pub feed_forward_length: u32,
    /// `llama.attention.head_count`: query heads.
    pub head_count: u32,
    /// `llama.attention.head_count_kv` (default: `head_count`).
    pub head_count_kv: u32,
    /// `llama.attention.key_length` (default: `embedding_length / head_count`).
    pub head_dim: u32,
    /// `llama.rope.freq_base` (default 10000).
    pub rope_freq_base: f32,
    /// `llama.rope.dimension_count` (default: `head_dim`).
    pub rope_dimension_count: u32,
    /// `llama.attention.layer_norm_rms_epsilon`.
    pub rms_norm_eps: f32,
    /// `llama.context_length`: the trained context.
    pub context_length: u32,
    /// Entries of `tokenizer.ggml.tokens` (checked against `llama.vocab_size` when present).
    pub vocab_size: u32,
    /// `llama.expert_count` / `llama.expert_used_count` (0 for a dense model).
    pub expert_count: u32,
    /// `llama.expert_used_count`: experts each token is routed to (the top k), in
    /// 1..=`expert_count` for a MoE file; 0 for a dense model.
    pub expert_used_count: u32,
}

impl LlamaConfig {
    /// Reads and checks the hyper-parameters; `general.architecture` must be one of [`Arch`]'s.
    pub fn from_gguf(g: &Gguf<'_>) -> Result<Self> {
        let name = g.get_str("general.architecture")?;
        let arch = match name {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "qwen3moe" => Arch::Qwen3Moe,
            other => {
                return Err(model_err(format!("general.architecture is `{other}`; supported: llama, qwen2, qwen3, qwen3moe")));
            }
        };
        let key = |k: &str| format!("{name}.{k}");
        let embedding_length = g.get_u32(&key("embedding_length"))?;
        let head_count = g.get_u32(&key("attention.head_count"))?;
        if head_count == 0 || embedding_length == 0 {
            return Err(model_err(format!("{name}.embedding_length {embedding_length} and head_count {head_count} must be positive")));
        }
        let head_dim = match g.opt(&key("attention.key_length"), Gguf::get_u32)? {
            Some(d) => d,
            None if embedding_length % head_count == 0 => embedding_length / head_count,
            None => {
                return Err(model_err(format!(
                    "{name}.embedding_length {embedding_length} is not a multiple of head_count {head_count} (and no key_length)"
                )));
            }
        };
        let head_count_kv = g.opt(&key("attention.head_count_kv"), Gguf::get_u32)?.unwrap_or(head_count);
        if head_count_kv == 0 || head_count % head_count_kv != 0 {
            return Err(model_err(format!("{name}.attention.head_count_kv {head_count_kv} does not divide head_count {head_count}")));
        }
        let tokens = g.get_array("tokenizer.ggml.tokens")?.len();
        let vocab_size = u32::try_from(tokens).map_err(|_| model_err(format!("tokenizer.ggml.tokens has {tokens} entries")))?;
        if let Some(v) = g.opt(&key("vocab_size"), Gguf::get_u32)?
            && v != vocab_size
        {
            return Err(model_err(format!("{name}.vocab_size is {v} but tokenizer.ggml.tokens has {vocab_size} entries")));
        }
        let c = LlamaConfig {
            arch,
            block_count: g.get_u32(&key("block_count"))?,
            embedding_length,
            // A MoE file's experts may have their own size (qwen3moe), the dense size unused.
            feed_forward_length: match g.opt(&key("expert_feed_forward_length"), Gguf::get_u32)? {
                Some(f) if g.opt(&key("expert_count"), Gguf::get_u32)?.unwrap_or(0) > 0 => f,
                _ => g.get_u32(&key("feed_forward_length"))?,
            },
            head_count,
            head_count_kv,
            head_dim,
            rope_freq_base: g.opt(&key("rope.freq_base"), Gguf::get_f32)?.unwrap_or(10_000.0),
            rope_dimension_count: g.opt(&key("rope.dimension_count"), Gguf::get_u32)?.unwrap_or(head_dim),
            rms_norm_eps: g.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            context_length: g.get_u32(&key("context_length"))?,
            vocab_size,
            expert_count: g.opt(&key("expert_count"), Gguf::get_u32)?.unwrap_or(0),
            expert_used_count: g.opt(&key("expert_used_count"), Gguf::get_u32)?.unwrap_or(0),
        };
        if c.expert_count > 0 && !matches!(arch, Arch::Llama | Arch::Qwen3Moe) {
            return Err(model_err(format!(
                "{name} with experts (expert_count {}) is not supported; llama (Mixtral) and qwen3moe MoE files are",
                c.expert_count
            )));
        }
        if arch == Arch::Qwen3Moe && c.expert_count == 0 {
            return Err(model_err("qwen3moe without qwen3moe.expert_count"));
        }
        if c.expert_count > 0 && !(1..=c.expert_count).contains(&c.expert_used_count) {
            return Err(model_err(format!(
                "llama.expert_used_count {} must be in 1..={} (llama.expert_count)",
                c.expert_used_count, c.expert_count
            )));
        }
        if c.block_count == 0 || c.feed_forward_length == 0 || c.vocab_size == 0 || c.head_dim == 0 {
            return Err(model_err(format!("degenerate Llama hyper-parameters: {c:?}")));
        }
        if c.rope_dimension_count > c.head_dim || !c.rope_dimension_count.is_multiple_of(2) {
            return Err(model_err(format!(
                "llama.rope.dimension_count {} must be even and at most head_dim {}",
                c.rope_dimension_count, c.head_dim
            )));
        }
        if !(c.rms_norm_eps.is_finite() && c.rms_norm_eps > 0.0 && c.rope_freq_base.is_finite() && c.rope_freq_base > 0.0) {
            return Err(model_err(format!("RMSNorm epsilon {} and RoPE base {} must be positive", c.rms_norm_eps, c.rope_freq_base)));
        }
        Ok(c)
    }

    /// Query heads per KV head (grouped-query attention).
    pub fn group_size(&self) -> u32 {
        self.head_count / self.head_count_kv
    }

    /// Whether the LM head reuses the token embeddings (no `output.weight` tensor).
    pub fn tied_embeddings(g: &Gguf<'_>) -> bool {
        g.tensor("output.weight").is_none()
    }

    /// Checks that every tensor a Llama forward pass reads is present with the shape these
    /// hyper-parameters imply (ggml order: input dimension first). A Mixture-of-Experts file
    /// (`llama.expert_count` > 0, llama.cpp's layout) has per layer the router
    /// `ffn_gate_inp` `[hidden, E]` and the experts stacked in `ffn_gate_exps` / `ffn_up_exps`
    /// `[hidden, ffn, E]` and `ffn_down_exps` `[ffn, hidden, E]`, `ffn` being each expert's size.
    pub fn check_tensors(&self, g: &Gguf<'_>) -> Result<()> {
        let (h, f, v) = (u64::from(self.embedding_length), u64::from(self.feed_forward_length), u64::from(self.vocab_size));
        let q = u64::from(self.head_count) * u64::from(self.head_dim);
        let kv = u64::from(self.head_count_kv) * u64::from(self.head_dim);
        let want = |name: &str, dims: &[u64]| -> Result<()> {
            let t = g.tensor(name).ok_or_else(|| model_err(format!("tensor `{name}` is missing")))?;
            if t.dims() != dims {
                return Err(model_err(format!("tensor `{name}` has dims {:?}, expected {dims:?}", t.dims())));
            }
            Ok(())
        };
        want("token_embd.weight", &[h, v])?;
        want("output_norm.weight", &[h])?;
        if !Self::tied_embeddings(g) {
            want("output.weight", &[h, v])?;
        }
        for l in 0..self.block_count {
            want(&format!("blk.{l}.attn_norm.weight"), &[h])?;
            want(&format!("blk.{l}.attn_q.weight"), &[h, q])?;
            want(&format!("blk.{l}.attn_k.weight"), &[h, kv])?;
            want(&format!("blk.{l}.attn_v.weight"), &[h, kv])?;
            want(&format!("blk.{l}.attn_output.weight"), &[q, h])?;
            if self.arch.qkv_bias() {
                want(&format!("blk.{l}.attn_q.bias"), &[q])?;
                want(&format!("blk.{l}.attn_k.bias"), &[kv])?;
                want(&format!("blk.{l}.attn_v.bias"), &[kv])?;
            }
            if self.arch.qk_norm() {
                want(&format!("blk.{l}.attn_q_norm.weight"), &[u64::from(self.head_dim)])?;
                want(&format!("blk.{l}.attn_k_norm.weight"), &[u64::from(self.head_dim)])?;
            }
            want(&format!("blk.{l}.ffn_norm.weight"), &[h])?;
            if self.expert_count == 0 {
                want(&format!("blk.{l}.ffn_gate.weight"), &[h, f])?;
                want(&format!("blk.{l}.ffn_up.weight"), &[h, f])?;
                want(&format!("blk.{l}.ffn_down.weight"), &[f, h])?;
            } else {
                let e = u64::from(self.expert_count);
                if g.tensor(&format!("blk.{l}.ffn_gate_exps.weight")).is_none() && g.tensor(&format!("blk.{l}.ffn_gate.0.weight")).is_some()
                {
                    return Err(model_err(
                        "this MoE file stores each expert as its own tensor (`ffn_gate.0`, the layout before llama.cpp stacked them in \
                         `ffn_gate_exps`); convert it again with a current llama.cpp",
                    ));
                }
                want(&format!("blk.{l}.ffn_gate_inp.weight"), &[h, e])?;
                want(&format!("blk.{l}.ffn_gate_exps.weight"), &[h, f, e])?;
                want(&format!("blk.{l}.ffn_up_exps.weight"), &[h, f, e])?;
                want(&format!("blk.{l}.ffn_down_exps.weight"), &[f, h, e])?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SyntheticModel;

    #[test]
    fn architectures_are_read_by_name_and_others_refused_by_name() {
        for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
            let file = SyntheticModel { arch, ..SyntheticModel::dense(1) }.gguf();
            let c = LlamaConfig::from_gguf(&Gguf::parse(&file).expect("gguf")).expect("config");
            assert_eq!(c.arch, arch);
            c.check_tensors(&Gguf::parse(&file).expect("gguf")).expect("tensors");
        }
        let mut w = crate::gguf::writer::GgufWriter::new();
        w.str("general.architecture", "gemma2").strs("tokenizer.ggml.tokens", &["a"]);
        let bytes = w.finish();
        let e = LlamaConfig::from_gguf(&Gguf::parse(&bytes).expect("gguf")).expect_err("gemma2");
        assert!(e.to_string().contains("`gemma2`; supported: llama, qwen2, qwen3, qwen3moe"), "{e}");
        // A Qwen file without its biases is refused by tensor name.
        let llama = SyntheticModel::dense(1).gguf();
        let g = Gguf::parse(&llama).expect("gguf");
        let mut c = LlamaConfig::from_gguf(&g).expect("config");
        c.arch = Arch::Qwen2;
        let e = c.check_tensors(&g).expect_err("no biases");
        assert!(e.to_string().contains("blk.0.attn_q.bias"), "{e}");
    }
}
