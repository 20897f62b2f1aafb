//! SmolLM2-135M through the GPU forward pass with its K/V in the expertkv pool (the model file
//! comes from scripts/fetch_model.sh; without it the test skips unless EXPERTKV_REQUIRE_MODEL).

use expertkv_core::config::KvDtype;
use expertkv_core::forward::GpuLlama;
use expertkv_core::gguf::Gguf;
use expertkv_core::tokenizer::Tokenizer;

use crate::common::rt;

fn model_bytes() -> Option<Vec<u8>> {
    let dir = std::env::var("EXPERTKV_MODELS_DIR").unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../models").into());
    let path = std::path::Path::new(&dir).join("SmolLM2-135M-Instruct.Q4_1.gguf");
    match std::fs::read(&path) {
        Ok(b) => Some(b),
        Err(_) => {
            assert!(std::env::var("EXPERTKV_REQUIRE_MODEL").is_err(), "{} is missing (scripts/fetch_model.sh)", path.display());
            println!("skipped: {} is missing (scripts/fetch_model.sh fetches it)", path.display());
            None
        }
    }
}

#[test]
fn greedy_decoding_says_paris() {
    let Some(bytes) = model_bytes() else { return };
    let g = Gguf::parse(&bytes).expect("gguf");
    let tok = Tokenizer::from_gguf(&g).expect("tokenizer");
    let rt = rt();
    let prompt = tok.encode("The capital of France is");
    let mut m = pollster::block_on(GpuLlama::load(rt, &g, 1, 64, KvDtype::F16)).expect("load");
    let out = pollster::block_on(m.generate_greedy(rt, &prompt, 2)).expect("generate");
    let text = tok.decode(&out).expect("decode");
    println!("greedy: {prompt:?} -> {out:?} = {text:?}");
    assert_eq!(text, " Paris.", "greedy continuation");
    // Every prompt and generated token's K/V of every layer sits in the pool.
    let ctl = pollster::block_on(m.pool.read_ctl(rt)).expect("ctl");
    assert_eq!(ctl.tokens_appended as usize, (prompt.len() + 1) * m.cfg.block_count as usize);
}
