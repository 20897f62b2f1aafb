//! The model-trace reader (`expertkv compare`'s input) on arbitrary bytes, and the comparison
//! of whatever it reads with itself.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(t) = expertkv_model::forward::trace::read_model_trace(data) {
        let c = expertkv_model::forward::trace::compare(&t.passes, &t.passes);
        assert!(c.routing_parts_at.is_none() && c.residency_parts_at.is_none() && c.kv_parts_at.is_none());
    }
});
