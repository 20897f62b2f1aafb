//! Chunked prefill (`GpuLlama::prefill`): a prompt fed many tokens per forward pass gives the
//! logits of feeding it token by token, and leaves the pool as decoding needs it.

use expertkv_core::config::KvDtype;
use expertkv_core::evict::config::SchedulerConfig;
use expertkv_core::rng::Rng;
use expertkv_model::SyntheticModel;
use expertkv_model::config::Arch;
use expertkv_model::forward::{GpuLlama, MAX_PREFILL_CHUNK, ModelOptions};
use expertkv_model::gguf::{GgmlType, Gguf};

use crate::common::{pick, rt, seeds};

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// `GpuLlama::stage_times` after `prefill_chunks` chunks and `steps` decode steps: each
/// recording's every stage, in milliseconds (finite, not negative, some of them positive), or
/// `null` throughout where the device cannot time stages.
fn check_stage_times(v: &serde_json::Value, prefill_chunks: u32, steps: u32, moe: bool, timed: bool, ctx: &str) {
    if !timed {
        assert!(v["prefill"].is_null() && v["decode"].is_null(), "{ctx}: {v}");
        return;
    }
    let ffn = if moe { "output and experts" } else { "output and FFN" };
    let mut stages = ["append", "attention", "attention inputs", "embed", ffn, "gather", "head"];
    stages.sort_unstable();
    for (kind, count) in [("prefill", prefill_chunks), ("decode", steps)] {
        let r = &v[kind];
        assert_eq!(r["recordings"], count, "{ctx}: {kind} {r}");
        let ms = r["stages_ms"].as_object().unwrap_or_else(|| panic!("{ctx}: {kind} has no stages: {r}"));
        let mut names: Vec<&str> = ms.keys().map(String::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, stages, "{ctx}: {kind}");
        assert!(ms.values().all(|x| x.as_f64().is_some_and(|x| x.is_finite() && x >= 0.0)), "{ctx}: {kind} {r}");
        let total = r["total_ms"].as_f64().unwrap_or(f64::NAN);
        let sum: f64 = ms.values().filter_map(serde_json::Value::as_f64).sum();
        assert!(total > 0.0 && (total - sum).abs() <= 1e-9 * sum.max(1.0), "{ctx}: {kind} total {total}, stages {sum}");
    }
}

/// Llama (f32 K/V), Qwen2 (Q/K/V biases, f16 K/V) and Qwen3 (per-head Q/K norms, wider heads)
/// files, and MoE files (Mixtral-style, OLMoE, Qwen2-MoE): a prompt of more than two chunks
/// (chunks of 16, 20 or 24 tokens, crossing chunk and page boundaries and the products' groups
/// of 8 tokens) prefilled in chunks gives the last token's logits of feeding it one token per
/// forward pass (`prefill`), or every token's (`prefill_logits`), and the decode steps after it
/// agree too (the pool holds every prompt token at its position).
#[test]
fn chunked_prefill_equals_token_by_token() {
    let rt = rt();
    // (architecture, K/V, experts): dense files, then MoE files (Mixtral-style, OLMoE's gating,
    // Qwen2-MoE's shared expert), whose experts run over the whole chunk.
    let cases = [
        (Arch::Llama, KvDtype::F32, 0, 16),
        (Arch::Qwen2, KvDtype::F16, 0, 20),
        (Arch::Qwen3, KvDtype::F32, 0, 24),
        (Arch::Llama, KvDtype::F16, 8, 16),
        (Arch::Olmoe, KvDtype::F32, 8, 20),
        (Arch::Qwen2Moe, KvDtype::F32, 8, 24),
    ];
    for seed in seeds("model_prefill", cases.len() as u64) {
        let (arch, dtype, experts, chunk) = pick(seed, &cases);
        let mut rng = Rng::new(seed);
        let head_dim = (arch == Arch::Qwen3).then_some(64);
        let base = if experts > 0 { SyntheticModel::moe(seed, experts, 2) } else { SyntheticModel::dense(seed) };
        let spec = SyntheticModel { arch, untied_output: true, heads: 4, kv_heads: 2, head_dim, context: 256, ..base }
            .with_weights(GgmlType::Q8_0);
        let file = spec.gguf();
        let g = Gguf::parse(&file).expect("gguf");
        let n = 2 * chunk + 3 + rng.below(7);
        let ids: Vec<u32> = (0..n).map(|_| rng.below(256)).collect();
        let ctx = format!("seed {seed}: {arch:?} {dtype:?}, {experts} experts, {n} prompt tokens in chunks of {chunk}");
        let opts = ModelOptions::new(1, 200).dtype(dtype).prefill_chunk(chunk);
        let mut one = pollster::block_on(GpuLlama::load(rt, &g, opts.clone())).expect("load");
        let want: Vec<Vec<f32>> = ids.iter().map(|&t| pollster::block_on(one.forward(rt, &[t])).expect("forward")).collect();
        let mut chunked = pollster::block_on(GpuLlama::load(rt, &g, opts)).expect("load");
        assert_eq!(chunked.chunked_prefill_refusal(), None, "{ctx}");
        // The chunked model's prefill and decode steps are timed stage by stage: the timestamps
        // between passes change nothing computed.
        let wanted = wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS;
        assert_eq!(chunked.time_stages(rt), rt.device.features().contains(wanted), "{ctx}");
        // Every other case asks for every token's logits (`prefill_logits`), the rest for the
        // last token's.
        let every = pick(seed, &[true, false]);
        let got = if every {
            pollster::block_on(chunked.prefill_logits(rt, 0, &ids)).expect("prefill_logits")
        } else {
            pollster::block_on(chunked.prefill(rt, 0, &ids)).expect("prefill")
        };
        assert_eq!(chunked.positions, vec![n], "{ctx}");
        // The products sum in another order than the decode step's (tiled, a fixed order over
        // the columns, against a tree): f32 rounding, which f16 K/V round again (2^-11).
        let tol = if dtype == KvDtype::F16 { 5e-4 } else { 1e-4 };
        let rows: Vec<&[f32]> = if every { got.chunks(want[0].len()).collect() } else { vec![&got] };
        let wanted_rows = &want[want.len() - rows.len()..];
        assert_eq!(rows.len(), wanted_rows.len(), "{ctx}: every={every}");
        for (p, (g, w)) in rows.iter().zip(wanted_rows).enumerate() {
            assert!(max_rel(g, w) <= tol, "{ctx}: every={every}: prefill logits {p} differ by {} of their scale", max_rel(g, w));
        }
        assert!(chunked.dispatches_per_step() > 0, "{ctx}");
        for step in 0..3 {
            let t = rng.below(256);
            let (a, b) = (pollster::block_on(one.forward(rt, &[t])).expect("a"), pollster::block_on(chunked.forward(rt, &[t])).expect("b"));
            assert!(max_rel(&b, &a) <= tol, "{ctx}: decode step {step} after the prefill differs by {}", max_rel(&b, &a));
        }
        // The experts chosen in the prefill count as a decode step's do.
        assert_eq!(chunked.expert_counts(), one.expert_counts(), "{ctx}: expert counts");
        let total: u64 = chunked.expert_counts().iter().sum();
        assert_eq!(total, if experts > 0 { u64::from((n + 3) * 2 * 2) } else { 0 }, "{ctx}: every choice counted");
        check_stage_times(&chunked.stage_times(), n.div_ceil(chunk), 3, experts > 0, rt.device.features().contains(wanted), &ctx);
    }
    // Where a policy acts between tokens, chunked prefill is refused by name, before any work;
    // so are chunks of no tokens or of more than MAX_PREFILL_CHUNK, at load.
    let file = SyntheticModel::dense(1).gguf();
    let g = Gguf::parse(&file).expect("gguf");
    for chunk in [0, MAX_PREFILL_CHUNK + 1] {
        let e = pollster::block_on(GpuLlama::load(rt, &g, ModelOptions::new(1, 64).prefill_chunk(chunk))).err().expect("refused");
        assert!(e.to_string().contains("prefill_chunk") && e.to_string().contains(&MAX_PREFILL_CHUNK.to_string()), "{e}");
    }
    let opts = ModelOptions::new(1, 64).scheduler(Some((SchedulerConfig::H2o { sinks: 2, window: 4 }, 16)));
    let mut m = pollster::block_on(GpuLlama::load(rt, &g, opts)).expect("load");
    let e = pollster::block_on(m.prefill(rt, 0, &[1, 2, 3])).expect_err("refused");
    assert!(e.to_string().contains("a scheduler acts after every token"), "{e}");
    assert_eq!(m.positions, vec![0]);
}
