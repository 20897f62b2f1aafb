//! What each fuzz target does with one input, in plain Rust (no libFuzzer): the targets in
//! `fuzz_targets/` call these, and the test suite replays every corpus through them
//! (`tests/tests/fuzz_corpora.rs`, on the stable compiler, no sanitizers), so an input kept in
//! `fuzz/corpus/TARGET` stays fixed. Included by `#[path]` in both places, so it depends only on
//! what both have: `expertkv-core`, `expertkv-model` and `toml`. Its fixtures (synthetic models)
//! are built with `expect`: a harness, where a panic is the report.
#![allow(clippy::expect_used)]

use std::sync::OnceLock;

use expertkv_core::pipeline::DemoConfig;
use expertkv_model::gguf::{GgmlType, Gguf};
use expertkv_model::moe::MoeConfig;
use expertkv_model::tokenizer::{PreTokenizer, Tokenizer};
use expertkv_model::{LlamaConfig, LlamaWeights, Moefication, SyntheticModel};

/// A target's name and its body.
pub type Target = (&'static str, fn(&[u8]));

/// Every target by name, with its function: the `[[bin]]`s of `fuzz/Cargo.toml` but `seeds`.
pub const TARGETS: [Target; 6] = [
    ("gguf", gguf),
    ("tokenizer", tokenizer),
    ("trace", trace),
    ("config", config),
    ("moe_cache", moe_cache),
    ("model_trace", model_trace),
];

/// Demo configuration files (TOML, `expertkv demo --config`) on arbitrary text, through the
/// checks `demo` runs before any GPU work: the workload, the router, the budget, every layer's
/// budget and the pool's configuration.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(cfg) = toml::from_str::<DemoConfig>(text) else { return };
    if cfg.workload.validate().is_err() || cfg.router.validate(cfg.workload.n_experts, cfg.workload.top_k).is_err() {
        return;
    }
    if cfg.budget_tokens().is_err() || cfg.layer_budgets().is_err() {
        return;
    }
    let _ = cfg.pool_config().validate();
}

/// The GGUF reader on arbitrary bytes: header, metadata (every value printed and read as each
/// array type), the tensor table, every tensor dequantised to f32 (each block format's decoder),
/// the model's configuration and tensor checks, and the tokenizer the file holds
/// (`expertkv_model::exercise::gguf`, which the mutation test uses too). Any input may be
/// refused; none may panic, hang or allocate beyond libFuzzer's -malloc_limit_mb.
pub fn gguf(data: &[u8]) {
    expertkv_model::exercise::gguf(data);
}

/// The model-trace reader (`expertkv compare`'s input) on arbitrary bytes, and the comparison
/// of whatever it reads with itself.
pub fn model_trace(data: &[u8]) {
    if let Ok(t) = expertkv_model::forward::trace::read_model_trace(data) {
        let c = expertkv_model::forward::trace::compare(&t.passes, &t.passes);
        assert!(c.routing_parts_at.is_none() && c.residency_parts_at.is_none() && c.kv_parts_at.is_none());
    }
}

/// The weights the MoEfication cache target reads caches against (and `seeds` writes one for).
fn moe_weights() -> &'static LlamaWeights {
    static W: OnceLock<LlamaWeights> = OnceLock::new();
    W.get_or_init(|| {
        let file = SyntheticModel::dense(2).gguf();
        let g = Gguf::parse(&file).expect("the synthetic file parses");
        let c = LlamaConfig::from_gguf(&g).expect("config");
        LlamaWeights::from_gguf(&g, &c).expect("weights")
    })
}

/// The MoEfication cache (`Moefication::from_bytes`, read back by `run --moe` from
/// `.expertkv-cache`) on arbitrary bytes, against a synthetic model's weights: refused or
/// consistent, never a panic.
pub fn moe_cache(data: &[u8]) {
    if let Ok(m) = Moefication::from_bytes(data, moe_weights()) {
        let _ = m.check_fits(moe_weights());
    }
}

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

/// The tokenizers on arbitrary text and arbitrary ids, over the synthetic models' vocabularies
/// (the GPT-2 byte-level BPE and the SentencePiece-style one the project writes): encoding never
/// panics, every encodable text decodes back to itself (a SentencePiece vocabulary's literal `▁`
/// as the space it stands for), and out-of-range ids are refused, not indexed.
pub fn tokenizer(data: &[u8]) {
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
}

/// The decode-trace reader (`expertkv replay`'s input) on arbitrary bytes.
pub fn trace(data: &[u8]) {
    let _ = expertkv_core::trace::read_trace(data);
}

/// The seed files no text editor makes, `(target, file name, bytes)`: small synthetic GGUF
/// models and a MoEfication cache of the `moe_cache` target's own weights. `seeds` writes them
/// before fuzzing and the corpus test replays them, so no model file is kept in the repository.
pub fn seed_files() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let small = SyntheticModel { layers: 1, hidden: 32, heads: 1, ffn: 32, ..SyntheticModel::dense(1) };
    let moe = SyntheticModel { experts: 4, top_k: 2, ..small.clone() };
    let m = Moefication::from_weights(moe_weights(), &MoeConfig::new(4, 2)).expect("moefication");
    vec![
        ("gguf", "dense-q8_0.gguf", small.clone().with_weights(GgmlType::Q8_0).gguf()),
        ("gguf", "dense-sentencepiece.gguf", SyntheticModel { sentencepiece: true, ..small }.gguf()),
        ("gguf", "moe-q4_1.gguf", moe.with_weights(GgmlType::Q4_1).gguf()),
        ("moe_cache", "e4k2.bin", m.to_bytes().expect("cache bytes")),
    ]
}
