//! The MoEfication cache (`Moefication::from_bytes`, read back by `run --moe` from
//! `.expertkv-cache`) on arbitrary bytes, against a synthetic model's weights: refused or
//! consistent, never a panic.
//! The body is `targets::moe_cache` (`fuzz/targets.rs`), which the test suite also runs on every
//! input of `fuzz/corpus/moe_cache`.
#![no_main]

#[allow(dead_code)]
#[path = "../targets.rs"]
mod targets;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| targets::moe_cache(data));
