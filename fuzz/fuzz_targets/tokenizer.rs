//! The tokenizer on arbitrary text and arbitrary ids, over a synthetic model's vocabulary (the
//! GPT-2 byte-level BPE the project writes): encoding never panics, every encodable text decodes
//! back to its bytes, and out-of-range ids are refused, not indexed.
#![no_main]

use std::sync::OnceLock;

use expertkv_model::SyntheticModel;
use expertkv_model::gguf::Gguf;
use expertkv_model::tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let file = SyntheticModel::dense(1).gguf();
        let g = Gguf::parse(&file).expect("the synthetic file parses");
        Tokenizer::from_gguf(&g).expect("its tokenizer loads")
    })
}

fuzz_target!(|data: &[u8]| {
    let t = tokenizer();
    let text = String::from_utf8_lossy(data);
    if t.unencodable(&text).is_none() {
        let ids = t.encode(&text);
        let back = t.decode_bytes(&ids).expect("ids the tokenizer made decode");
        assert_eq!(back, text.as_bytes(), "encode then decode must give the text back");
    }
    let ids: Vec<u32> = data.chunks(4).map(|c| c.iter().fold(0u32, |a, &b| a << 8 | u32::from(b))).collect();
    let _ = t.decode_bytes(&ids);
});
