//! Chunked prefill (`GpuLlama::prefill`): a prompt fed many tokens per forward pass gives the
//! logits of feeding it token by token, and leaves the pool as decoding needs it.

use expertkv_core::config::KvDtype;
use expertkv_core::evict::config::SchedulerConfig;
use expertkv_core::rng::Rng;
use expertkv_model::SyntheticModel;
use expertkv_model::config::Arch;
use expertkv_model::forward::{GpuLlama, ModelOptions, PREFILL_CHUNK};
use expertkv_model::gguf::{GgmlType, Gguf};

use crate::common::{rt, seeds};

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Llama (f32 K/V), Qwen2 (Q/K/V biases, f16 K/V) and Qwen3 (per-head Q/K norms, wider heads)
/// files, and MoE files (Mixtral-style, OLMoE, Qwen2-MoE): a prompt of more than a chunk (crossing chunk and page boundaries) prefilled in
/// chunks gives the last token's logits of feeding it one token per forward pass, and the
/// decode steps after it agree too (the pool holds every prompt token at its position).
#[test]
fn chunked_prefill_equals_token_by_token() {
    let rt = rt();
    // (architecture, K/V, experts): dense files, then MoE files (Mixtral-style, OLMoE's gating,
    // Qwen2-MoE's shared expert), whose experts run over the whole chunk.
    let cases = [
        (Arch::Llama, KvDtype::F32, 0),
        (Arch::Qwen2, KvDtype::F16, 0),
        (Arch::Qwen3, KvDtype::F32, 0),
        (Arch::Llama, KvDtype::F16, 8),
        (Arch::Olmoe, KvDtype::F32, 8),
        (Arch::Qwen2Moe, KvDtype::F32, 8),
    ];
    for ((arch, dtype, experts), seed) in cases.into_iter().zip(seeds("model_prefill", cases.len() as u64)) {
        let mut rng = Rng::new(seed);
        let head_dim = (arch == Arch::Qwen3).then_some(64);
        let base = if experts > 0 { SyntheticModel::moe(seed, experts, 2) } else { SyntheticModel::dense(seed) };
        let spec = SyntheticModel { arch, untied_output: true, heads: 4, kv_heads: 2, head_dim, context: 256, ..base }
            .with_weights(GgmlType::Q8_0);
        let file = spec.gguf();
        let g = Gguf::parse(&file).expect("gguf");
        let n = PREFILL_CHUNK + 20 + rng.below(7);
        let ids: Vec<u32> = (0..n).map(|_| rng.below(256)).collect();
        let ctx = format!("seed {seed}: {arch:?} {dtype:?}, {experts} experts, {n} prompt tokens");
        let opts = ModelOptions::new(1, 200).dtype(dtype);
        let mut one = pollster::block_on(GpuLlama::load(rt, &g, opts.clone())).expect("load");
        let mut want = Vec::new();
        for &t in &ids {
            want = pollster::block_on(one.forward(rt, &[t])).expect("forward");
        }
        let mut chunked = pollster::block_on(GpuLlama::load(rt, &g, opts)).expect("load");
        assert_eq!(chunked.chunked_prefill_refusal(), None, "{ctx}");
        let got = pollster::block_on(chunked.prefill(rt, 0, &ids)).expect("prefill");
        assert_eq!(chunked.positions, vec![n], "{ctx}");
        let tol = 1e-4;
        assert!(max_rel(&got, &want) <= tol, "{ctx}: prefill logits differ by {} of their scale", max_rel(&got, &want));
        assert!(chunked.dispatches_per_step() > 0, "{ctx}");
        for step in 0..3 {
            let t = rng.below(256);
            let (a, b) = (pollster::block_on(one.forward(rt, &[t])).expect("a"), pollster::block_on(chunked.forward(rt, &[t])).expect("b"));
            assert!(max_rel(&b, &a) <= tol, "{ctx}: decode step {step} after the prefill differs by {}", max_rel(&b, &a));
        }
    }
    // Where a policy acts between tokens, chunked prefill is refused by name, before any work.
    let file = SyntheticModel::dense(1).gguf();
    let g = Gguf::parse(&file).expect("gguf");
    let opts = ModelOptions::new(1, 64).scheduler(Some((SchedulerConfig::H2o { sinks: 2, window: 4 }, 16)));
    let mut m = pollster::block_on(GpuLlama::load(rt, &g, opts)).expect("load");
    let e = pollster::block_on(m.prefill(rt, 0, &[1, 2, 3])).expect_err("refused");
    assert!(e.to_string().contains("a scheduler acts after every token"), "{e}");
    assert_eq!(m.positions, vec![0]);
}
