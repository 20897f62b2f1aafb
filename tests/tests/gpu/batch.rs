//! Continuous batching (`expertkv_model::batch`): prompts decoded several at a time, a finished
//! sequence's pages freed and the next prompt taking its place, each prompt's tokens equal to
//! its decoding alone.

use expertkv_core::config::KvDtype;
use expertkv_core::evict::config::SchedulerConfig;
use expertkv_model::SyntheticModel;
use expertkv_model::batch::BatchDecoder;
use expertkv_model::forward::{GpuLlama, ModelOptions};
use expertkv_model::gguf::{GgmlType, Gguf};
use expertkv_model::text::{GenerateOptions, TextModel};
use expertkv_model::tokenizer::Tokenizer;

use crate::common::{rt, seeds};

/// Prompts of different lengths (so sequences finish at different steps and new ones join
/// mid-batch), three at a time, prefilled in chunks where allowed: every prompt's greedy tokens
/// equal a one-sequence run's, with
/// f32 K/V, under H2O eviction over f16 K/V (budgets per sequence), and on a MoE file; the pool is
/// empty once the batch is done, and a batch of one decodes the same (f32 K/V).
#[test]
fn batched_prompts_decode_as_each_alone() {
    let rt = rt();
    let seed = seeds("model_batch", 1)[0];
    let dense = SyntheticModel { untied_output: true, ..SyntheticModel::dense(seed) }.with_weights(GgmlType::Q8_0).gguf();
    let moe = SyntheticModel { untied_output: true, ..SyntheticModel::moe(seed, 8, 2) }.with_weights(GgmlType::Q8_0).gguf();
    let prompts: Vec<String> =
        ["hello there", "the heart is", "a much longer prompt than the others", "xyz", "q"].map(String::from).to_vec();
    let h2o = Some((SchedulerConfig::H2o { sinks: 2, window: 4 }, 16));
    let cases: Vec<(&str, &[u8], ModelOptions)> = vec![
        ("f32", &dense, ModelOptions::new(1, 64).dtype(KvDtype::F32)),
        ("h2o", &dense, ModelOptions::new(1, 64).scheduler(h2o)),
        ("moe file", &moe, ModelOptions::new(1, 64)),
    ];
    let max_tokens = 7;
    for (name, file, opts) in cases {
        let ctx = format!("seed {seed}, {name}");
        let g = Gguf::parse(file).expect("gguf");
        let tok = Tokenizer::from_gguf(&g).expect("tokenizer");
        // Each prompt alone, through the one-sequence text API.
        let alone: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                let mut tm = pollster::block_on(TextModel::load(rt, file, opts.clone())).expect("load");
                let go = GenerateOptions { max_tokens, stop_at_eos: true };
                pollster::block_on(tm.generate(rt, p, &go, |_| true)).expect("generate").tokens
            })
            .collect();
        // A batch of one too, on the first file.
        let batches: &[u32] = if name == "f32" { &[3, 1] } else { &[3] };
        for &batch in batches {
            let mut m = pollster::block_on(GpuLlama::load(rt, &g, ModelOptions { n_seqs: batch, ..opts.clone() })).expect("load");
            let mut order = Vec::new();
            let (done, stats) = {
                let mut dec = BatchDecoder::new(&mut m, &tok, max_tokens).expect("decoder");
                pollster::block_on(dec.run(rt, &prompts, |c| order.push(c.prompt))).expect("batch")
            };
            assert_eq!(done.len(), prompts.len(), "{ctx}, batch {batch}");
            for (c, want) in done.iter().zip(&alone) {
                assert_eq!(&c.generated_ids, want, "{ctx}, batch {batch}: prompt {} ({:?})", c.prompt, prompts[c.prompt]);
                assert!(c.slot < batch, "{ctx}");
            }
            let fed: u64 = done.iter().map(|c| (c.prompt_ids.len() + c.generated_ids.len() - 1) as u64).sum();
            assert_eq!(stats.prompt_tokens + stats.generated_tokens - prompts.len() as u64, fed, "{ctx}, batch {batch}: tokens counted");
            if batch > 1 {
                // Sequences finished at different steps and the waiting prompts joined then.
                assert!(done.iter().any(|c| c.steps.0 > 0), "{ctx}: no prompt joined mid-batch: {done:?}");
                assert!(stats.steps < fed, "{ctx}: {} steps for {fed} tokens: not batched", stats.steps);
            }
            // Joining prompts are prefilled in chunks (all but their last token) where no policy
            // acts between tokens; else token by token, and then the short ones finish first.
            let chunked = m.chunked_prefill_refusal().is_none();
            let long = prompts.iter().filter(|p| p.len() > 2).count() as u64;
            assert_eq!(stats.prefill_passes, if chunked { long } else { 0 }, "{ctx}, batch {batch}");
            if batch > 1 && !chunked {
                assert_ne!(order, (0..prompts.len()).collect::<Vec<_>>(), "{ctx}: finishing order is prompt order");
            }
            let ctl = pollster::block_on(m.kv.pool.read_ctl(rt)).expect("ctl");
            assert_eq!(ctl.free_top, m.kv.pool.cfg.n_pages, "{ctx}, batch {batch}: pages still held after the batch");
            assert!(m.positions.iter().all(|&p| p == 0), "{ctx}: positions {:?}", m.positions);
        }
    }
    // A prompt that cannot fit is refused by its index before any step.
    let g = Gguf::parse(&dense).expect("gguf");
    let tok = Tokenizer::from_gguf(&g).expect("tokenizer");
    let mut m = pollster::block_on(GpuLlama::load(rt, &g, ModelOptions::new(2, 16))).expect("load");
    let mut dec = BatchDecoder::new(&mut m, &tok, 8).expect("decoder");
    let e = pollster::block_on(dec.run(rt, &["ok".into(), "far too long for sixteen".into()], |_| {})).expect_err("too long");
    assert!(e.to_string().contains("prompt 1"), "{e}");
}
