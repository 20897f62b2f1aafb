//! What the mutation test and the coverage-guided fuzzer drive a GGUF file through. It reads the
//! file with the configuration and the tokenizer too, so it lives above all three rather than in
//! [`gguf`](crate::gguf): the container must not depend on what is read from it.

use crate::config::LlamaConfig;
use crate::gguf::{Gguf, Value};
use crate::tokenizer::Tokenizer;

/// Everything a consumer of a GGUF file does with it (every metadata value printed and read as
/// each array type, every tensor's bytes and f32 values, the model configuration and its tensor
/// checks, the tokenizer encoding and decoding): what the mutation test and the coverage-guided
/// fuzzer (`fuzz/fuzz_targets/gguf.rs`) feed their inputs through. Results are ignored, only
/// panics and allocations matter; returns whether the file parsed.
pub fn gguf(bytes: &[u8]) -> bool {
    let Ok(g) = Gguf::parse(bytes) else { return false };
    for (_, v) in g.metadata() {
        let _ = v.to_string();
        if let Some(a) = v.as_array() {
            let _ = (a.to_strs(), a.to_i64s(), a.to_f32s());
            for e in a.iter() {
                if let Ok(Value::Array(inner)) = e {
                    let _ = (inner.to_strs(), inner.iter().count());
                }
            }
        }
    }
    for t in g.tensors() {
        let _ = g.data(t);
        let _ = g.tensor_f32(t.name());
    }
    if let Ok(c) = LlamaConfig::from_gguf(&g) {
        let _ = c.check_tensors(&g);
    }
    if let Ok(t) = Tokenizer::from_gguf(&g) {
        let ids = t.encode_with_special("ab 12 <|endoftext|> é");
        let _ = t.decode(&ids);
    }
    true
}
