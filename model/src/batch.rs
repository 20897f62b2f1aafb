//! Continuous batching: many prompts decoded by one [`GpuLlama`] of `n_seqs` sequences. Every
//! step feeds one token to each sequence (the next token of its prompt, or the token it last
//! generated); a sequence that finishes (its token budget spent, or end-of-sequence) gives its
//! pages back ([`GpuLlama::release_sequence`]) and the next waiting prompt takes its place in
//! the same step that follows, so the batch stays full while prompts wait.
//!
//! A joining prompt's tokens but its last are fed in chunks of many tokens a pass
//! ([`GpuLlama::prefill`]) where no policy acts between tokens; otherwise (and always for the
//! last) one per step beside the other sequences' tokens.
//!
//! Decoding is greedy. Each sequence's tokens are those it would get alone: the model's kernels
//! compute every token of a step independently (the same reduction order whatever the batch),
//! and each sequence's attention reads only its own pages.
//!
//! With a [`PrefixCache`] (the page store's prefix reuse), a joining prompt's stored prefix is
//! restored into its sequence instead of prefilled, and each prompt's full pages are stored once
//! the prompt has been fed, for later prompts of this run and other processes.

use crate::forward::GpuLlama;
use crate::math::argmax;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use expertkv_core::runtime::Runtime;

/// Prompt pages shared across runs and processes (implemented by `expertkv-store`'s
/// `PrefixStore`).
pub trait PrefixCache {
    /// Restore the longest stored prefix of `ids` into the empty sequence `seq` (whole pages,
    /// fewer tokens than `ids` holds); returns the tokens restored. A store that fails returns
    /// 0 and leaves the sequence empty.
    fn fetch(&mut self, rt: &Runtime, m: &mut GpuLlama, seq: u32, ids: &[u32]) -> Result<u32>;
    /// Sequence `seq` holds `ids`: store its full pages the store lacks (perhaps on another
    /// thread, from a copy taken here).
    fn store(&mut self, rt: &Runtime, m: &GpuLlama, seq: u32, ids: &[u32]) -> Result<()>;
}

/// One prompt's result.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Completion {
    /// The prompt's index in the list given to [`BatchDecoder::run`].
    pub prompt: usize,
    /// The prompt's token ids (beginning-of-sequence first where the vocabulary adds it).
    pub prompt_ids: Vec<u32>,
    /// The tokens generated, greedily.
    pub generated_ids: Vec<u32>,
    /// Their text.
    pub text: String,
    /// Why it stopped: `max_tokens` or `eos`.
    pub stop: &'static str,
    /// The sequence slot it ran in.
    pub slot: u32,
    /// The step it joined at and the step it finished at.
    pub steps: (u64, u64),
}

/// What a batch run did, beside the completions.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct BatchStats {
    /// Forward steps (each one token of every sequence).
    pub steps: u64,
    /// Prompt tokens fed and tokens generated, over all prompts.
    pub prompt_tokens: u64,
    /// Tokens generated over all prompts.
    pub generated_tokens: u64,
    /// Slot-steps that fed nothing useful (no prompt left to take the slot).
    pub idle_slot_steps: u64,
    /// Compute dispatches of one step (the last one).
    pub dispatches_per_step: u64,
    /// Prompts whose tokens but the last were fed in chunks ([`GpuLlama::prefill`]) when they
    /// joined, rather than one a step.
    pub prefill_passes: u64,
    /// Prompt tokens restored from a [`PrefixCache`] instead of fed.
    pub prefix_tokens_reused: u64,
}

/// A sequence slot's progress.
struct Slot {
    prompt: usize,
    ids: Vec<u32>,
    fed: usize,
    generated: Vec<u32>,
    joined: u64,
}

/// Decodes a list of prompts through one model of several sequences, continuously batched.
pub struct BatchDecoder<'a> {
    llama: &'a mut GpuLlama,
    tokenizer: &'a Tokenizer,
    /// Tokens each prompt may generate.
    pub max_tokens: u32,
    /// Stop a sequence at the end-of-sequence token.
    pub stop_at_eos: bool,
    prefix: Option<&'a mut dyn PrefixCache>,
}

impl<'a> BatchDecoder<'a> {
    /// A decoder over `llama` (every sequence empty: position 0) and its tokenizer.
    pub fn new(llama: &'a mut GpuLlama, tokenizer: &'a Tokenizer, max_tokens: u32) -> Result<Self> {
        if tokenizer.vocab_size() != llama.cfg.vocab_size as usize {
            return Err(Error::Model(format!(
                "the tokenizer has {} tokens but the model's output has {}",
                tokenizer.vocab_size(),
                llama.cfg.vocab_size
            )));
        }
        if let Some(p) = llama.positions.iter().position(|&p| p != 0) {
            return Err(Error::Input(format!("sequence {p} is not empty: a batch starts from empty sequences")));
        }
        if max_tokens == 0 {
            return Err(Error::Input("max_tokens must be at least 1".into()));
        }
        Ok(BatchDecoder { llama, tokenizer, max_tokens, stop_at_eos: true, prefix: None })
    }

    /// Restore joining prompts' stored prefixes from `cache` and store every prompt's pages in
    /// it. Refused where the model's pool cannot take a restored prefix (a scheduler, a codec,
    /// the route stage: [`GpuLlama::prefix_refusal`]).
    pub fn with_prefix_cache(mut self, cache: &'a mut dyn PrefixCache) -> Result<Self> {
        if let Some(why) = self.llama.prefix_refusal() {
            return Err(Error::Input(format!(
                "a prefix cache restores K/V where a prefill puts them, which needs raw pages and no policy between tokens: {why}"
            )));
        }
        self.prefix = Some(cache);
        Ok(self)
    }

    /// Encode every prompt and check it fits the context with `max_tokens` to generate, before
    /// any GPU work; the first that does not is named.
    pub fn encode(&self, prompts: &[String]) -> Result<Vec<Vec<u32>>> {
        let cap = u64::from(self.llama.max_context());
        prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let ids = self.tokenizer.encode_prompt(p, true).map_err(|e| Error::Input(format!("prompt {i}: {e}")))?;
                if ids.is_empty() {
                    return Err(Error::Input(format!("prompt {i} is empty")));
                }
                // The last generated token is not fed: it takes no position.
                let needed = ids.len() as u64 + u64::from(self.max_tokens) - 1;
                if needed > cap {
                    return Err(Error::Input(format!(
                        "prompt {i}: {} tokens and {} to generate do not fit the context of {cap}",
                        ids.len(),
                        self.max_tokens
                    )));
                }
                Ok(ids)
            })
            .collect()
    }

    /// Decode every prompt, `n_seqs` at a time, calling `on_done` with each completion as it
    /// finishes (in finishing order); returns them in prompt order with the run's statistics.
    /// Every sequence is released at the end: the pool is as empty as it started.
    pub async fn run(
        &mut self,
        rt: &Runtime,
        prompts: &[String],
        on_done: impl FnMut(&Completion),
    ) -> Result<(Vec<Completion>, BatchStats)> {
        self.run_checked(rt, prompts, on_done, &mut |_, _| Ok(())).await
    }

    /// [`BatchDecoder::run`] with `on_step(model, steps so far)` called after every step's
    /// completions and releases (a soak checks the pool there); its error ends the run.
    pub async fn run_checked(
        &mut self,
        rt: &Runtime,
        prompts: &[String],
        mut on_done: impl FnMut(&Completion),
        on_step: &mut dyn FnMut(&GpuLlama, u64) -> Result<()>,
    ) -> Result<(Vec<Completion>, BatchStats)> {
        let encoded = self.encode(prompts)?;
        let n = self.llama.n_seqs as usize;
        let mut queue = encoded.into_iter().enumerate();
        let mut slots: Vec<Option<Slot>> = (0..n).map(|_| None).collect();
        let mut done: Vec<Completion> = Vec::new();
        let mut stats = BatchStats::default();
        // A slot with nothing to do feeds this token and is released after the step.
        let pad = self.tokenizer.eos().unwrap_or(0).min(self.llama.cfg.vocab_size - 1);
        let mut step = 0u64;
        loop {
            for (i, slot) in slots.iter_mut().enumerate().filter(|(_, s)| s.is_none()) {
                if let Some((prompt, ids)) = queue.next() {
                    stats.prompt_tokens += ids.len() as u64;
                    // All but the prompt's last token in chunks of many tokens a pass, where no
                    // policy acts between tokens; the last goes with the batch's next step.
                    let mut fed = match self.prefix.as_deref_mut() {
                        Some(cache) => cache.fetch(rt, self.llama, i as u32, &ids)? as usize,
                        None => 0,
                    };
                    stats.prefix_tokens_reused += fed as u64;
                    if ids.len() > fed + 2 && self.llama.chunked_prefill_refusal().is_none() {
                        self.llama.prefill(rt, i as u32, &ids[fed..ids.len() - 1]).await?;
                        fed = ids.len() - 1;
                        stats.prefill_passes += 1;
                    }
                    *slot = Some(Slot { prompt, ids, fed, generated: Vec::new(), joined: step });
                }
            }
            if slots.iter().all(Option::is_none) {
                break;
            }
            let tokens: Vec<u32> = slots
                .iter()
                .map(|s| match s {
                    Some(s) if s.fed < s.ids.len() => s.ids[s.fed],
                    // Past its prompt a slot has generated (its first token came with the
                    // prompt's last), so `pad` is never fed here.
                    Some(s) => s.generated.last().copied().unwrap_or(pad),
                    None => pad,
                })
                .collect();
            let logits = self.llama.forward(rt, &tokens).await?;
            stats.steps += 1;
            stats.dispatches_per_step = self.llama.dispatches_per_step();
            let vocab = self.llama.cfg.vocab_size as usize;
            for (i, entry) in slots.iter_mut().enumerate() {
                let Some(s) = entry else {
                    stats.idle_slot_steps += 1;
                    self.llama.release_sequence(rt, i as u32)?;
                    continue;
                };
                s.fed = (s.fed + 1).min(s.ids.len());
                if s.fed < s.ids.len() && s.generated.is_empty() {
                    continue;
                }
                if s.generated.is_empty() {
                    // The whole prompt is in the pool now: its pages go to the store.
                    if let Some(cache) = self.prefix.as_deref_mut() {
                        cache.store(rt, self.llama, i as u32, &s.ids)?;
                    }
                }
                let next = argmax(&logits[i * vocab..(i + 1) * vocab]);
                s.generated.push(next);
                stats.generated_tokens += 1;
                let eos = self.stop_at_eos && self.tokenizer.eos() == Some(next);
                if !eos && s.generated.len() < self.max_tokens as usize {
                    continue;
                }
                if let Some(s) = entry.take() {
                    let text = String::from_utf8_lossy(&self.tokenizer.decode_bytes(&s.generated)?).into_owned();
                    let c = Completion {
                        prompt: s.prompt,
                        prompt_ids: s.ids,
                        generated_ids: s.generated,
                        text,
                        stop: if eos { "eos" } else { "max_tokens" },
                        slot: i as u32,
                        steps: (s.joined, step + 1),
                    };
                    on_done(&c);
                    done.push(c);
                    self.llama.release_sequence(rt, i as u32)?;
                }
            }
            step += 1;
            on_step(self.llama, step)?;
        }
        done.sort_by_key(|c| c.prompt);
        Ok((done, stats))
    }
}
