use std::sync::OnceLock;

use expertkv_core::runtime::{Runtime, RuntimeOptions, ShaderChecks};
pub use expertkv_tests::{POISON_F32, POISON_U32, case_index, fixed_seeds, pick, seeds, skip};

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

/// The CPU f32 reference model of a GGUF file (the GPU tests' independent computation).
pub fn cpu_model(g: &expertkv_model::gguf::Gguf<'_>) -> expertkv_model::CpuModel {
    let cfg = expertkv_model::LlamaConfig::from_gguf(g).expect("config");
    let weights = expertkv_model::LlamaWeights::from_gguf(g, &cfg).expect("weights");
    expertkv_model::CpuModel::new(std::sync::Arc::new(weights)).expect("cpu model")
}

/// The SmolLM2 GGUF's bytes, or `None` (a skip of `test`) when the file is missing, unless
/// `EXPERTKV_REQUIRE_MODEL` is set (see [`expertkv_tests::model_path`]).
pub fn model_bytes(test: &str) -> Option<Vec<u8>> {
    let path = expertkv_tests::model_path(test)?;
    Some(std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}
