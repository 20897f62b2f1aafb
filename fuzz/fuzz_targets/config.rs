//! Demo configuration files (TOML, `expertkv demo --config`) on arbitrary text, through the
//! checks `demo` runs before any GPU work: the workload, the router, the budget, every layer's
//! budget and the pool's configuration.
//! The body is `targets::config` (`fuzz/targets.rs`), which the test suite also runs on every
//! input of `fuzz/corpus/config`.
#![no_main]

#[allow(dead_code)]
#[path = "../targets.rs"]
mod targets;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| targets::config(data));
