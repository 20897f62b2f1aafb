//! `expertkv synth`: write a random Llama-architecture GGUF (dense, or a Mixture-of-Experts file
//! in llama.cpp's layout), for trying `run` and `eval` on shapes no shipped model has. The
//! weights are random: the text it generates is noise, its speed and memory are real.

use anyhow::{Context, Result, bail};
use clap::Args;
use expertkv_model::SyntheticModel;
use expertkv_model::gguf::GgmlType;

#[derive(Args)]
pub struct SynthArgs {
    /// The file to write.
    #[arg(long)]
    out: std::path::PathBuf,
    /// Experts per layer (0: a dense FFN).
    #[arg(long, default_value_t = 8)]
    experts: u32,
    /// Experts used per token (llama.expert_used_count).
    #[arg(long, default_value_t = 2)]
    top_k: u32,
    #[arg(long, default_value_t = 2)]
    layers: u32,
    /// Hidden features (a multiple of 32).
    #[arg(long, default_value_t = 128)]
    hidden: u32,
    /// Query heads (head_dim = hidden / heads).
    #[arg(long, default_value_t = 2)]
    heads: u32,
    #[arg(long, default_value_t = 1)]
    kv_heads: u32,
    /// Neurons of the dense FFN, or of each expert.
    #[arg(long, default_value_t = 96)]
    ffn: u32,
    /// Trained context (llama.context_length).
    #[arg(long, default_value_t = 2048)]
    context: u32,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How the matrices are stored: f32, q8_0, q4_1 or q4_k (norms and routers stay F32).
    #[arg(long, default_value = "f32")]
    weights: String,
    /// Give the model an LM head of its own (`output.weight`) instead of reusing the token
    /// embeddings: greedy decoding then varies its tokens instead of repeating the last one.
    #[arg(long)]
    untied_output: bool,
    /// A SentencePiece-style vocabulary (`tokenizer.ggml.model` = `llama`, as Mixtral files
    /// carry: scores and byte fallback) instead of byte-level BPE.
    #[arg(long)]
    sentencepiece: bool,
    /// The architecture: llama, qwen2 (Q/K/V biases, NeoX RoPE), qwen3 (per-head Q/K norms,
    /// NeoX RoPE; dense), or with experts qwen3moe (Qwen3's attention), olmoe (whole-projection
    /// Q/K norms, experts not renormalised) or qwen2moe (Qwen2's attention, a shared expert).
    #[arg(long, default_value = "llama")]
    arch: String,
}

pub fn run(a: &SynthArgs) -> Result<()> {
    if a.experts > 0 && !(1..=a.experts).contains(&a.top_k) {
        bail!("--top-k must be in 1..={} (--experts)", a.experts);
    }
    if a.hidden == 0
        || a.heads == 0
        || a.kv_heads == 0
        || !a.hidden.is_multiple_of(32)
        || !a.hidden.is_multiple_of(a.heads)
        || !a.heads.is_multiple_of(a.kv_heads)
    {
        bail!("--hidden must be a positive multiple of 32 and of --heads, and --kv-heads must divide --heads");
    }
    if a.layers == 0 || a.ffn == 0 || a.context == 0 {
        bail!("--layers, --ffn and --context must be positive");
    }
    let floats = u64::from(a.layers) * u64::from(a.hidden) * u64::from(a.ffn) * 3 * u64::from(a.experts.max(1));
    if floats > 1 << 33 {
        bail!("{floats} FFN weights is more than this command writes (2^33)");
    }
    let weights = match a.weights.to_ascii_lowercase().as_str() {
        "f32" => GgmlType::F32,
        "q8_0" => GgmlType::Q8_0,
        "q4_1" => GgmlType::Q4_1,
        "q4_k" => GgmlType::Q4K,
        other => bail!("--weights {other}: expected f32, q8_0, q4_1 or q4_k"),
    };
    if weights == GgmlType::Q4K && !(a.hidden.is_multiple_of(256) && a.ffn.is_multiple_of(256)) {
        bail!("--weights q4_k: --hidden and --ffn must be multiples of 256 (the K-quants' block)");
    }
    use expertkv_model::config::Arch;
    let Some(arch) = Arch::from_name(&a.arch) else {
        bail!("--arch {}: expected one of {}", a.arch, Arch::names());
    };
    if matches!(arch, Arch::Qwen2 | Arch::Qwen3) && a.experts > 0 {
        bail!("--arch {}: dense (give --experts 0, or --arch qwen3moe, olmoe or qwen2moe)", a.arch);
    }
    if arch.moe_only() && a.experts == 0 {
        bail!("--arch {} needs experts (--experts E)", a.arch);
    }
    let m = SyntheticModel {
        layers: a.layers,
        hidden: a.hidden,
        heads: a.heads,
        kv_heads: a.kv_heads,
        ffn: a.ffn,
        experts: a.experts,
        top_k: if a.experts == 0 { 0 } else { a.top_k },
        identical_experts: false,
        context: a.context,
        seed: a.seed,
        weights,
        untied_output: a.untied_output,
        sentencepiece: a.sentencepiece,
        arch,
        head_dim: None,
    };
    let t0 = std::time::Instant::now();
    let bytes = m.gguf();
    std::fs::write(&a.out, &bytes).with_context(|| format!("writing {}", a.out.display()))?;
    let ffn = if a.experts == 0 { format!("dense FFN {}", a.ffn) } else { format!("{} experts of {}, top-{}", a.experts, a.ffn, a.top_k) };
    println!(
        "wrote {} ({:.1} MiB, {:.2} s): {} layers, hidden {}, {}/{} heads, {ffn}, random {weights} weights, {}",
        a.out.display(),
        bytes.len() as f64 / (1u64 << 20) as f64,
        t0.elapsed().as_secs_f64(),
        a.layers,
        a.hidden,
        a.heads,
        a.kv_heads,
        if a.sentencepiece { "SentencePiece-style vocabulary (llama) of 279" } else { "byte-level vocabulary of 256" },
    );
    Ok(())
}
