//! The model-trace reader (`expertkv compare`'s input) on arbitrary bytes, and the comparison
//! of whatever it reads with itself.
//! The body is `targets::model_trace` (`fuzz/targets.rs`), which the test suite also runs on every
//! input of `fuzz/corpus/model_trace`.
#![no_main]

#[allow(dead_code)]
#[path = "../targets.rs"]
mod targets;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| targets::model_trace(data));
