//! Fixtures shared by the crate's unit tests: the real model (when present) and its texts.

use crate::CpuModel;
use crate::gguf::{Gguf, test_model_bytes};
use crate::tokenizer::Tokenizer;
use crate::weights::tests::test_weights;

pub(crate) const PROMPT: &str = "The capital of France is";

pub(crate) fn test_model(test: &str) -> Option<(CpuModel, Tokenizer)> {
    let w = test_weights(test)?;
    let tok = Tokenizer::from_gguf(&Gguf::parse(test_model_bytes(test)?).unwrap()).unwrap();
    Some((CpuModel::new(w).unwrap(), tok))
}

/// The prompt's ids as llama.cpp would feed them (BOS only when the file asks for it).
pub(crate) fn prompt_ids(tok: &Tokenizer, text: &str) -> Vec<u32> {
    let mut ids: Vec<u32> = tok.bos().filter(|_| tok.add_bos()).into_iter().collect();
    ids.extend(tok.encode(text));
    ids
}

/// Written for these tests.
pub(crate) const PERPLEXITY_TEXT: &str =
    "The sun rises in the east and sets in the west. Every morning, the children walk to school with their friends.";

/// The words of `text` in a random order (fixed seed).
pub(crate) fn shuffle_words(text: &str, seed: u64) -> String {
    let mut words: Vec<&str> = text.split(' ').collect();
    let mut rng = expertkv_core::rng::Rng::new(seed);
    for i in (1..words.len()).rev() {
        words.swap(i, rng.below(i as u32 + 1) as usize);
    }
    words.join(" ")
}
