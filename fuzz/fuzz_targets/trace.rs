//! The decode-trace reader (`expertkv replay`'s input) on arbitrary bytes.
//! The body is `targets::trace` (`fuzz/targets.rs`), which the test suite also runs on every
//! input of `fuzz/corpus/trace`.
#![no_main]

#[allow(dead_code)]
#[path = "../targets.rs"]
mod targets;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| targets::trace(data));
