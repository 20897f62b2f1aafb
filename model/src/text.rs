//! Text in, text out: [`TextModel`] puts a GGUF file's tokenizer in front of its GPU forward pass
//! ([`GpuLlama`], K/V in the expertkv pool under whatever policy [`ModelOptions`] names) and
//! streams the generated text a piece at a time. The CLI's `run`, the browser's JS API and the
//! examples decode through it.
//!
//! ```
//! use expertkv_core::{Runtime, RuntimeOptions};
//! use expertkv_model::forward::ModelOptions;
//! use expertkv_model::text::{GenerateOptions, TextModel};
//! use expertkv_model::SyntheticModel;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let rt = pollster::block_on(Runtime::new(RuntimeOptions::from_env()?))?;
//! // A small random model written as a GGUF file (bring your own: `std::fs::read(path)?`).
//! let gguf = SyntheticModel::dense(7).gguf();
//! let mut model = pollster::block_on(TextModel::load(&rt, &gguf, ModelOptions::new(1, 64)))?;
//! let mut streamed = String::new();
//! let out = pollster::block_on(model.generate(&rt, "hello", &GenerateOptions { max_tokens: 8, ..Default::default() }, |piece| {
//!     streamed.push_str(&piece.text);
//!     true // keep going
//! }))?;
//! assert_eq!(out.tokens.len(), 8);
//! assert_eq!(streamed, out.text);
//! let stats = pollster::block_on(model.stats(&rt))?;
//! // The last token generated is fed with the next prompt, if any.
//! assert_eq!(stats.context_tokens as usize, out.prompt_tokens + 8 - 1);
//! # Ok(())
//! # }
//! ```

use expertkv_core::config::{Codec, KvDtype};
use expertkv_core::evict::config::{Budget, SchedulerConfig};
use expertkv_core::{Error, Result, Runtime};

use crate::forward::{GpuLlama, ModelOptions, argmax};
use crate::gguf::Gguf;
use crate::tokenizer::Tokenizer;

/// A K/V policy in words, as the CLI and the browser's JS API take it (field names in camelCase
/// when deserialised; an unknown field is an error naming it). Every field is optional.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct KvPolicy {
    /// Tokens the sequence may hold [default: the model's trained context, at most
    /// [`KvPolicy::DEFAULT_CONTEXT`]].
    pub context: Option<u32>,
    /// K/V storage: `f16` (default) or `f32`.
    pub dtype: Option<String>,
    /// An evicting scheduler (`h2o`, `streaming-llm`, `lru`, `lru-plus`, `adakv`, `duo`,
    /// `fastv-tokens`) or `quest`, as `name` or `name:key=value,...` [default: the full cache].
    pub scheduler: Option<String>,
    /// The scheduler's budget: tokens per (layer, KV head), or a share of the context (`25%`).
    pub budget: Option<String>,
    /// A page codec (`int8`, `int4`, `fastv-dims`, `low-rank`, `lora`; `name:key=value,...`).
    pub codec: Option<String>,
    /// The recall tier under an evicting scheduler: every token it evicts is kept (in host memory
    /// where the device reads host memory in place, natively; in device memory in the browser,
    /// with no bytes saved), and this many of each (layer, KV head)'s best evicted pages are
    /// attended at every layer (1 to 16) [default: no tier].
    pub recall: Option<u32>,
    /// With `recall`: how many of its candidate pages the tier pages' key bounds nominate (the
    /// digests nominate the rest; the bounds' device bytes count in the K/V) [default: 0].
    pub recall_bounds: Option<u32>,
}

impl KvPolicy {
    /// The context when none is given (or the model's, when shorter).
    pub const DEFAULT_CONTEXT: u32 = 2048;

    /// The options [`TextModel::load`] takes, for a model trained on `trained_context` tokens.
    /// Errors name the field and what it allows; a budget without a scheduler is refused.
    pub fn model_options(&self, trained_context: u32) -> Result<ModelOptions> {
        let context = self.context.unwrap_or(Self::DEFAULT_CONTEXT.min(trained_context));
        let dtype = self.dtype.as_deref().map_or(Ok(KvDtype::F16), KvDtype::parse)?;
        let codec = self.codec.as_deref().map_or(Ok(Codec::None), Codec::parse)?;
        let scheduler = match (self.scheduler.as_deref(), &self.budget) {
            (None | Some("none"), Some(b)) => {
                return Err(Error::Input(format!("budget `{b}` needs a scheduler to keep it (for example h2o)")));
            }
            (None | Some("none"), None) => None,
            (Some(spec), budget) => {
                let b = Budget::parse(budget.as_deref().unwrap_or("25%"))?.tokens(context);
                Some((SchedulerConfig::parse_for_budget(spec, b)?, b))
            }
        };
        // The recall tier keeps what an evicting scheduler removes: refused by name without one,
        // before anything is loaded (its page counts are checked at load, against the pool).
        if let Some(pages) = self.recall
            && !scheduler.as_ref().is_some_and(|(s, _)| s.uses_evict_kernels())
        {
            return Err(Error::Input(format!(
                "recall `{pages}` keeps what an evicting scheduler removes: give one (h2o, streaming-llm, lru, lru-plus, adakv, duo, fastv-tokens)"
            )));
        }
        if let (Some(b), None) = (self.recall_bounds, self.recall) {
            return Err(Error::Input(format!("recallBounds `{b}` shares out the recall tier's candidates: give recall too")));
        }
        Ok(ModelOptions::new(1, context)
            .dtype(dtype)
            .codec(codec)
            .scheduler(scheduler)
            .recall(self.recall)
            .recall_bounds(self.recall_bounds.unwrap_or(0)))
    }
}

/// How [`TextModel::generate`] decodes (field names in camelCase when deserialised).
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct GenerateOptions {
    /// Tokens to generate at most (greedy).
    pub max_tokens: u32,
    /// Stop after the vocabulary's end-of-sequence token (it is streamed, as its spelling).
    pub stop_at_eos: bool,
}

impl Default for GenerateOptions {
    /// 32 tokens, stopping at end of sequence.
    fn default() -> Self {
        GenerateOptions { max_tokens: 32, stop_at_eos: true }
    }
}

/// One generated token as streamed: its id and the text it completes. A character split over
/// several tokens arrives whole with the token that ends it (`text` is empty for the others).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The generated token's id in the vocabulary.
    pub id: u32,
    /// The text this token completes, whole UTF-8 characters only: a character split over tokens
    /// comes whole with the token that finishes it, so this can be empty.
    pub text: String,
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// `max_tokens` were generated.
    MaxTokens,
    /// The end-of-sequence token was generated.
    Eos,
    /// The callback asked to stop.
    Callback,
}

/// What [`TextModel::generate`] produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generation {
    /// Tokens the prompt became (with the beginning-of-sequence token when the vocabulary adds one).
    pub prompt_tokens: usize,
    /// The generated token ids.
    pub tokens: Vec<u32>,
    /// Their text (bytes that never completed a character at the end show as U+FFFD).
    pub text: String,
    /// Why generation ended.
    pub stop: Stop,
}

/// The sequence's K/V as it stands ([`TextModel::stats`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct KvStats {
    /// Tokens the sequence has been through (the next token's position).
    pub context_tokens: u32,
    /// Most tokens the pool was sized for ([`ModelOptions::max_context`]).
    pub max_context: u32,
    /// Raw and compressed pages in use.
    pub pages_in_use: u32,
    /// Bytes of those pages as allocated (with a low-rank codec's basis).
    pub kv_bytes_in_use: u64,
    /// Bytes the same context takes as a full f16 cache (every token, every layer, raw pages).
    pub full_cache_bytes: u64,
    /// Token K/V the scheduler evicted so far (every layer and KV head); 0 without one.
    pub evicted: u64,
    /// The recall tier, if one keeps the evicted K/V.
    pub recall: Option<RecallStats>,
}

/// The recall tier as it stands ([`KvStats::recall`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RecallStats {
    /// Tier pages attended per (layer, KV head) at every layer.
    pub pages: u32,
    /// Whether the tier's K/V live in host memory (read in place over the bus); otherwise in
    /// device memory, with no device bytes saved (the browser).
    pub host_memory: bool,
    /// Evicted token K/V kept in the tier so far (every layer and KV head).
    pub captured: u64,
    /// Evicted token K/V dropped because a list's tier was full: these are lost.
    pub dropped: u64,
    /// Device bytes of the tier (its digests, counters and plan; the tier itself outside host
    /// memory), on top of [`KvStats::kv_bytes_in_use`].
    pub gpu_bytes: u64,
    /// Host bytes of the tier (allocated for its whole capacity).
    pub host_bytes: u64,
}

/// A model and its tokenizer, decoding one sequence.
pub struct TextModel {
    llama: GpuLlama,
    tokenizer: Tokenizer,
    /// The last token generated: returned, not yet fed (the next generation feeds it first).
    unfed: Option<u32>,
}

impl TextModel {
    /// Parse a GGUF file's bytes, read its tokenizer and load the model onto the GPU with `opts`
    /// (which must be for one sequence). Errors name what the file lacks or the loader refuses.
    pub async fn load(rt: &Runtime, gguf: &[u8], opts: ModelOptions) -> Result<TextModel> {
        let g = Gguf::parse(gguf)?;
        let tokenizer = Tokenizer::from_gguf(&g)?;
        Self::load_parsed(rt, &g, tokenizer, opts).await
    }

    /// [`TextModel::load`] with the options from a [`KvPolicy`] (its context defaulting to the
    /// model's trained context, at most [`KvPolicy::DEFAULT_CONTEXT`]).
    pub async fn load_with_policy(rt: &Runtime, gguf: &[u8], policy: &KvPolicy) -> Result<TextModel> {
        let g = Gguf::parse(gguf)?;
        let tokenizer = Tokenizer::from_gguf(&g)?;
        let trained = crate::LlamaConfig::from_gguf(&g)?.context_length;
        Self::load_parsed(rt, &g, tokenizer, policy.model_options(trained)?).await
    }

    async fn load_parsed(rt: &Runtime, g: &Gguf<'_>, tokenizer: Tokenizer, opts: ModelOptions) -> Result<TextModel> {
        if opts.n_seqs != 1 {
            return Err(Error::Input(format!("a TextModel decodes one sequence; the options ask for {}", opts.n_seqs)));
        }
        let llama = GpuLlama::load(rt, g, opts).await?;
        Self::new(llama, tokenizer)
    }

    /// A model loaded (and set up: MoEfication, labels, routers) by the caller, for one sequence.
    pub fn new(llama: GpuLlama, tokenizer: Tokenizer) -> Result<TextModel> {
        if llama.n_seqs != 1 {
            return Err(Error::Input(format!("a TextModel decodes one sequence; this model was loaded for {}", llama.n_seqs)));
        }
        if tokenizer.vocab_size() != llama.cfg.vocab_size as usize {
            return Err(Error::Model(format!(
                "the tokenizer has {} tokens but the model's output has {}",
                tokenizer.vocab_size(),
                llama.cfg.vocab_size
            )));
        }
        Ok(TextModel { llama, tokenizer, unfed: None })
    }

    /// The file's tokenizer, for encoding and decoding outside [`TextModel::generate`].
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The forward pass, for what this type does not wrap (its scheduler, routing, pool).
    pub fn llama(&self) -> &GpuLlama {
        &self.llama
    }

    /// The forward pass, mutably: for setting it up after load ([`GpuLlama::set_moe`],
    /// [`GpuLlama::set_labels`], [`GpuLlama::set_moe_router`]).
    pub fn llama_mut(&mut self) -> &mut GpuLlama {
        &mut self.llama
    }

    /// The prompt's token ids: the beginning-of-sequence token first when the vocabulary adds
    /// one and the sequence is empty. A character the vocabulary cannot spell is an error naming
    /// it (never dropped); so is an empty prompt on an empty sequence (a continued sequence may
    /// take an empty prompt: it goes on from its last generated token).
    pub fn encode_prompt(&self, prompt: &str) -> Result<Vec<u32>> {
        let fresh = self.llama.positions[0] == 0 && self.unfed.is_none();
        let ids = self.tokenizer.encode_prompt(prompt, fresh).map_err(|e| match e {
            Error::Input(m) => Error::Input(format!("the prompt: {m}")),
            e => e,
        })?;
        if ids.is_empty() && fresh {
            return Err(Error::Input("the prompt is empty".into()));
        }
        Ok(ids)
    }

    /// Feed `prompt` (continuing the sequence: earlier prompts and generations stay in the
    /// cache, as the policy keeps them, and the previous generation's last token is fed first),
    /// then generate greedily, calling `on_token` with each token's piece of text as it comes;
    /// `on_token` returns `false` to stop. The context must have room for the prompt and
    /// `max_tokens` (checked before any GPU work). `max_tokens = 0` only feeds the prompt.
    pub async fn generate(
        &mut self,
        rt: &Runtime,
        prompt: &str,
        opts: &GenerateOptions,
        on_token: impl FnMut(&Piece) -> bool,
    ) -> Result<Generation> {
        self.generate_after_prefix(rt, prompt, 0, opts, on_token, |_| ()).await
    }

    /// [`TextModel::generate`] for a fresh sequence whose first `cached` prompt tokens are
    /// already in the pool (restored from a page store with [`GpuLlama::restore_prefix`]): only
    /// the rest of the prompt is fed. Refused unless the sequence holds exactly those `cached`
    /// positions and `cached` leaves at least one prompt token to feed. `after_first_token`
    /// runs once, right after `on_token` has had the first generated token, with the whole
    /// prompt in the pool: where a caller starts work on the prompt's K/V (storing its pages,
    /// say) without delaying the first token. It does not run when nothing is generated.
    pub async fn generate_after_prefix(
        &mut self,
        rt: &Runtime,
        prompt: &str,
        cached: usize,
        opts: &GenerateOptions,
        mut on_token: impl FnMut(&Piece) -> bool,
        after_first_token: impl FnOnce(&GpuLlama),
    ) -> Result<Generation> {
        let mut after_first_token = Some(after_first_token);
        // With a restored prefix the sequence is fresh but for it: the prompt is encoded as a
        // fresh one's (with its beginning-of-sequence token).
        let prompt_ids = if cached > 0 { self.tokenizer.encode_prompt(prompt, true)? } else { self.encode_prompt(prompt)? };
        if cached > 0 && (self.unfed.is_some() || self.llama.positions[0] as usize != cached || cached >= prompt_ids.len()) {
            return Err(Error::Input(format!(
                "{cached} cached prompt tokens: the sequence holds {} positions and the prompt has {} tokens",
                self.llama.positions[0],
                prompt_ids.len()
            )));
        }
        let feed: Vec<u32> = self.unfed.iter().copied().chain(prompt_ids[cached..].iter().copied()).collect();
        if feed.is_empty() && opts.max_tokens > 0 {
            return Err(Error::Input("the prompt is empty and the last generation left no token to go on from".into()));
        }
        let (at, cap) = (self.llama.positions[0], self.llama.max_context());
        // The last generated token is returned, not fed: it takes no position yet.
        let needed = feed.len() as u64 + u64::from(opts.max_tokens.saturating_sub(1));
        if u64::from(at) + needed > u64::from(cap) {
            return Err(Error::Input(format!(
                "the context holds {cap} tokens and {at} are used: no room for {} more tokens of prompt and {} to generate",
                feed.len(),
                opts.max_tokens
            )));
        }
        // The prompt in chunks of many tokens a pass where no policy acts between tokens, else
        // one token a pass.
        let mut logits = Vec::new();
        if feed.len() > 1 && self.llama.chunked_prefill_refusal().is_none() {
            logits = self.llama.prefill(rt, 0, &feed).await?;
        } else {
            for &t in &feed {
                logits = self.llama.forward(rt, &[t]).await?;
            }
        }
        self.unfed = None;
        let ids = prompt_ids;
        let mut out = Generation { prompt_tokens: ids.len(), tokens: Vec::new(), text: String::new(), stop: Stop::MaxTokens };
        let mut pending: Vec<u8> = Vec::new();
        for i in 0..opts.max_tokens {
            let next = argmax(&logits);
            out.tokens.push(next);
            pending.extend_from_slice(&self.tokenizer.decode_bytes(&[next])?);
            let text = take_utf8(&mut pending);
            out.text.push_str(&text);
            let go_on = on_token(&Piece { id: next, text });
            if let Some(f) = after_first_token.take() {
                f(&self.llama);
            }
            if !go_on {
                out.stop = Stop::Callback;
                break;
            }
            if opts.stop_at_eos && self.tokenizer.eos() == Some(next) {
                out.stop = Stop::Eos;
                break;
            }
            if i + 1 < opts.max_tokens {
                logits = self.llama.forward(rt, &[next]).await?;
            } else {
                self.unfed = Some(next);
            }
        }
        if out.stop != Stop::MaxTokens {
            self.unfed = out.tokens.last().copied();
        }
        out.text.push_str(&String::from_utf8_lossy(&pending));
        Ok(out)
    }

    /// The sequence's K/V: context, pages and bytes in use against a full f16 cache, evictions.
    pub async fn stats(&self, rt: &Runtime) -> Result<KvStats> {
        let m = &self.llama;
        let c = &m.kv.pool.cfg;
        let ctl = m.kv.pool.read_ctl(rt).await?;
        let pages_in_use = c.pages_in_use(&ctl);
        let evicted = match &m.kv.scheduler {
            Some(s) => s.read_lists(rt).await?.iter().map(|l| u64::from(l.evicted_total)).sum(),
            None => 0,
        };
        let context = m.positions[0];
        // f16: 2 bytes for each of K and V per head dimension.
        let full = u64::from(context) * u64::from(m.cfg.block_count) * u64::from(m.cfg.head_count_kv) * u64::from(m.cfg.head_dim) * 4;
        let recall = match &m.kv.recall {
            Some(t) => {
                let (dropped, captured) = t.read_stats(rt).await?;
                Some(RecallStats {
                    pages: t.cfg.pages,
                    host_memory: t.host_memory,
                    captured,
                    dropped,
                    gpu_bytes: t.gpu_bytes(),
                    host_bytes: t.host_bytes(),
                })
            }
            None => None,
        };
        Ok(KvStats {
            context_tokens: context,
            max_context: m.max_context(),
            pages_in_use,
            kv_bytes_in_use: m.kv_bytes_in_use(rt).await?,
            full_cache_bytes: full,
            evicted,
            recall,
        })
    }
}

/// The longest whole-UTF-8 prefix of `pending`, taken out of it; an invalid sequence (never
/// completable) goes out as U+FFFD so nothing stalls.
fn take_utf8(pending: &mut Vec<u8>) -> String {
    match std::str::from_utf8(pending) {
        Ok(s) => {
            let s = s.to_owned();
            pending.clear();
            s
        }
        Err(e) => {
            let valid = e.valid_up_to();
            let mut s = String::from_utf8_lossy(&pending[..valid]).into_owned();
            match e.error_len() {
                // Bytes that can never be a character: replaced, the rest kept for later.
                Some(bad) => {
                    s.push(char::REPLACEMENT_CHARACTER);
                    pending.drain(..valid + bad);
                    s.push_str(&take_utf8(pending));
                }
                // An unfinished character: wait for the next token.
                None => {
                    pending.drain(..valid);
                }
            }
            s
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_policy_in_words_becomes_model_options() {
        let p: KvPolicy =
            serde_json::from_str(r#"{"scheduler": "h2o", "budget": "25%", "codec": "int4", "context": 400}"#).expect("policy");
        let o = p.model_options(2048).expect("options");
        assert_eq!(o.max_context, 400);
        assert_eq!(o.scheduler.as_ref().map(|s| s.1), Some(100));
        assert!(matches!(o.scheduler, Some((SchedulerConfig::H2o { window: 50, .. }, _))), "{:?}", o.scheduler);
        assert_eq!(o.codec, Codec::parse("int4").expect("int4"));
        assert_eq!(KvPolicy::default().model_options(512).expect("default").max_context, 512);
        assert_eq!(KvPolicy::default().model_options(8192).expect("default").max_context, KvPolicy::DEFAULT_CONTEXT);
        let unknown = serde_json::from_str::<KvPolicy>(r#"{"sheduler": "h2o"}"#).expect_err("a misspelt field");
        assert!(unknown.to_string().contains("sheduler"), "{unknown}");
        let e = KvPolicy { budget: Some("10%".into()), ..Default::default() }.model_options(512).expect_err("budget alone");
        assert!(e.to_string().contains("needs a scheduler"), "{e}");
        let e =
            KvPolicy { scheduler: Some("h2o".into()), budget: Some("0".into()), ..Default::default() }.model_options(512).expect_err("0");
        assert!(e.to_string().contains("budget"), "{e}");
        let e = KvPolicy { dtype: Some("f8".into()), ..Default::default() }.model_options(512).expect_err("f8");
        assert!(e.to_string().contains("f16"), "{e}");
        // The recall tier: under an evicting scheduler, refused by name without one (QUEST and
        // FlexGen evict nothing it could keep), its bounds only with it.
        let p: KvPolicy = serde_json::from_str(r#"{"scheduler": "h2o", "budget": "64", "recall": 4, "recallBounds": 8}"#).expect("policy");
        let o = p.model_options(2048).expect("options");
        assert_eq!((o.recall, o.recall_bounds), (Some(4), 8));
        for scheduler in [None, Some("quest"), Some("flexgen")] {
            let p = KvPolicy { scheduler: scheduler.map(Into::into), recall: Some(4), ..Default::default() };
            let e = p.model_options(512).expect_err("recall without an evicting scheduler");
            assert!(e.to_string().contains("recall `4`") && e.to_string().contains("h2o"), "{scheduler:?}: {e}");
        }
        let p = KvPolicy { scheduler: Some("h2o".into()), recall_bounds: Some(8), ..Default::default() };
        let e = p.model_options(512).expect_err("bounds without the tier");
        assert!(e.to_string().contains("recallBounds `8`"), "{e}");
        let g: GenerateOptions = serde_json::from_str(r#"{"maxTokens": 5}"#).expect("generate options");
        assert_eq!(g, GenerateOptions { max_tokens: 5, stop_at_eos: true });
    }

    #[test]
    fn pieces_carry_whole_characters() {
        let bytes = "aé€😀".as_bytes();
        let mut pending = Vec::new();
        let mut out = String::new();
        let mut pieces = 0;
        for b in bytes {
            pending.push(*b);
            let s = take_utf8(&mut pending);
            pieces += usize::from(!s.is_empty());
            out.push_str(&s);
        }
        assert_eq!(out, "aé€😀");
        assert_eq!(pieces, 4, "one piece per character");
        let mut bad = vec![0xff, b'x', 0xe2, 0x82];
        assert_eq!(take_utf8(&mut bad), "\u{fffd}x");
        assert_eq!(bad, vec![0xe2, 0x82], "the unfinished euro sign waits");
    }
}
