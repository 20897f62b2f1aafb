//! The GGUF reader on arbitrary bytes: header, metadata (every value printed and read as each
//! array type), the tensor table, every tensor dequantised to f32 (each block format's decoder),
//! the model's configuration and tensor checks, and the tokenizer the file holds
//! (`expertkv_model::exercise::gguf`, which the mutation test uses too). Any input may be
//! refused; none may panic, hang or allocate beyond libFuzzer's -malloc_limit_mb.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    expertkv_model::exercise::gguf(data);
});
