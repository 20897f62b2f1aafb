//! A printed seed replays its case only if the test chooses the case's options from the seed.
//! Under `EXPERTKV_TEST_SEED`, [`seeds`](crate::seeds) returns that one seed, so a loop that
//! chose its options by position (`.enumerate()`'s index, a list of cases zipped with the seeds,
//! the seeds' vector indexed by a counter) runs the first case's options with it instead of the
//! failing case's. These tests read every test source that calls `seeds(` and refuse those forms;
//! a loop must be `for SEED in seeds(..)` with the options picked from `SEED` (`pick`,
//! `case_index`, an `Rng` seeded with it), or take `seeds(..)[0]`.
//!
//! What this does not see: a counter kept by hand across the iterations and used to choose an
//! option. The check is textual; it is tested below on the forms it must refuse (each taken from
//! a test as it stood before the fix) and on those it must let through.

use std::path::{Path, PathBuf};

/// Every place in `src` (a Rust file's text) where `seeds(` is called in a way that does not
/// replay: `(line, message)`.
pub fn offending_seed_uses(src: &str) -> Vec<(usize, String)> {
    let lines: Vec<&str> = src.lines().collect();
    let mut found = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        let mut from = 0;
        while let Some(at) = code[from..].find("seeds(").map(|i| i + from) {
            from = at + "seeds(".len();
            // A definition (`fn seeds(`) or another name ending in `seeds(`.
            let before = &code[..at];
            if before.trim_end().ends_with("fn") || before.ends_with(|c: char| c.is_alphanumeric() || c == '_') {
                continue;
            }
            // The call's closing parenthesis, perhaps on a later line.
            // `code` is a prefix of `lines[n]`, so `at` is also the call's offset in `rest`.
            let rest: String = lines[n..lines.len().min(n + 20)].join("\n");
            let start = at + "seeds(".len();
            let mut depth = 1;
            let mut end = None;
            for (i, c) in rest[start..].char_indices() {
                match c {
                    '(' => depth += 1,
                    ')' => {
                        depth -= 1;
                        if depth == 0 {
                            end = Some(start + i + 1);
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let Some(end) = end else {
                found.push((n + 1, "an unclosed `seeds(` call".to_owned()));
                continue;
            };
            let after = rest[end..].trim_start();
            if after.starts_with("[0]") {
                continue;
            }
            // A loop's header: from `for` to the `{` that opens its body.
            let trimmed = line.trim_start();
            if let Some(pat) = trimmed.strip_prefix("for ") {
                let header: String = lines[n..]
                    .iter()
                    .scan(false, |done, l| {
                        if *done {
                            return None;
                        }
                        *done = l.trim_end().ends_with('{');
                        Some(*l)
                    })
                    .collect::<Vec<_>>()
                    .join(" ");
                let binding = pat.split(" in ").next().unwrap_or("").trim();
                if !binding.chars().all(|c| c.is_alphanumeric() || c == '_') || binding.is_empty() {
                    found.push((n + 1, format!("the loop binds `{binding}`, not one seed: its options may come from the position")));
                } else if header.contains(".enumerate()") || header.contains(".zip(") {
                    found.push((n + 1, "the loop zips or enumerates the seeds: its options come from the position".to_owned()));
                }
                continue;
            }
            found.push((
                n + 1,
                "`seeds(..)` kept or indexed outside a `for SEED in seeds(..)` loop (a replay gives one seed: index it only with [0])"
                    .to_owned(),
            ));
        }
    }
    found
}

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())).flatten().collect();
    entries.sort_by_key(|e| e.path());
    for e in entries {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn every_seeded_loop_chooses_its_case_from_the_seed() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for dir in ["tests/tests", "model/src", "core/src", "native/tests", "viewer/tests", "store/src", "examples"] {
        let d = root.join(dir);
        if d.is_dir() {
            rust_files(&d, &mut files);
        }
    }
    let mut calls = 0;
    let mut bad = Vec::new();
    for f in &files {
        let src = std::fs::read_to_string(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        calls += src.matches("seeds(\"").count() + src.matches("seeds(&").count();
        bad.extend(offending_seed_uses(&src).into_iter().map(|(l, m)| format!("{}:{l}: {m}", f.display())));
    }
    // The check reads the files it should: the GPU tests call `seeds(` 84 times (2026-12-07).
    assert!(calls > 60, "only {calls} calls of seeds( found under {}", root.display());
    assert!(bad.is_empty(), "seeded loops that do not replay their case:\n{}", bad.join("\n"));
}

/// The forms the check refuses, each as a test had it before its fix (issue #56), and the forms
/// it lets through.
#[test]
fn the_seed_loop_check_tells_replaying_loops_from_positional_ones() {
    let refused = [
        // prefill.rs: the case list zipped with the seeds, the index choosing more.
        "    for (i, ((arch, dtype, experts, chunk), seed)) in cases.into_iter().zip(seeds(\"model_prefill\", cases.len() as u64)).enumerate() {",
        // experts.rs
        "    for ((weights, n_seqs, policy, prefetch), seed) in cases.into_iter().zip(seeds(\"model_expert_cache\", cases.len() as u64)) {",
        // ops.rs and store.rs: the loop index choosing options.
        "    for (i, seed) in seeds(\"model_moe_file_experts\", 18).into_iter().enumerate() {",
        // A zip spread over lines.
        "    for (case, seed) in cases\n        .into_iter()\n        .zip(seeds(\"x\", 3))\n    {",
        // model.rs: the seeds indexed by an outer loop's position.
        "    for (i, arch) in archs.into_iter().enumerate() {\n        let all = seeds(\"model_qwen\", archs.len() as u64);\n        let seed = all[i.min(all.len() - 1)];",
        "        let seed = seeds(\"model_qwen\", 5)[i];",
    ];
    for src in refused {
        assert!(!offending_seed_uses(src).is_empty(), "not refused:\n{src}");
    }
    let allowed = [
        "    for seed in seeds(\"model_prefill\", cases.len() as u64) {\n        let (arch, dtype, experts, chunk) = pick(seed, &cases);",
        "    let seed = seeds(\"store_miss\", 1)[0];",
        "        for seed in seeds(&format!(\"codec plan {name}\"), 2) {",
        "    let (_, file) = synthetic_dense(seeds(\"model_codecs\", 1)[0], GgmlType::Q8_0);",
        "pub fn seeds(test: &str, n: u64) -> Vec<u64> {",
        "    seeds_from(test, n, replay_seed(), seed_salt())",
        "    // for (i, seed) in seeds(\"x\", 2).into_iter().enumerate() {",
    ];
    for src in allowed {
        assert_eq!(offending_seed_uses(src), [], "refused:\n{src}");
    }
}
