//! `run --prompts FILE --batch N`: many prompts through one model of N sequences, continuously
//! batched ([`expertkv_model::batch`]).

use std::path::Path;

use anyhow::{Context, Result, bail};
use expertkv_core::runtime::Runtime;
use expertkv_model::batch::BatchDecoder;
use expertkv_model::forward::GpuLlama;
use expertkv_model::forward::MAX_SEQS;
use expertkv_model::tokenizer::Tokenizer;
use expertkv_store::PrefixStore;

/// What of `run`'s options a batch reads: these rather than `RunArgs`, so that `run`, which
/// calls into this module, stays the one that knows its whole command line.
#[derive(Clone, Copy, Debug)]
pub struct BatchOptions {
    /// `--tokens`: generated per prompt at most.
    pub tokens: u32,
    /// `--json`: each completion and the figures as JSON lines.
    pub json: bool,
    /// `--time-steps`: decode steps timed back to back after the batch.
    pub time_steps: u32,
}

/// The prompts of `--prompts` (one per non-blank line), or `None` without it; `--batch` checked.
pub fn prompts(batch: u32, path: Option<&Path>) -> Result<Option<Vec<String>>> {
    if batch == 0 || batch > MAX_SEQS {
        bail!("--batch {batch}: expected 1 to {MAX_SEQS} sequences");
    }
    let Some(path) = path else {
        if batch > 1 {
            bail!("--batch {batch} decodes the prompts of --prompts FILE (one per line)");
        }
        return Ok(None);
    };
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read the prompts {}", path.display()))?;
    let prompts: Vec<String> = text.lines().filter(|l| !l.trim().is_empty()).map(str::to_string).collect();
    if prompts.is_empty() {
        bail!("{} holds no prompt (one per line)", path.display());
    }
    Ok(Some(prompts))
}

/// The longest prompt's ids (what sizes the context); a prompt the vocabulary cannot spell is
/// named by its line.
pub fn longest(tok: &Tokenizer, prompts: &[String]) -> Result<Vec<u32>> {
    let mut best = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let ids = tok.encode_prompt(p, true).map_err(|e| anyhow::anyhow!("--prompts, prompt {} (line {}): {e}", i, i + 1))?;
        if ids.len() > best.len() {
            best = ids;
        }
    }
    Ok(best)
}

/// Decode every prompt, printing each completion as it finishes, then the run's figures.
/// With a page store, joining prompts reuse the stored prefixes (this run's earlier prompts'
/// too) and every prompt's pages are stored.
pub fn run(
    rt: &Runtime,
    m: &mut GpuLlama,
    tok: &Tokenizer,
    prompts: &[String],
    mut store: Option<&mut PrefixStore>,
    a: BatchOptions,
) -> Result<()> {
    let layers = m.cfg.block_count;
    let n = m.n_seqs;
    let t0 = std::time::Instant::now();
    let mut dec = BatchDecoder::new(m, tok, a.tokens)?;
    if let Some(s) = store.as_deref_mut() {
        dec = dec.with_prefix_cache(s)?;
    }
    let (done, stats) = pollster::block_on(dec.run(rt, prompts, |c| {
        if a.json {
            println!("{}", serde_json::to_string(c).unwrap_or_default());
        } else {
            println!("[prompt {}, sequence {}, steps {}..{}] {}{}", c.prompt, c.slot, c.steps.0, c.steps.1, prompts[c.prompt], c.text);
        }
    }))?;
    if let Some(s) = store.as_deref_mut() {
        s.finish();
    }
    let secs = t0.elapsed().as_secs_f64();
    let ctl = pollster::block_on(m.kv.pool.read_ctl(rt))?;
    let used = m.kv.pool.cfg.n_pages - ctl.free_top;
    println!(
        "batch: {} prompts, {n} sequences at a time, {} steps in {secs:.2} s: {} prompt and {} generated tokens \
({:.2} tokens/s in all); {} idle sequence-steps; {} dispatches per step ({:.1} per layer); K/V pages in use after: {used}",
        done.len(),
        stats.steps,
        stats.prompt_tokens,
        stats.generated_tokens,
        (stats.prompt_tokens + stats.generated_tokens) as f64 / secs.max(1e-9),
        stats.idle_slot_steps,
        stats.dispatches_per_step,
        stats.dispatches_per_step as f64 / f64::from(layers),
    );
    if a.json {
        let mut j = serde_json::to_value(&stats)?;
        j["batch"] = n.into();
        j["prompts"] = done.len().into();
        j["seconds"] = secs.into();
        j["tokens_per_s"] = ((stats.prompt_tokens + stats.generated_tokens) as f64 / secs.max(1e-9)).into();
        j["kv_pages_in_use_after"] = used.into();
        j["adapter"] = rt.info.name.clone().into();
        j["kv_store"] = serde_json::to_value(store.as_deref().map(|s| &s.report))?;
        println!("{j}");
    }
    if let Some(s) = store.as_deref() {
        crate::store::warn_failed(&s.report);
        println!("{}", crate::store::report_line(&s.report, stats.prompt_tokens as usize));
    }
    if a.time_steps > 0 {
        // Every sequence decoding at once, back to back, from empty (the batch released them).
        let token = done.first().and_then(|c| c.generated_ids.first()).copied().unwrap_or(0);
        let r = pollster::block_on(m.time_steps(rt, token, a.time_steps))?;
        println!("{r}");
    }
    Ok(())
}
