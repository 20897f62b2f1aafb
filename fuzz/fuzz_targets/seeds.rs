//! Writes the seed files no text editor makes (small synthetic GGUF models, a MoEfication
//! cache of the `moe_cache` target's own weights: `targets::seed_files`) into the folder given,
//! one subfolder per target; `scripts/fuzz.sh` runs it before fuzzing, so no model file is kept
//! in the repository.

use std::path::Path;

#[allow(dead_code)]
#[path = "../targets.rs"]
mod targets;

fn main() {
    let dir = std::env::args().nth(1).expect("usage: seeds FOLDER");
    for (target, name, bytes) in targets::seed_files() {
        let folder = Path::new(&dir).join(target);
        std::fs::create_dir_all(&folder).unwrap_or_else(|e| panic!("creating {}: {e}", folder.display()));
        std::fs::write(folder.join(name), bytes).unwrap_or_else(|e| panic!("writing {name}: {e}"));
    }
}
