//! What the test binaries share: seeds that replay a case, options picked by seed, poison
//! patterns, the skip report and the trained model's path.

use std::io::Write;
use std::path::PathBuf;

/// `seed % CASE_PERIOD` is the case's index, and every list length up to 16 divides it
/// (720720 = lcm(1..=16)), so `seed % len` is the index modulo `len` for any such list.
pub const CASE_PERIOD: u64 = 720_720;

/// `n` seeds for one test: from `EXPERTKV_TEST_SEED` (one seed, to replay a failure) or derived
/// from the test's name, so each test draws its own inputs. Seed `i` is `i` modulo
/// [`CASE_PERIOD`], so options chosen with [`pick`] cycle through a list in order and a printed
/// seed picks the same options again when replayed.
pub fn seeds(test: &str, n: u64) -> Vec<u64> {
    if let Some(seed) = replay_seed() {
        return vec![seed];
    }
    assert!(n < CASE_PERIOD);
    let base = test.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    (0..n)
        .map(|i| {
            let h = base.wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            ((h / CASE_PERIOD) * CASE_PERIOD).wrapping_add(i)
        })
        .collect()
}

/// The seed `EXPERTKV_TEST_SEED` replays, if set.
pub fn replay_seed() -> Option<u64> {
    let s = std::env::var("EXPERTKV_TEST_SEED").ok()?;
    Some(s.trim().parse().unwrap_or_else(|_| panic!("EXPERTKV_TEST_SEED must be an integer, got {s:?}")))
}

/// Whether a single seed is being replayed: coverage counts over all seeds do not apply then.
pub fn replaying() -> bool {
    replay_seed().is_some()
}

/// The option of `options` (1 to 16 of them) that `seed` names: cycles in order over
/// [`seeds`]'s seeds, and is the same option whenever the seed is replayed.
pub fn pick<T: Clone>(seed: u64, options: &[T]) -> T {
    assert!(!options.is_empty() && options.len() <= 16, "pick takes 1 to 16 options");
    options[(seed % options.len() as u64) as usize].clone()
}

/// Poison patterns: a quiet NaN as f32, and a value no index or count takes.
pub const POISON_F32: u32 = 0x7fc0_dead;
pub const POISON_U32: u32 = 0xdead_beef;

/// A test (or a part of one) that cannot run on this machine says so by name: on stderr, and as
/// a line of the file `EXPERTKV_SKIPPED` names, which `scripts/test.sh` lists after the run, so
/// that a skip is never read as a pass.
pub fn skip(test: &str, why: impl std::fmt::Display) {
    eprintln!("skipped: {test}: {why}");
    if let Ok(path) = std::env::var("EXPERTKV_SKIPPED") {
        let line = format!("{test}: {why}\n");
        let written = std::fs::OpenOptions::new().create(true).append(true).open(&path).and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = written {
            panic!("{test}: could not record the skip in {path}: {e}");
        }
    }
}

/// The trained model (SmolLM2-135M, fetched by scripts/fetch_model.sh): its path, or `None`
/// (recorded as a skip of `test`) when it is missing, unless `EXPERTKV_REQUIRE_MODEL` is set,
/// as scripts/test.sh does, where a missing file fails the test.
pub fn model_path(test: &str) -> Option<PathBuf> {
    let dir = std::env::var("EXPERTKV_MODELS_DIR").unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../models").into());
    let path = PathBuf::from(dir).join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.is_file() {
        return Some(path);
    }
    assert!(std::env::var("EXPERTKV_REQUIRE_MODEL").is_err(), "{} is missing (scripts/fetch_model.sh fetches it)", path.display());
    skip(test, format!("{} is missing (scripts/fetch_model.sh fetches it)", path.display()));
    None
}

/// The README's "Library use" section shows the crates' compiled examples line for line:
/// `expertkv-core`'s crate example and `expertkv-model`'s `text` module example (both run as
/// doc-tests), so the README's API code is only code that compiles and runs.
#[cfg(test)]
mod readme {
    /// The lines of the first fenced block of `text`, each line stripped of `prefix` (`//! ` for
    /// a doc comment), hidden (`# `) and blank lines left out.
    fn example_lines(text: &str, prefix: &str) -> Vec<String> {
        text.lines()
            .filter_map(|l| l.strip_prefix(prefix).or_else(|| (l.trim_end() == prefix.trim_end()).then_some("")))
            .skip_while(|l| !l.starts_with("```"))
            .skip(1)
            .take_while(|l| !l.starts_with("```"))
            .filter(|l| !l.is_empty() && !l.starts_with("# ") && *l != "#")
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn the_readme_shows_the_compiled_examples() {
        let section = include_str!("../../README.md").split("## Library use").nth(1).expect("the README has a `## Library use` section");
        let blocks: Vec<Vec<String>> = section.split("```rust").skip(1).map(|b| example_lines(&format!("```rust{b}"), "")).collect();
        for (source, text) in
            [("core/src/lib.rs", include_str!("../../core/src/lib.rs")), ("model/src/text.rs", include_str!("../../model/src/text.rs"))]
        {
            let ours = example_lines(text, "//! ");
            assert!(ours.len() > 10, "{source}'s example: {ours:?}");
            assert!(blocks.contains(&ours), "README.md's `Library use` section has no copy of {source}'s example");
        }
        assert_eq!(blocks.first(), Some(&example_lines(include_str!("../../core/src/lib.rs"), "//! ")), "the core example comes first");
    }
}
