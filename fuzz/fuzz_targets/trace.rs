//! The decode-trace reader (`expertkv replay`'s input) on arbitrary bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = expertkv_core::trace::read_trace(data);
});
