//! `expertkv soak --model FILE`: the whole model engine under continuous churn. Rounds of random
//! prompts (random words, random lengths) are decoded `--seqs` at a time by the batch decoder
//! (`expertkv_model::batch`): every step feeds each sequence a token, a finished sequence frees
//! its pages and the next prompt takes its slot, under the scheduler and codec given. The
//! soak's [`Checker`] reads the pool every `--check-every` steps (no token duplicated: the
//! model's K/V are its own, so which were appended is not known here); after every round the
//! pool must be empty again.

use std::collections::HashSet;

use anyhow::{Context, Result, bail};
use expertkv_core::config::{Codec, KvDtype};
use expertkv_core::evict::config::SchedulerConfig;
use expertkv_core::rng::Rng;
use expertkv_model::batch::BatchDecoder;
use expertkv_model::forward::{GpuLlama, ModelOptions};
use expertkv_model::gguf::Gguf;
use expertkv_model::tokenizer::Tokenizer;

use super::{Checker, SoakArgs};
use crate::GpuArgs;

/// Random lowercase words, about `chars` characters.
fn random_text(rng: &mut Rng, chars: u32) -> String {
    let mut s = String::new();
    while (s.len() as u32) < chars.max(1) {
        if !s.is_empty() {
            s.push(' ');
        }
        for _ in 0..1 + rng.below(8) {
            s.push(char::from(b'a' + rng.below(26) as u8));
        }
    }
    s
}

pub(super) fn run(gpu: &GpuArgs, a: &SoakArgs, model: &std::path::Path, (min_len, max_len): (u32, u32)) -> Result<()> {
    let (path, bytes) = crate::run::read_model(Some(model))?;
    let g = Gguf::parse(&bytes).with_context(|| format!("{} is not a readable GGUF file", path.display()))?;
    let tok = Tokenizer::from_gguf(&g).context("the model's tokenizer")?;
    let codec = a.codec.as_deref().map_or(Ok(Codec::None), Codec::parse)?;
    let scheduler = match a.scheduler.as_str() {
        "none" => None,
        s => Some((SchedulerConfig::parse_for_budget(s, a.budget)?, a.budget)),
    };
    if a.seqs == 0 || a.check_every == 0 {
        bail!("--seqs and --check-every must be positive");
    }
    let rt = gpu.runtime()?;
    // A prompt of up to half the longest length, then up to the rest generated.
    let context = max_len + 8;
    let opts = ModelOptions::new(a.seqs, context).dtype(KvDtype::F16).scheduler(scheduler).codec(codec).recall(a.recall);
    let mut m = pollster::block_on(GpuLlama::load(&rt, &g, opts)).context("loading the model onto the GPU")?;
    let cfg = m.kv.pool.cfg.clone();
    println!(
        "soak: {} steps of {} ({} layers), {} sequences of {min_len}..={max_len} tokens (prompt and generated), scheduler {}, codec {}; pool {} pages",
        a.steps,
        path.display(),
        m.cfg.block_count,
        a.seqs,
        a.scheduler,
        codec.name(),
        cfg.n_pages
    );
    let mut rng = Rng::new(a.seed);
    let every_ring: HashSet<usize> = (0..cfg.n_keys() as usize).collect();
    let checker = std::cell::RefCell::new(Checker::new(&rt, a.json, cfg.clone(), every_ring));
    let (mut steps, mut rounds) = (0u64, 0u32);
    // Sequences finished so far: counted as each completes (read by the step checks).
    let finished = std::cell::Cell::new(0u64);
    while steps < u64::from(a.steps) {
        // A round: prompts of random lengths, a budget of generated tokens for the round.
        // Every sequence between min_len and max_len tokens, prompt and generated together.
        let lo = min_len.max(2).min(max_len);
        let max_tokens = 1 + rng.below((max_len / 2).min(max_len - lo).max(1));
        let prompts: Vec<String> = (0..4 * a.seqs)
            .map(|_| {
                let chars = lo + rng.below((max_len.saturating_sub(max_tokens) + 1).saturating_sub(lo).max(1));
                random_text(&mut rng, chars)
            })
            .collect();
        let mut dec = BatchDecoder::new(&mut m, &tok, max_tokens)?;
        dec.stop_at_eos = false;
        let base = steps;
        let mut on_step = |llama: &GpuLlama, step: u64| -> expertkv_core::Result<()> {
            let total = base + step;
            if !total.is_multiple_of(u64::from(a.check_every)) {
                return Ok(());
            }
            let snap = pollster::block_on(llama.kv.pool.snapshot(&rt))?;
            checker.borrow_mut().window(total, &snap, &|_| true, finished.get()).map_err(|e| expertkv_core::Error::Input(format!("{e:#}")))
        };
        let (_, stats) = pollster::block_on(dec.run_checked(&rt, &prompts, |_| finished.set(finished.get() + 1), &mut on_step))?;
        steps += stats.steps;
        rounds += 1;
        let ctl = pollster::block_on(m.kv.pool.check_errors(&rt, 0))?;
        if ctl.free_top != cfg.n_pages || ctl.codec_free_top != cfg.n_ids() - cfg.n_pages {
            bail!("after round {rounds} (step {steps}) the pool still holds pages: free tops {} and {}", ctl.free_top, ctl.codec_free_top);
        }
    }
    checker.into_inner().summary(&format!(
        "{steps} steps in {rounds} rounds, the invariants held at every check and the pool was empty after every round; {} sequences finished",
        finished.get()
    ))
}
