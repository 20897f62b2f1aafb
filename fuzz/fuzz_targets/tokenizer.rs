//! The tokenizers on arbitrary text and arbitrary ids, over the synthetic models' vocabularies
//! (the GPT-2 byte-level BPE and the SentencePiece-style one the project writes): encoding never
//! panics, every encodable text decodes back to itself (a SentencePiece vocabulary's literal `▁`
//! as the space it stands for), and out-of-range ids are refused, not indexed.
//! The body is `targets::tokenizer` (`fuzz/targets.rs`), which the test suite also runs on every
//! input of `fuzz/corpus/tokenizer`.
#![no_main]

#[allow(dead_code)]
#[path = "../targets.rs"]
mod targets;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| targets::tokenizer(data));
