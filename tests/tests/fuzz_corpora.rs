//! Every fuzz target's corpus replayed as an ordinary test, on the stable compiler: the inputs
//! kept in `fuzz/corpus/TARGET` (each a case the fuzzer or a review found, or a seed), any crash
//! left in `fuzz/artifacts/TARGET`, and the binary seeds `fuzz/targets.rs` writes, each through
//! the target's own body (`fuzz/targets.rs`, which the libFuzzer binaries call too). The
//! coverage-guided runs themselves need the sanitizer build (`scripts/fuzz.sh`).

#[path = "../../fuzz/targets.rs"]
mod targets;

use std::path::{Path, PathBuf};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// The files of `dir`, sorted; none when it does not exist.
fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut out: Vec<PathBuf> = entries.flatten().map(|e| e.path()).filter(|p| p.is_file()).collect();
    out.sort();
    out
}

#[test]
fn every_fuzz_target_has_its_body_here() {
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).expect("fuzz/Cargo.toml");
    let mut bins: Vec<&str> = manifest
        .split("[[bin]]")
        .skip(1)
        .filter_map(|b| b.lines().find_map(|l| l.trim().strip_prefix("name = \"")?.strip_suffix('"')))
        .filter(|n| *n != "seeds")
        .collect();
    bins.sort_unstable();
    let mut ours: Vec<&str> = targets::TARGETS.iter().map(|(n, _)| *n).collect();
    ours.sort_unstable();
    assert_eq!(bins, ours, "fuzz/Cargo.toml's targets and fuzz/targets.rs's TARGETS");
    for t in &bins {
        let src = std::fs::read_to_string(fuzz_dir().join(format!("fuzz_targets/{t}.rs"))).expect("the target's source");
        assert!(src.contains(&format!("targets::{t}(data)")), "fuzz_targets/{t}.rs runs targets::{t}, the body this test replays");
    }
}

#[test]
fn every_fuzz_corpus_replays_without_a_failure() {
    let seeds = targets::seed_files();
    let mut failed = Vec::new();
    for (target, run) in targets::TARGETS {
        let mut inputs: Vec<(String, Vec<u8>)> = Vec::new();
        for sub in ["corpus", "artifacts"] {
            for p in files(&fuzz_dir().join(sub).join(target)) {
                let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                inputs.push((format!("fuzz/{sub}/{target}/{}", p.file_name().unwrap_or_default().to_string_lossy()), bytes));
            }
        }
        inputs.extend(seeds.iter().filter(|s| s.0 == target).map(|(_, name, b)| (format!("seed {name}"), b.clone())));
        assert!(!inputs.is_empty(), "{target}: no corpus and no seed to replay");
        for (name, bytes) in &inputs {
            if std::panic::catch_unwind(|| run(bytes)).is_err() {
                failed.push(format!("{target}: {name}"));
            }
        }
        println!("{target}: {} inputs replayed", inputs.len());
    }
    assert!(failed.is_empty(), "inputs that fail their target:\n{}", failed.join("\n"));
}
