//! A model's hyper-parameters, read from its GGUF metadata.

use crate::Result;
use crate::gguf::{Gguf, model_err};

/// The metadata key that marks a MoE file whose chosen experts weigh 1 (value `unit`), written by
/// [`crate::moe_file::write_moefied`].
pub const UNIT_GATING_KEY: &str = "expertkv.expert_gating";

/// How a layer's router scores a token and weights the experts it chose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// MoEfication: the scores are cosines (the token normalised), every chosen expert weighs 1.
    Unit,
    /// A trained MoE: the scores are the router's raw logits `W x`, and the chosen experts weigh
    /// the softmax of their logits ([`softmax_weights`](crate::moe::softmax_weights): Mixtral,
    /// Qwen3-MoE).
    Softmax,
    /// A trained MoE whose chosen experts weigh their share of the softmax over all `E` logits,
    /// not renormalised over the top k
    /// ([`softmax_share_weights`](crate::moe::softmax_share_weights): OLMoE, Qwen2-MoE).
    SoftmaxShare,
}

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
    /// `olmoe` (OLMoE): RMSNorm of the whole query and key projections (`attn_q_norm`
    /// `[heads * head_dim]`, `attn_k_norm` `[kv_heads * head_dim]`) before NeoX RoPE, stacked
    /// experts weighted by their share of a softmax over all experts (not renormalised).
    Olmoe,
    /// `qwen2moe` (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention, stacked experts of
    /// `expert_feed_forward_length` weighted as OLMoE's, and a shared expert of
    /// `expert_shared_feed_forward_length` (`ffn_*_shexp`) every token runs, scaled by the
    /// sigmoid of its own gate `ffn_gate_inp_shexp`.
    Qwen2Moe,
}

impl Arch {
    /// The `general.architecture` name, also the metadata keys' prefix.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Olmoe => "olmoe",
            Arch::Qwen2Moe => "qwen2moe",
        }
    }

    /// Every architecture, in the order of [`Arch::name`]'s list in errors.
    pub const ALL: [Arch; 6] = [Arch::Llama, Arch::Qwen2, Arch::Qwen3, Arch::Qwen3Moe, Arch::Olmoe, Arch::Qwen2Moe];

    /// The architecture of a `general.architecture` name.
    pub fn from_name(name: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.name() == name)
    }

    /// The supported names, comma-separated (for errors and help).
    pub fn names() -> String {
        Arch::ALL.map(Arch::name).join(", ")
    }

    /// Whether RoPE rotates pairs half a head apart (`x[i]`, `x[i + d/2]`, llama.cpp's
    /// `LLAMA_ROPE_TYPE_NEOX`) rather than adjacent ones.
    pub fn rope_neox(self) -> bool {
        !matches!(self, Arch::Llama)
    }

    /// Whether the Q, K and V projections carry biases.
    pub fn qkv_bias(self) -> bool {
        matches!(self, Arch::Qwen2 | Arch::Qwen2Moe)
    }

    /// Whether queries and keys are RMS-normed per head before RoPE.
    pub fn qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Olmoe)
    }

    /// Whether the query and key norms span the whole projection (`olmoe`: one RMS over all
    /// heads, gains `[heads * head_dim]`) rather than each head (`qwen3`: gains `[head_dim]`).
    pub fn qk_norm_whole(self) -> bool {
        matches!(self, Arch::Olmoe)
    }

    /// Whether the file must have experts (`expert_count` > 0).
    pub fn moe_only(self) -> bool {
        matches!(self, Arch::Qwen3Moe | Arch::Olmoe | Arch::Qwen2Moe)
    }

    /// Whether the chosen experts' softmax weights are renormalised over the top k (Mixtral,
    /// Qwen3-MoE: llama.cpp's `norm_w`) rather than kept as their share of the softmax over all
    /// experts (OLMoE, Qwen2-MoE).
    pub fn renormalise_top_k(self) -> bool {
        matches!(self, Arch::Llama | Arch::Qwen3Moe)
    }

    /// Whether each layer has a shared expert beside the routed ones (`qwen2moe`).
    pub fn shared_expert(self) -> bool {
        matches!(self, Arch::Qwen2Moe)
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
    /// Neurons of the shared expert (`qwen2moe.expert_shared_feed_forward_length`, else
    /// `feed_forward_length`, as llama.cpp reads it); 0 without one.
    pub shared_feed_forward_length: u32,
    /// `expertkv.expert_gating` = `unit`: the chosen experts weigh 1 each, not their router's
    /// softmax (a MoEfied dense model written as a MoE file, [`crate::moe_file`]); false
    /// without the key.
    pub unit_expert_weights: bool,
}

impl LlamaConfig {
    /// Reads and checks the hyper-parameters; `general.architecture` must be one of [`Arch`]'s.
    pub fn from_gguf(g: &Gguf<'_>) -> Result<Self> {
        let name = g.get_str("general.architecture")?;
        let Some(arch) = Arch::from_name(name) else {
            return Err(model_err(format!("general.architecture is `{name}`; supported: {}", Arch::names())));
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
        let expert_count = g.opt(&key("expert_count"), Gguf::get_u32)?.unwrap_or(0);
        let expert_used_count = g.opt(&key("expert_used_count"), Gguf::get_u32)?.unwrap_or(0);
        let dense_ffn = g.get_u32(&key("feed_forward_length"));
        // A MoE file's experts may have their own size (qwen3moe, qwen2moe), the dense size then
        // unused; qwen2moe without it splits the dense size over the top k (llama.cpp's fallback).
        let feed_forward_length = match g.opt(&key("expert_feed_forward_length"), Gguf::get_u32)? {
            Some(f) if expert_count > 0 => f,
            _ if arch == Arch::Qwen2Moe && (1..=expert_count).contains(&expert_used_count) => dense_ffn? / expert_used_count,
            _ => dense_ffn?,
        };
        let shared_feed_forward_length = if arch.shared_expert() {
            match g.opt(&key("expert_shared_feed_forward_length"), Gguf::get_u32)? {
                Some(f) => f,
                None => g.get_u32(&key("feed_forward_length"))?,
            }
        } else {
            0
        };
        let unit_expert_weights = match g.opt(UNIT_GATING_KEY, Gguf::get_str)? {
            None => false,
            Some("unit") if expert_count > 0 => true,
            Some("unit") => return Err(model_err(format!("{UNIT_GATING_KEY} is `unit` but the file has no experts"))),
            Some(other) => {
                return Err(model_err(format!(
                    "{UNIT_GATING_KEY} is `{other}`: `unit` (experts that weigh 1, a MoEfied model) is the only value read"
                )));
            }
        };
        let c = LlamaConfig {
            arch,
            block_count: g.get_u32(&key("block_count"))?,
            embedding_length,
            feed_forward_length,
            head_count,
            head_count_kv,
            head_dim,
            rope_freq_base: g.opt(&key("rope.freq_base"), Gguf::get_f32)?.unwrap_or(10_000.0),
            rope_dimension_count: g.opt(&key("rope.dimension_count"), Gguf::get_u32)?.unwrap_or(head_dim),
            rms_norm_eps: g.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            context_length: g.get_u32(&key("context_length"))?,
            vocab_size,
            expert_count,
            expert_used_count,
            shared_feed_forward_length,
            unit_expert_weights,
        };
        if c.expert_count > 0 && !(arch == Arch::Llama || arch.moe_only()) {
            return Err(model_err(format!(
                "{name} with experts (expert_count {}) is not supported; llama (Mixtral), qwen3moe, olmoe and qwen2moe MoE files are",
                c.expert_count
            )));
        }
        if arch.moe_only() && c.expert_count == 0 {
            return Err(model_err(format!("{name} without {name}.expert_count")));
        }
        if arch.shared_expert() && c.shared_feed_forward_length == 0 {
            return Err(model_err(format!("{name}.expert_shared_feed_forward_length is 0")));
        }
        if c.expert_count > 0 && !(1..=c.expert_count).contains(&c.expert_used_count) {
            return Err(model_err(format!(
                "{name}.expert_used_count {} must be in 1..={} ({name}.expert_count)",
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

    /// How the router's chosen experts are weighted: [`Gating::Unit`] for a MoEfied file
    /// ([`LlamaConfig::unit_expert_weights`]), else the architecture's softmax.
    pub fn expert_gating(&self) -> Gating {
        if self.unit_expert_weights {
            Gating::Unit
        } else if self.arch.renormalise_top_k() {
            Gating::Softmax
        } else {
            Gating::SoftmaxShare
        }
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
                let (nq, nk) = if self.arch.qk_norm_whole() { (q, kv) } else { (u64::from(self.head_dim), u64::from(self.head_dim)) };
                want(&format!("blk.{l}.attn_q_norm.weight"), &[nq])?;
                want(&format!("blk.{l}.attn_k_norm.weight"), &[nk])?;
            }
            if self.arch.shared_expert() {
                let fs = u64::from(self.shared_feed_forward_length);
                want(&format!("blk.{l}.ffn_gate_inp_shexp.weight"), &[h])?;
                want(&format!("blk.{l}.ffn_gate_shexp.weight"), &[h, fs])?;
                want(&format!("blk.{l}.ffn_up_shexp.weight"), &[h, fs])?;
                want(&format!("blk.{l}.ffn_down_shexp.weight"), &[fs, h])?;
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
        for arch in Arch::ALL {
            let base = if arch.moe_only() { SyntheticModel::moe(1, 4, 2) } else { SyntheticModel::dense(1) };
            let file = SyntheticModel { arch, ..base }.gguf();
            let c = LlamaConfig::from_gguf(&Gguf::parse(&file).expect("gguf")).expect("config");
            assert_eq!(c.arch, arch);
            c.check_tensors(&Gguf::parse(&file).expect("gguf")).expect("tensors");
        }
        let mut w = crate::gguf::writer::GgufWriter::new();
        w.str("general.architecture", "gemma2").strs("tokenizer.ggml.tokens", &["a"]);
        let bytes = w.finish();
        let e = LlamaConfig::from_gguf(&Gguf::parse(&bytes).expect("gguf")).expect_err("gemma2");
        assert!(e.to_string().contains("`gemma2`; supported: llama, qwen2, qwen3, qwen3moe, olmoe, qwen2moe"), "{e}");
        // A Qwen file without its biases is refused by tensor name.
        let llama = SyntheticModel::dense(1).gguf();
        let g = Gguf::parse(&llama).expect("gguf");
        let mut c = LlamaConfig::from_gguf(&g).expect("config");
        c.arch = Arch::Qwen2;
        let e = c.check_tensors(&g).expect_err("no biases");
        assert!(e.to_string().contains("blk.0.attn_q.bias"), "{e}");
    }
}
