//! Writes the seed files no text editor makes (small synthetic GGUF models, a MoEfication
//! cache of the `moe_cache` target's own weights) into the folder given, one subfolder per
//! target; `scripts/fuzz.sh` runs it before fuzzing, so no model file is kept in the repository.

use std::path::Path;

use expertkv_model::gguf::{GgmlType, Gguf};
use expertkv_model::moe::MoeConfig;
use expertkv_model::{LlamaConfig, LlamaWeights, Moefication, SyntheticModel};

fn write(dir: &Path, target: &str, name: &str, bytes: &[u8]) {
    let folder = dir.join(target);
    std::fs::create_dir_all(&folder).unwrap_or_else(|e| panic!("creating {}: {e}", folder.display()));
    std::fs::write(folder.join(name), bytes).unwrap_or_else(|e| panic!("writing {name}: {e}"));
}

fn main() {
    let dir = std::env::args().nth(1).expect("usage: seeds FOLDER");
    let dir = Path::new(&dir);
    let small = SyntheticModel { layers: 1, hidden: 32, heads: 1, ffn: 32, ..SyntheticModel::dense(1) };
    write(dir, "gguf", "dense-q8_0.gguf", &small.clone().with_weights(GgmlType::Q8_0).gguf());
    write(dir, "gguf", "dense-sentencepiece.gguf", &SyntheticModel { sentencepiece: true, ..small.clone() }.gguf());
    let moe = SyntheticModel { experts: 4, top_k: 2, ..small };
    write(dir, "gguf", "moe-q4_1.gguf", &moe.with_weights(GgmlType::Q4_1).gguf());
    // The weights `fuzz_targets/moe_cache.rs` reads caches against.
    let file = SyntheticModel::dense(2).gguf();
    let g = Gguf::parse(&file).expect("the synthetic file parses");
    let w = LlamaWeights::from_gguf(&g, &LlamaConfig::from_gguf(&g).expect("config")).expect("weights");
    let m = Moefication::from_weights(&w, &MoeConfig::new(4, 2)).expect("moefication");
    write(dir, "moe_cache", "e4k2.bin", &m.to_bytes().expect("cache bytes"));
}
