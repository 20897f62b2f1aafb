//! The tokenizers on arbitrary text and arbitrary ids, over the synthetic models' vocabularies
//! (the GPT-2 byte-level BPE and the SentencePiece-style one the project writes): encoding never
//! panics, every encodable text decodes back to itself (a SentencePiece vocabulary's literal `▁`
//! as the space it stands for), and out-of-range ids are refused, not indexed.
#![no_main]

use std::sync::OnceLock;

use expertkv_model::SyntheticModel;
use expertkv_model::gguf::Gguf;
use expertkv_model::tokenizer::{PreTokenizer, Tokenizer};
use libfuzzer_sys::fuzz_target;

fn tokenizers() -> &'static [Tokenizer; 2] {
    static T: OnceLock<[Tokenizer; 2]> = OnceLock::new();
    T.get_or_init(|| {
        let load = |m: SyntheticModel| {
            let file = m.gguf();
            let g = Gguf::parse(&file).expect("the synthetic file parses");
            Tokenizer::from_gguf(&g).expect("its tokenizer loads")
        };
        [load(SyntheticModel::dense(1)), load(SyntheticModel { sentencepiece: true, ..SyntheticModel::dense(1) })]
    })
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let ids: Vec<u32> = data.chunks(4).map(|c| c.iter().fold(0u32, |a, &b| a << 8 | u32::from(b))).collect();
    // Every pre-tokenizer cuts the text into non-empty pieces that join back into it.
    for pre in [PreTokenizer::Gpt2, PreTokenizer::DigitsThenGpt2, PreTokenizer::Llama3, PreTokenizer::Qwen2] {
        let pieces = pre.split(&text);
        assert!(pieces.iter().all(|p| !p.is_empty()), "{pre:?}: an empty piece");
        assert_eq!(pieces.concat(), text, "{pre:?}: the pieces must join back into the text");
    }
    for t in tokenizers() {
        if t.unencodable(&text).is_none() {
            let encoded = t.encode(&text);
            let back = t.decode(&encoded).expect("ids the tokenizer made decode");
            // A SentencePiece vocabulary spells spaces `▁`: a literal one comes back as a space.
            let want = if t.is_sentencepiece() { text.replace('\u{2581}', " ") } else { text.to_string() };
            assert_eq!(back, want, "encode then decode must give the text back");
        }
        let _ = t.encode_with_special(&text);
        let _ = t.decode_bytes(&ids);
    }
});
