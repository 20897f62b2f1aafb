use std::sync::OnceLock;

use expertkv_core::runtime::{Runtime, RuntimeOptions, ShaderChecks};

fn open(checks: ShaderChecks) -> Runtime {
    let mut opts = RuntimeOptions::from_env().expect("EXPERTKV_* environment variables");
    opts.checks = checks;
    pollster::block_on(Runtime::new(opts))
        .unwrap_or_else(|e| panic!("these tests need a GPU adapter (scripts/test.sh installs Mesa lavapipe when none exists): {e}"))
}

/// The shared runtime with wgpu's bounds checks everywhere.
pub fn rt() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| open(ShaderChecks::Checked))
}

/// The shared runtime that builds tested kernels without bounds checks.
pub fn rt_trusted() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| open(ShaderChecks::TrustedTested))
}

/// `n` seeds for one test: from `EXPERTKV_TEST_SEED` (one seed, to replay a failure) or derived
/// from the test's name, so each test draws its own inputs.
pub fn seeds(test: &str, n: u64) -> Vec<u64> {
    if let Ok(s) = std::env::var("EXPERTKV_TEST_SEED") {
        let seed = s.trim().parse().expect("EXPERTKV_TEST_SEED must be an integer");
        return vec![seed];
    }
    let base = test.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    (0..n).map(|i| base.wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15))).collect()
}

/// Poison patterns: a quiet NaN as f32, and a value no index or count takes.
pub const POISON_F32: u32 = 0x7fc0_dead;
pub const POISON_U32: u32 = 0xdead_beef;

/// The SmolLM2 GGUF's bytes (`EXPERTKV_MODELS_DIR` or `models/`, fetched by
/// scripts/fetch_model.sh); `None` (the test skips) when it is missing, unless
/// `EXPERTKV_REQUIRE_MODEL` is set, as scripts/test.sh does.
pub fn model_bytes() -> Option<Vec<u8>> {
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
