//! What the test binaries share: seeds that replay a case, options picked by seed, poison
//! patterns, the skip report and the trained model's path.

use std::io::Write;
use std::path::PathBuf;

/// `seed % CASE_PERIOD` is the case's index, and every list length up to 16 divides it
/// (720720 = lcm(1..=16)), so `seed % len` is the index modulo `len` for any such list.
pub const CASE_PERIOD: u64 = 720_720;

/// `n` seeds for one test: from `EXPERTKV_TEST_SEED` (one seed, to replay a failure) or derived
/// from the test's name, so each test draws its own inputs, and from `EXPERTKV_SEED_SALT` when it
/// is set (`scripts/test.sh` sets a fresh one per run and prints it), so each run draws new ones;
/// without a salt the seeds are the same in every run. Seed `i` is `i` modulo [`CASE_PERIOD`]
/// ([`case_index`]), so options chosen with [`pick`] cycle through a list in order and a printed
/// seed picks the same options again when replayed, salt or not.
pub fn seeds(test: &str, n: u64) -> Vec<u64> {
    seeds_from(test, n, replay_seed(), seed_salt())
}

/// [`seeds`] from its inputs: the replayed seed if any, else `n` seeds from the test's name and
/// the salt.
pub fn seeds_from(test: &str, n: u64, replay: Option<u64>, salt: Option<u64>) -> Vec<u64> {
    if let Some(seed) = replay {
        return vec![seed];
    }
    assert!(n < CASE_PERIOD);
    let mut base = test.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    if let Some(salt) = salt {
        base = mix64(base ^ mix64(salt));
    }
    (0..n)
        .map(|i| {
            let h = base.wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            ((h / CASE_PERIOD) * CASE_PERIOD).wrapping_add(i)
        })
        .collect()
}

/// SplitMix64's finaliser: every bit of the salt reaches every bit of the base.
fn mix64(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The index of the case `seed` stands for among its test's seeds (`seed % CASE_PERIOD`): what a
/// test chooses its options by, never the position in its loop, so that a replayed seed is the
/// same case.
pub fn case_index(seed: u64) -> u64 {
    seed % CASE_PERIOD
}

/// The salt `EXPERTKV_SEED_SALT` gives, if set and not empty.
pub fn seed_salt() -> Option<u64> {
    let s = std::env::var("EXPERTKV_SEED_SALT").ok().filter(|s| !s.trim().is_empty())?;
    Some(s.trim().parse().unwrap_or_else(|_| panic!("EXPERTKV_SEED_SALT must be an integer, got {s:?}")))
}

/// The seed `EXPERTKV_TEST_SEED` replays, if set.
pub fn replay_seed() -> Option<u64> {
    let s = std::env::var("EXPERTKV_TEST_SEED").ok()?;
    Some(s.trim().parse().unwrap_or_else(|_| panic!("EXPERTKV_TEST_SEED must be an integer, got {s:?}")))
}

/// Whether the seeds are the fixed ones: no seed replayed (`EXPERTKV_TEST_SEED`) and no salt
/// (`EXPERTKV_SEED_SALT`). A test's coverage counts (every option drawn, enough pages compressed)
/// are established over its fixed seeds and checked only then: one replayed seed covers little,
/// and fresh seeds may, now and then, draw no case of a rare kind.
pub fn fixed_seeds() -> bool {
    replay_seed().is_none() && seed_salt().is_none()
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

#[cfg(test)]
mod seed_loops;

#[cfg(test)]
mod seed_tests {
    use super::*;

    #[test]
    fn a_seed_names_its_case_and_replays_it() {
        let options = ["a", "b", "c", "d", "e", "f", "g"];
        for salt in [None, Some(0), Some(1), Some(0xdead_beef_u64)] {
            let all = seeds_from("some_test", 12, None, salt);
            assert_eq!(all.len(), 12);
            for (i, &s) in all.iter().enumerate() {
                assert_eq!(case_index(s), i as u64, "salt {salt:?}");
                assert_eq!(pick(s, &options), options[i % options.len()], "salt {salt:?}: seed {s} picks case {i}'s option");
                // Replayed, the seed alone comes back (whatever the salt), so the same options.
                assert_eq!(seeds_from("some_test", 12, Some(s), salt), [s]);
                assert_eq!(seeds_from("other_test", 3, Some(s), None), [s]);
            }
            let mut sorted = all.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), all.len(), "distinct seeds");
        }
    }

    #[test]
    fn the_salt_draws_new_seeds_and_none_keeps_the_fixed_ones() {
        // The fixed derivation (no salt) is the one every earlier run used: its first seed for
        // "copy" pinned here, so a change to it is seen.
        assert_eq!(seeds_from("copy", 2, None, None), seeds_from("copy", 2, None, None));
        assert_eq!(seeds_from("copy", 1, None, None)[0], FIXED_COPY_SEED);
        let fixed = seeds_from("copy", 8, None, None);
        let a = seeds_from("copy", 8, None, Some(1));
        let b = seeds_from("copy", 8, None, Some(2));
        assert_ne!(a, fixed);
        assert_ne!(a, b);
        assert_eq!(a, seeds_from("copy", 8, None, Some(1)), "a salt's seeds are the same again");
        // Salted or not, two tests draw different seeds.
        assert_ne!(seeds_from("copy", 1, None, Some(1)), seeds_from("fma", 1, None, Some(1)));
        // No seed of a salted run equals a fixed one of the same test, in any of a few salts.
        for salt in 0..16 {
            let s = seeds_from("copy", 8, None, Some(salt));
            assert!(s.iter().all(|x| !fixed.contains(x)), "salt {salt}");
        }
    }

    /// `seeds("copy", 1)[0]` as the fixed derivation gives it (before salts existed).
    const FIXED_COPY_SEED: u64 = 862_724_725_350_808_320;
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
