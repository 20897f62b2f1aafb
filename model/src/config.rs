//! A model's hyper-parameters, read from its GGUF metadata.

use crate::Result;
use crate::gguf::{Gguf, model_err};

/// The hyper-parameters of a Llama-architecture model, from its GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// `llama.block_count`: transformer layers.
    pub block_count: u32,
    /// `llama.embedding_length`: the hidden size.
    pub embedding_length: u32,
    /// `llama.feed_forward_length`: the FFN's inner size (SwiGLU).
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
    /// Reads and checks the hyper-parameters; `general.architecture` must be `llama`.
    pub fn from_gguf(g: &Gguf<'_>) -> Result<Self> {
        let arch = g.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(model_err(format!("general.architecture is `{arch}`; only `llama` is supported")));
        }
        let embedding_length = g.get_u32("llama.embedding_length")?;
        let head_count = g.get_u32("llama.attention.head_count")?;
        if head_count == 0 || embedding_length == 0 || embedding_length % head_count != 0 {
            return Err(model_err(format!(
                "llama.embedding_length {embedding_length} is not a positive multiple of head_count {head_count}"
            )));
        }
        let head_count_kv = g.opt("llama.attention.head_count_kv", Gguf::get_u32)?.unwrap_or(head_count);
        if head_count_kv == 0 || head_count % head_count_kv != 0 {
            return Err(model_err(format!("llama.attention.head_count_kv {head_count_kv} does not divide head_count {head_count}")));
        }
        let head_dim = g.opt("llama.attention.key_length", Gguf::get_u32)?.unwrap_or(embedding_length / head_count);
        let tokens = g.get_array("tokenizer.ggml.tokens")?.len();
        let vocab_size = u32::try_from(tokens).map_err(|_| model_err(format!("tokenizer.ggml.tokens has {tokens} entries")))?;
        if let Some(v) = g.opt("llama.vocab_size", Gguf::get_u32)?
            && v != vocab_size
        {
            return Err(model_err(format!("llama.vocab_size is {v} but tokenizer.ggml.tokens has {vocab_size} entries")));
        }
        let c = LlamaConfig {
            block_count: g.get_u32("llama.block_count")?,
            embedding_length,
            feed_forward_length: g.get_u32("llama.feed_forward_length")?,
            head_count,
            head_count_kv,
            head_dim,
            rope_freq_base: g.opt("llama.rope.freq_base", Gguf::get_f32)?.unwrap_or(10_000.0),
            rope_dimension_count: g.opt("llama.rope.dimension_count", Gguf::get_u32)?.unwrap_or(head_dim),
            rms_norm_eps: g.get_f32("llama.attention.layer_norm_rms_epsilon")?,
            context_length: g.get_u32("llama.context_length")?,
            vocab_size,
            expert_count: g.opt("llama.expert_count", Gguf::get_u32)?.unwrap_or(0),
            expert_used_count: g.opt("llama.expert_used_count", Gguf::get_u32)?.unwrap_or(0),
        };
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
