//! The MoEfication cache (`Moefication::from_bytes`, read back by `run --moe` from
//! `.expertkv-cache`) on arbitrary bytes, against a synthetic model's weights: refused or
//! consistent, never a panic.
#![no_main]

use std::sync::OnceLock;

use expertkv_model::gguf::Gguf;
use expertkv_model::{LlamaConfig, LlamaWeights, Moefication, SyntheticModel};
use libfuzzer_sys::fuzz_target;

fn weights() -> &'static LlamaWeights {
    static W: OnceLock<LlamaWeights> = OnceLock::new();
    W.get_or_init(|| {
        let file = SyntheticModel::dense(2).gguf();
        let g = Gguf::parse(&file).expect("the synthetic file parses");
        let c = LlamaConfig::from_gguf(&g).expect("config");
        LlamaWeights::from_gguf(&g, &c).expect("weights")
    })
}

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Moefication::from_bytes(data, weights()) {
        let _ = m.check_fits(weights());
    }
});
