//! The GGUF reader on arbitrary bytes: header, metadata (every value printed and read as each
//! array type), the tensor table, every tensor dequantised to f32 (each block format's decoder),
//! the model's configuration and tensor checks, and the tokenizer the file holds
//! (`expertkv_model::exercise::gguf`, which the mutation test uses too). Any input may be
//! refused; none may panic, hang or allocate beyond libFuzzer's -malloc_limit_mb.
//! The body is `targets::gguf` (`fuzz/targets.rs`), which the test suite also runs on every
//! input of `fuzz/corpus/gguf`.
#![no_main]

#[allow(dead_code)]
#[path = "../targets.rs"]
mod targets;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| targets::gguf(data));
