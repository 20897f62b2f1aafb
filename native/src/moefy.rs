//! `expertkv moefy`: a dense model MoEfied (its FFN neurons clustered into experts, the routers
//! optionally fitted) and written as a MoE file in llama.cpp's Mixtral layout, so that the
//! expert cache, `--gpu-mem`'s joint budget, `mix` and every MoE-file path run on a trained
//! model's routing ([`expertkv_model::moe_file`] says what the file holds).
//!
//! The clustering reads every weight as f32 and the file is built in memory before it is
//! written: SmolLM2's 98 MB file peaked at 739 MB of host memory (this machine, 2026-12-06,
//! MoEfication from the cache), about 8x a 4-bit file's size, so an 8B model needs tens of GB.

use crate::fmt_bytes;
use crate::moe_spec::{Moefied, Moefier, parse_moe};
use crate::run::read_model;
use anyhow::{Context, Result, bail};
use clap::Args;
use expertkv_model::LlamaConfig;
use expertkv_model::gguf::Gguf;
use expertkv_model::moe_file::write_moefied;
use expertkv_model::ops::WeightFormat;

#[derive(Args)]
pub struct MoefyArgs {
    /// The dense model to split (GGUF, llama architecture) [default:
    /// models/SmolLM2-135M-Instruct.Q4_1.gguf].
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// Experts per layer and experts per token, `E:K`, with `:fitted` for routers fitted on a
    /// calibration text (SmolLM2 at 8:4:fitted keeps perplexity 577 against 13,441 with
    /// centroids; 8:6:fitted 64.8; dense 24.3: BENCHMARKS.md). Balanced: E must divide the FFN.
    #[arg(long, default_value = "8:4:fitted")]
    moe: String,
    /// How each expert's down projection is stored (a neuron is a column of it, so the model's
    /// blocks cannot be kept): f16 (SmolLM2 8:4:fitted then decodes the MoEfied model's greedy
    /// text), q8_0 (0.53x f16's bytes, experts of whole 32-neuron blocks; changes that text on a
    /// model this uncertain), or f32 (exact). Gate and up keep the model's own blocks.
    #[arg(long, default_value = "f16")]
    down: String,
    /// The MoE file to write (replaced if it exists).
    #[arg(long)]
    out: std::path::PathBuf,
}

pub fn run(a: &MoefyArgs) -> Result<()> {
    let Some(spec) = parse_moe(&a.moe)? else { bail!("--moe {}: give the experts to split into, E:K or E:K:fitted", a.moe) };
    let down = match a.down.to_ascii_lowercase().as_str() {
        "q8_0" => WeightFormat::Q8_0,
        "f16" => WeightFormat::F16,
        "f32" => WeightFormat::F32,
        other => bail!("--down {other}: expected q8_0, f16 or f32"),
    };
    let (path, bytes) = read_model(a.model.as_deref())?;
    if std::fs::canonicalize(&a.out).ok().is_some_and(|o| std::fs::canonicalize(&path).is_ok_and(|p| p == o)) {
        bail!("--out {} is the model itself: write the MoE file elsewhere", a.out.display());
    }
    let g = Gguf::parse(&bytes).with_context(|| format!("{} is not a readable GGUF file", path.display()))?;
    let c = LlamaConfig::from_gguf(&g)?;
    if c.expert_count > 0 {
        bail!("{} is already a MoE file ({} experts per layer): moefy splits a dense model's FFNs", path.display(), c.expert_count);
    }
    let (e, k) = (spec.config.experts, spec.config.top_k);
    let ffn = c.feed_forward_length as usize;
    if e > ffn || !ffn.is_multiple_of(e) {
        bail!("--moe {}: {ffn} FFN neurons do not split into {e} experts of one size (a MoE file's experts are equal)", a.moe);
    }
    if down == WeightFormat::Q8_0 && !(ffn / e).is_multiple_of(32) {
        bail!("--down q8_0: an expert of {} neurons is not whole blocks of 32 (give --down f16)", ffn / e);
    }
    let fitting = if spec.fitted { ", fitting the routers (about 25 s for SmolLM2 on two cores, once: cached)" } else { "" };
    eprintln!("moefy: {} into {e} experts of {} neurons, top {k}{fitting}", path.display(), ffn / e);
    let Moefied { moe, how } = Moefier::new(&g, &bytes, &path).moefy(&spec)?;
    eprintln!("moefy: experts {how}");
    let from = format!(
        "{} ({}), E={e} k={k}, {} routers",
        g.get_str("general.name").unwrap_or("unnamed"),
        path.file_name().map_or_else(|| path.display().to_string(), |f| f.to_string_lossy().into_owned()),
        if spec.fitted { "fitted" } else { "centroid" }
    );
    let t0 = std::time::Instant::now();
    let file = write_moefied(&g, &moe, down, &from).context("writing the MoE file")?;
    // Read back as any MoE file is, before it is written: every tensor and size checked.
    let g2 = Gguf::parse(&file).context("reading the written file back")?;
    let c2 = LlamaConfig::from_gguf(&g2).context("reading the written file back")?;
    c2.check_tensors(&g2).context("the written file's tensors")?;
    // Written beside the target and renamed over it: an interrupted write leaves the old file.
    let tmp = a.out.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, &file).and_then(|()| std::fs::rename(&tmp, &a.out)).map_err(|err| {
        let _ = std::fs::remove_file(&tmp);
        anyhow::anyhow!("writing {}: {err}", a.out.display())
    })?;
    let per_expert: u64 = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
        .iter()
        .filter_map(|t| g2.tensor(&format!("blk.0.{t}.weight")))
        .map(|t| t.n_bytes() / u64::from(c2.expert_count))
        .sum();
    println!(
        "wrote {} ({}) in {:.2} s: {} layers x {e} experts of {} neurons, top {k}, experts weigh 1; an expert {} \
         ({} a layer), down as {}",
        a.out.display(),
        fmt_bytes(file.len() as u64),
        t0.elapsed().as_secs_f64(),
        c2.block_count,
        c2.feed_forward_length,
        fmt_bytes(per_expert),
        fmt_bytes(per_expert * u64::from(c2.expert_count)),
        a.down.to_ascii_lowercase()
    );
    Ok(())
}
