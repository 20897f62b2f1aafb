#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The command line end to end on whatever adapter the machine has (lavapipe in CI), at small
//! sizes: a sweep with a codec table, metrics files, a recorded trace replayed (and a damaged
//! one refused), the planner.

use std::path::PathBuf;
use std::process::{Command, Output};

use expertkv_tests::skip;

fn expertkv(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_expertkv")).args(args).output().expect("running expertkv")
}

fn ok(args: &[&str]) -> String {
    let o = expertkv(args);
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "expertkv {args:?} failed:\n{text}");
    text
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("expertkv-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

const SMALL: &[&str] = &["--seqs", "2", "--layers", "2", "--prompt", "64", "--steps", "2"];

#[test]
fn sweep_prints_the_scheduler_and_codec_tables() {
    let dir = tmp("plots");
    let mut args =
        vec!["sweep", "--schedulers", "h2o,quest,none", "--budgets", "50%", "--codecs", "none,int4", "--plot", dir.to_str().expect("path")];
    args.extend(SMALL);
    let out = ok(&args);
    assert!(out.contains("| topk | h2o | 50% | none |"), "{out}");
    assert!(out.contains("| topk | quest | 50% | none |"), "QUEST's row missing:\n{out}");
    assert!(out.contains("| int4:group=32 |"), "codec table missing:\n{out}");
    for name in ["quality_vs_bytes.png", "quality_vs_time.png"] {
        let png = std::fs::read(dir.join(name)).expect("plot written");
        assert!(png.len() > 10_000 && png.starts_with(b"\x89PNG\r\n\x1a\n"), "{name}: {} bytes", png.len());
    }
}

#[test]
fn demo_writes_metrics_and_a_trace_that_replays() {
    let (csv, trace) = (tmp("m.csv"), tmp("t.ekv"));
    let mut args = vec!["record", "--out", trace.to_str().expect("path"), "--metrics", csv.to_str().expect("path"), "--no-verify"];
    args.extend(SMALL);
    ok(&args);
    let metrics = std::fs::read_to_string(&csv).expect("metrics");
    let lines: Vec<&str> = metrics.lines().collect();
    assert_eq!(lines.len(), 3, "header and two steps:\n{metrics}");
    assert!(lines.iter().all(|l| l.split(',').count() == lines[0].split(',').count()));
    let out = ok(&["replay", trace.to_str().expect("path")]);
    assert!(out.contains("all 2 steps x 2 layers match the trace"), "{out}");
    let summary = ok(&["replay", "--summary", trace.to_str().expect("path")]);
    assert!(summary.contains("pages read"), "{summary}");
    // A damaged trace is refused with the line it broke on, not a panic.
    let text = std::fs::read_to_string(&trace).expect("trace");
    let damaged = tmp("damaged.ekv");
    std::fs::write(&damaged, text.replacen("\"layer\":1", "\"layer\":7", 1)).expect("write");
    let o = expertkv(&["replay", damaged.to_str().expect("path")]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("trace line 3") && !err.contains("panicked"), "{err}");
    // A run that stopped mid-step (its last record torn): refused as it is, replayed up to its
    // last whole step with --partial.
    let cut = tmp("cut.ekv");
    let lines: Vec<&str> = text.lines().collect();
    std::fs::write(&cut, format!("{}\n{}", lines[..4].join("\n"), &lines[4][..lines[4].len() / 2])).expect("write");
    let o = expertkv(&["replay", cut.to_str().expect("path")]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--partial") && !err.contains("panicked"), "{err}");
    let out = ok(&["replay", "--partial", cut.to_str().expect("path")]);
    assert!(out.contains("holds 1 whole step of its 2") && out.contains("all 1 steps x 2 layers match the trace"), "{out}");
}

/// A recording killed mid-run (SIGKILL, no chance to flush): the trace and the metrics written
/// through step by step keep every finished step, `replay --partial` replays them, and every
/// metrics row but perhaps the last is whole.
#[test]
fn a_killed_recording_keeps_its_whole_steps() {
    let (csv, trace) = (tmp("killed.csv"), tmp("killed.ekv"));
    let mut args = vec!["record", "--out", trace.to_str().expect("path"), "--metrics", csv.to_str().expect("path"), "--no-verify"];
    args.extend(["--seqs", "2", "--layers", "2", "--prompt", "64", "--steps", "100000"]);
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_expertkv"))
        .args(&args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn record");
    // Wait for a few steps' records (a header line, then 2 layers a step), then kill.
    let t0 = std::time::Instant::now();
    while std::fs::read_to_string(&trace).map_or(0, |t| t.lines().count()) < 1 + 2 * 3 {
        assert!(t0.elapsed().as_secs() < 120, "the recording wrote no steps in 120 s");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().expect("kill");
    child.wait().expect("wait");
    // Written through at every step's end: whole lines, whole steps (2 records each).
    let text = std::fs::read_to_string(&trace).expect("trace");
    let records = text.lines().count() - 1;
    assert!(text.ends_with('\n') && records.is_multiple_of(2), "the trace ends mid-step: {records} records");
    let out = ok(&["replay", "--partial", trace.to_str().expect("path")]);
    assert!(out.contains("whole step") && out.contains("match the trace"), "{out}");
    let metrics = std::fs::read_to_string(&csv).expect("metrics");
    let lines: Vec<&str> = metrics.lines().collect();
    let cols = lines[0].split(',').count();
    let whole = lines.iter().filter(|l| l.split(',').count() == cols).count();
    assert!(whole >= 3 && whole + 1 >= lines.len(), "header and steps, at most the last torn:\n{metrics}");
    // The metrics row of a step is written just before its trace records.
    assert!((whole - 1).abs_diff(records / 2) <= 1, "{} metrics rows, {} trace steps", whole - 1, records / 2);
}

#[test]
fn plan_predicts_and_chooses() {
    let mut args = vec!["plan", "--quick", "--target-mib", "1", "--budgets", "100%,25%", "--codecs", "none,int8"];
    args.extend(["--seqs", "2", "--layers", "2", "--prompt", "512", "--steps", "2"]);
    let out = ok(&args);
    assert!(out.contains("measured: copy") && out.contains("PiKV buffer rule"), "{out}");
    // 2 x 2 x 4 heads x 514 tokens x 256 B = 2 MiB in f16: only the 25% budget fits in 1 MiB.
    assert!(out.contains("plan: codec none at budget 25%"), "{out}");
}

/// `eval` per scheduler and per MoEfication on a dense file (a synthetic one in llama.cpp's
/// layout with Q4_1 matrices; the trained model's quality is checked in the GPU tests).
#[test]
fn eval_scores_a_model_per_scheduler() {
    use expertkv_model::SyntheticModel;
    use expertkv_model::gguf::GgmlType;
    let path = tmp("eval-dense.gguf");
    std::fs::write(&path, SyntheticModel::dense(9).with_weights(GgmlType::Q4_1).gguf()).expect("write the model");
    let model = path.to_str().expect("utf-8 path");
    let plots = tmp("eval_plots");
    let out = ok(&[
        "eval",
        "--model",
        model,
        "--tokens",
        "20",
        "--schedulers",
        "h2o:sinks=2,window=2",
        "--budgets",
        "80%",
        "--needle-filler",
        "0",
        "--moe",
        "4:4",
        "--moe-routers",
        "topk",
        "--json",
        "--plot",
        plots.to_str().expect("utf-8 path"),
    ]);
    let rows: Vec<serde_json::Value> =
        out.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).expect("json row")).collect();
    // Every source crossed with every policy: dense and E4 k4, each full and under H2O; then
    // the pipeline's router choosing the MoEfied FFN's experts.
    assert_eq!(rows.len(), 5, "{out}");
    let (full, h2o, moe, moe_h2o, routed) = (&rows[0], &rows[1], &rows[2], &rows[3], &rows[4]);
    assert_eq!((moe_h2o["ffn"].as_str(), moe_h2o["scheduler"].as_str()), (Some("E4 k4"), Some("h2o")), "{out}");
    assert!(moe_h2o["label_miss_rate"].as_f64().is_some_and(|m| m > 0.0), "H2O evicted labelled tokens: {out}");
    // The pipeline's topk router over all four experts chooses what the plain top k does.
    assert_eq!(routed["ffn"], "E4 k4 topk");
    assert_eq!(routed["perplexity"], moe["perplexity"], "{out}");
    assert_eq!(moe["busiest_expert"], 0.25, "k = E: every expert takes a quarter of the slots");
    assert!(full["busiest_expert"].is_null());
    assert_eq!(full["ffn"], "dense");
    // Every expert chosen (k = E) is the dense FFN up to summation order.
    assert_eq!(moe["ffn"], "E4 k4");
    let moe_ppl = moe["perplexity"].as_f64().expect("perplexity");
    assert_eq!(full["scheduler"], "none");
    assert_eq!(full["greedy_agreement"], 1.0);
    let ppl = full["perplexity"].as_f64().expect("perplexity");
    assert!(ppl.is_finite() && ppl > 1.0, "{ppl}");
    assert!((moe_ppl - ppl).abs() <= 0.01 * ppl, "k = E: {moe_ppl} against dense {ppl}");
    assert!(moe["greedy_agreement"].as_f64().expect("agreement") > 0.9, "{out}");
    assert!(h2o["perplexity"].as_f64().expect("perplexity").is_finite());
    assert_eq!((h2o["budget"].as_u64(), h2o["budget_spec"].as_str()), (Some(16), Some("80%")), "80% of 20 tokens: {out}");
    assert!(h2o["kv_bytes"].as_u64() < full["kv_bytes"].as_u64(), "H2O at 16 of 20 tokens holds fewer pages: {out}");
    assert!(plots.join("perplexity_vs_bytes.png").metadata().expect("plot written").len() > 1000);
    // A MoEfication that cannot be is refused by name.
    let o = expertkv(&["eval", "--model", model, "--moe", "2:3"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--moe") && !err.contains("panicked"), "{err}");
    // The retrieval checks, each row's: a fact at each depth, two in one context, the two-turn
    // question, under the full cache and H2O. A random model finds nothing, so every check
    // reports its answers and the row says missed (the cases' layout is unit-tested in
    // eval/retrieval.rs; whether a trained model finds them is BENCHMARKS.md's).
    let out = ok(&[
        "eval",
        "--model",
        model,
        "--tokens",
        "8",
        "--schedulers",
        "h2o:sinks=2,window=2",
        "--budgets",
        "16",
        "--needle-filler",
        "24",
        "--needle-depth",
        "10%,90%",
        "--needles",
        "2",
        "--json",
    ]);
    let rows: Vec<serde_json::Value> = out.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).expect("json")).collect();
    assert_eq!(rows.len(), 2, "{out}");
    for r in &rows {
        let cases: Vec<&str> = r["needles"].as_array().expect("needles").iter().map(|n| n["case"].as_str().unwrap_or("")).collect();
        assert_eq!(cases, ["depth 10%", "depth 90%", "2 needles", "2 turns, depth 90%"], "{r}");
        let found: Vec<bool> = r["needles"].as_array().expect("needles").iter().map(|n| n["found"].as_bool().expect("found")).collect();
        assert_eq!(r["needle_found"].as_bool(), Some(found.iter().all(|&f| f)), "{r}");
        // One answer a question: the two-needle check asks twice, the two-turn check once.
        let answers: Vec<usize> =
            r["needles"].as_array().expect("needles").iter().map(|n| n["answers"].as_array().map_or(0, Vec::len)).collect();
        assert_eq!(answers, [1, 1, 2, 1], "{r}");
    }
    for (args, why) in [(&["--needle-depth", "150%"][..], "--needle-depth"), (&["--needles", "9"][..], "--needles 9")] {
        let o = expertkv(&[&["eval", "--model", model, "--tokens", "8", "--schedulers", "none"][..], args].concat());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(why) && !err.contains("panicked"), "{args:?}: {err}");
    }
}

/// A Mixture-of-Experts GGUF (a random one: no MoE file ships offline) through `run` and `eval`:
/// its own experts and router from the start, the pipeline's routers over them, and MoEfication
/// refused by name.
#[test]
fn run_and_eval_a_moe_file_with_its_own_experts() {
    use expertkv_model::SyntheticModel;
    let path = tmp("moe.gguf");
    std::fs::write(&path, SyntheticModel::moe(3, 8, 2).gguf()).expect("write the model");
    let model = path.to_str().expect("utf-8 path");
    let out = ok(&["run", "--model", model, "--prompt", "Hello", "--tokens", "4", "--dtype", "f32", "--json"]);
    assert!(out.contains("8 experts of 96, top-2 softmax-weighted"), "{out}");
    assert!(out.contains("routing: the busiest expert"), "{out}");
    // --json: the last line, with the prompt's and the generated ids (byte tokens here).
    let j: serde_json::Value = serde_json::from_str(out.lines().last().unwrap_or_default()).expect("a JSON last line");
    assert_eq!(j["prompt_ids"], serde_json::json!([72, 101, 108, 108, 111]), "{j}");
    assert_eq!(j["generated_ids"].as_array().map(Vec::len), Some(4), "{j}");
    assert!(j["kv_bytes_in_use"].as_u64().is_some_and(|b| b > 0), "{j}");
    assert!(j["expert_cache"].is_null() && j["tpot_ms_p50"].as_f64().is_some_and(|t| t > 0.0), "{j}");
    // Its experts in a GPU cache of 2 slots per layer (25% of 8): the same tokens, the traffic
    // reported; fewer slots than a step needs is refused with the minimum.
    let out = ok(&["run", "--model", model, "--prompt", "Hello", "--tokens", "4", "--dtype", "f32", "--json", "--expert-slots", "25%"]);
    assert!(out.contains("experts: 2 of 8 slots per layer on the GPU"), "{out}");
    let c: serde_json::Value = serde_json::from_str(out.lines().last().unwrap_or_default()).expect("a JSON last line");
    assert_eq!(c["generated_ids"], j["generated_ids"], "{out}");
    let ec = &c["expert_cache"];
    assert_eq!((ec["slots_per_layer"].as_u64(), ec["policy"].as_str()), (Some(2), Some("lru")), "{ec}");
    assert!(ec["misses"].as_u64().is_some_and(|m| m >= 4) && ec["bytes_moved"].as_u64().is_some_and(|b| b > 0), "{ec}");
    assert_eq!(ec["gpu_bytes"].as_u64().map(|g| g * 4), ec["host_bytes"].as_u64(), "{ec}");
    // The run's reuse curve gives its LRU cache's hits at its own size (2 slots: index 1).
    let reuse = &c["expert_reuse"];
    assert_eq!(reuse["lru_hits_by_slots"][1], ec["hits"], "{reuse} {ec}");
    assert_eq!(reuse["references"].as_u64(), Some(ec["hits"].as_u64().unwrap_or(0) + ec["misses"].as_u64().unwrap_or(0)), "{reuse}");
    assert!(out.contains("expert reuse (decode steps' routing"), "{out}");
    let o = expertkv(&["run", "--model", model, "--tokens", "2", "--expert-slots", "1"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("at least 2") && !err.contains("panicked"), "{err}");
    // The file mapped instead of read: the same tokens.
    let out =
        ok(&["run", "--model", model, "--prompt", "Hello", "--tokens", "4", "--dtype", "f32", "--json", "--expert-slots", "25%", "--mmap"]);
    let m: serde_json::Value = serde_json::from_str(out.lines().last().unwrap_or_default()).expect("a JSON last line");
    assert_eq!(m["generated_ids"], j["generated_ids"], "{out}");
    // Pre-gating prefetch under the score policy: the same tokens, the prefetch reported.
    let prefetch = ["--expert-slots", "25%", "--expert-prefetch", "pregate", "--expert-policy", "score"];
    let out = ok(&[&["run", "--model", model, "--prompt", "Hello", "--tokens", "4", "--dtype", "f32", "--json"][..], &prefetch].concat());
    assert!(out.contains("prefetch (pregate):"), "{out}");
    let p: serde_json::Value = serde_json::from_str(out.lines().last().unwrap_or_default()).expect("a JSON last line");
    assert_eq!(p["generated_ids"], j["generated_ids"], "{out}");
    let ec = &p["expert_cache"];
    assert_eq!((ec["prefetch"].as_str(), ec["policy"].as_str()), (Some("pregate"), Some("score")), "{ec}");
    assert!(ec["prefetched"].as_u64().is_some_and(|n| n > 0), "{ec}");
    // Prefetch without a cache to fetch into is refused by name.
    let o = expertkv(&["run", "--model", model, "--tokens", "2", "--expert-prefetch", "pregate"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--expert-slots or --gpu-mem") && !err.contains("panicked"), "{err}");
    // Key bounds for a recall tier that is not there: refused by name, in run and eval.
    for cmd in ["run", "eval"] {
        let o = expertkv(&[cmd, "--model", model, "--tokens", "2", "--recall-bounds", "8"]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains("give --recall PAGES too") && !err.contains("panicked"), "{cmd}: {err}");
    }
    let out = ok(&["run", "--model", model, "--prompt", "Hello", "--tokens", "4", "--router", "load-balance"]);
    assert!(out.contains("router: load-balance over the file's own experts"), "{out}");
    // eval's rows for the file's own router and the pipeline's, with `extra` flags.
    let eval = |routers: &str, extra: &[&str]| -> (String, Vec<serde_json::Value>) {
        let base = ["eval", "--model", model, "--tokens", "24", "--needle-filler", "0", "--schedulers", "none", "--json"];
        let out = ok(&[&base[..], &["--moe-routers", routers], extra].concat());
        let rows = out.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).expect("json row")).collect();
        (out, rows)
    };
    let (out, rows) = eval("topk,hash", &[]);
    assert_eq!(rows.len(), 3, "{out}");
    assert_eq!(
        (rows[0]["ffn"].as_str(), rows[1]["ffn"].as_str(), rows[2]["ffn"].as_str()),
        (Some("own E8 k2"), Some("own E8 k2 topk"), Some("own E8 k2 hash"))
    );
    assert_eq!(rows[1]["perplexity"], rows[0]["perplexity"], "the pipeline's top-k chooses as the file's router: {out}");
    assert_ne!(rows[2]["perplexity"], rows[0]["perplexity"], "hash routing chooses other experts: {out}");
    // eval with the experts in a cache: the same perplexity, the cache's traffic per row (not
    // the routed rows', whose pipeline router a cache does not take).
    let (cached, crows) = eval("topk", &["--expert-slots", "2", "--expert-policy", "score"]);
    assert_eq!(crows.len(), 2, "{cached}");
    assert_eq!(crows[0]["perplexity"], rows[0]["perplexity"], "{cached}");
    assert!(crows[0]["expert_hit_rate"].as_f64().is_some_and(|h| h > 0.0 && h < 1.0), "{cached}");
    assert!(crows[0]["expert_mb_per_token"].as_f64().is_some_and(|b| b > 0.0), "{cached}");
    assert!(crows[1]["expert_hit_rate"].is_null() && crows[1]["perplexity"] == rows[1]["perplexity"], "{cached}");
    for args in [&["run", "--model", model, "--moe", "4:2"][..], &["eval", "--model", model, "--moe", "4:2"][..]] {
        let o = expertkv(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains("MoE file with 8 experts") && !err.contains("panicked"), "{args:?}: {err}");
    }
}

/// MoEfication is made once and cached: the second run loads it, a damaged cache is replaced
/// with a note, and the run goes on.
#[test]
fn moefication_is_cached_and_a_damaged_cache_replaced() {
    use expertkv_model::SyntheticModel;
    let path = tmp("dense.gguf");
    std::fs::write(&path, SyntheticModel::dense(5).gguf()).expect("write the model");
    let cache = tmp("moe-cache");
    let _ = std::fs::remove_dir_all(&cache);
    let run = || {
        let o = Command::new(env!("CARGO_BIN_EXE_expertkv"))
            .args(["run", "--model", path.to_str().expect("utf-8 path"), "--prompt", "Hi", "--tokens", "2", "--moe", "4:2:fitted"])
            .env("EXPERTKV_CACHE_DIR", &cache)
            .output()
            .expect("running expertkv");
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "{text}");
        text
    };
    let first = run();
    assert!(first.contains("clustered and routers fitted") && first.contains("cached in"), "{first}");
    let second = run();
    assert!(second.contains("loaded from the cache"), "{second}");
    let entries: Vec<_> = std::fs::read_dir(&cache).expect("the cache folder").map(|e| e.expect("entry").path()).collect();
    assert_eq!(entries.len(), 1, "{entries:?}");
    std::fs::write(&entries[0], b"EKVMOE1\ngarbage").expect("damage the cache");
    let third = run();
    assert!(third.contains("was unusable") && third.contains("truncated") && third.contains("cached in"), "{third}");
    assert!(run().contains("loaded from the cache"));
}

/// `moefy` writes a dense model's MoEfication as a MoE file that `run` decodes with its experts
/// weighing 1, through the expert cache too; what it cannot write is refused by name, and the
/// model is never overwritten.
#[test]
fn moefy_writes_a_moe_file_run_decodes_through_the_expert_cache() {
    let dense = tmp("moefy-dense.gguf");
    let d = dense.to_str().expect("utf-8 path");
    ok(&["synth", "--out", d, "--experts", "0", "--layers", "2", "--ffn", "128", "--weights", "q8_0", "--untied-output"]);
    let moe = tmp("moefy-moe.gguf");
    let m = moe.to_str().expect("utf-8 path");
    let out = ok(&["moefy", "--model", d, "--moe", "4:2", "--out", m]);
    assert!(out.contains("2 layers x 4 experts of 32 neurons, top 2, experts weigh 1") && out.contains("down as f16"), "{out}");
    let out = ok(&["run", "--model", m, "--prompt", "Hi", "--tokens", "3", "--expert-slots", "2", "--json"]);
    assert!(out.contains("4 experts of 32, top-2 each weighing 1 (MoEfied)"), "{out}");
    let summary: serde_json::Value = out.lines().rev().find_map(|l| serde_json::from_str(l).ok()).expect("a JSON line");
    let experts = &summary["expert_cache"];
    assert!(experts["misses"].as_u64() > Some(0), "{out}");
    let before = std::fs::read(&dense).expect("the model");
    for (args, needle) in [
        (&["--model", m, "--out", d][..], "already a MoE file"),
        (&["--model", d, "--moe", "3:1", "--out", m][..], "do not split into 3 experts"),
        (&["--model", d, "--moe", "8:2", "--down", "q8_0", "--out", m][..], "not whole blocks of 32 (give --down f16)"),
        (&["--model", d, "--down", "q4_0", "--out", m][..], "expected q8_0, f16 or f32"),
        (&["--model", d, "--moe", "dense", "--out", m][..], "give the experts to split into"),
        (&["--model", d, "--moe", "4:2", "--out", d][..], "is the model itself"),
    ] {
        let o = expertkv(&[&["moefy"][..], args].concat());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(needle) && !err.contains("panicked"), "{args:?}: {err}");
    }
    assert!(std::fs::read(&dense).expect("the model") == before, "a refused moefy changed the model");
    let out = ok(&["moefy", "--model", d, "--moe", "4:2", "--down", "q8_0", "--out", m]);
    assert!(out.contains("down as q8_0"), "{out}");
}

/// `synth` writes a random MoE file `run` decodes, and refuses impossible shapes by name.
#[test]
fn synth_writes_a_model_run_decodes() {
    let path = tmp("synth.gguf");
    let p = path.to_str().expect("utf-8 path");
    let out = ok(&["synth", "--out", p, "--experts", "4", "--top-k", "1", "--layers", "1", "--ffn", "64"]);
    assert!(out.contains("4 experts of 64, top-1"), "{out}");
    let out = ok(&["run", "--model", p, "--prompt", "Hi", "--tokens", "2"]);
    assert!(out.contains("4 experts of 64, top-1 softmax-weighted"), "{out}");
    // The other MoE architectures, in llama.cpp's names: OLMoE's and Qwen2-MoE's gating, and
    // Qwen2-MoE's shared expert (twice an expert's size in synth's files).
    for (arch, want) in [
        ("olmoe", "(olmoe, 1 layers"),
        ("olmoe", "4 experts of 64, top-1 weighted by their share of the softmax"),
        ("qwen2moe", "4 experts of 64, top-1 weighted by their share of the softmax, a shared expert of 128"),
    ] {
        ok(&["synth", "--out", p, "--arch", arch, "--experts", "4", "--top-k", "1", "--layers", "1", "--ffn", "64"]);
        let out = ok(&["run", "--model", p, "--prompt", "Hi", "--tokens", "2"]);
        assert!(out.contains(want), "{arch}: {out}");
    }
    // Several prompts, two sequences at a time: a JSON line per completion as each finishes,
    // then the run's figures; the batch's misuses named.
    let prompts = tmp("prompts.txt");
    std::fs::write(&prompts, "Hi\n\nthe heart is\nxyz q\n").expect("write the prompts");
    let pf = prompts.to_str().expect("utf-8 path");
    let out = ok(&["run", "--model", p, "--prompts", pf, "--batch", "2", "--tokens", "3", "--json"]);
    let lines: Vec<serde_json::Value> = out.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let done: Vec<&serde_json::Value> = lines.iter().filter(|l| l.get("generated_ids").is_some()).collect();
    assert_eq!(done.len(), 3, "{out}");
    assert!(done.iter().all(|c| c["generated_ids"].as_array().map(Vec::len) == Some(3) && c["slot"].as_u64() < Some(2)), "{out}");
    let summary = lines.last().expect("a summary line");
    assert_eq!(
        (summary["batch"].as_u64(), summary["prompts"].as_u64(), summary["kv_pages_in_use_after"].as_u64()),
        (Some(2), Some(3), Some(0)),
        "{out}"
    );
    for (args, needle) in [
        (&["--batch", "2"][..], "--batch 2 decodes the prompts of --prompts FILE"),
        (&["--prompts", pf, "--batch", "65"][..], "--batch 65: expected 1 to 64"),
    ] {
        let o = expertkv(&[&["run", "--model", p][..], args].concat());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(needle) && !err.contains("panicked"), "{args:?}: {err}");
    }
    for (args, needle) in [
        (&["--experts", "4", "--top-k", "5"][..], "--top-k"),
        (&["--hidden", "100"][..], "--hidden"),
        (&["--layers", "0"][..], "--layers"),
        (&["--arch", "gemma2"][..], "expected one of llama, qwen2, qwen3, qwen3moe, olmoe, qwen2moe"),
        (&["--arch", "olmoe", "--experts", "0"][..], "--arch olmoe needs experts"),
        (&["--weights", "q4_k"][..], "--hidden and --ffn must be multiples of 256"),
    ] {
        let o = expertkv(&[&["synth", "--out", p][..], args].concat());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(needle) && !err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn bench_suite_measures_every_line_in_one_process() {
    // Two rounds at the quick shapes: every configuration once per round, the order seeded.
    let out = expertkv(&["bench", "suite", "--quick", "--rounds", "2", "--seed", "5", "--json"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench suite failed:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    assert_eq!(lines[0]["seed"], 5, "{text}");
    assert_eq!(lines[0]["rounds"], 2, "{text}");
    let rows: Vec<&serde_json::Value> = lines[1..].iter().filter(|r| r.get("label").is_some()).collect();
    assert!(lines.iter().any(|l| l["suite_rounds_done"] == 2), "the rounds done are reported: {text}");
    let labels: Vec<&str> = rows.iter().filter_map(|r| r["label"].as_str()).collect();
    for want in [
        "copy 32 MiB",
        "attend f16 p16 b1 x 4096",
        "attend int8:group=32 p64 b2 x 2048",
        "attend int4:group=64 p64 b2 x 2048",
        "route topk t4096 e64 k4",
        "step E8 k2 full cache f16",
        "step E256 k8 h2o 25%",
        "step E8 k2 full cache int8",
    ] {
        assert!(labels.contains(&want), "no line `{want}` in {labels:?}");
    }
    assert_eq!(rows.len(), 1 + 2 * 3 + 1 + 6, "{labels:?}");
    for r in rows {
        let (m, lo, spread) = (r["median_ms"].as_f64().unwrap(), r["min_ms"].as_f64().unwrap(), r["spread"].as_f64().unwrap());
        assert!(m > 0.0 && lo > 0.0 && lo <= m && spread >= 0.0, "{r}");
        assert_eq!(r["rounds"], 2, "{r}");
        assert_eq!(r["unstable"].as_bool().unwrap(), spread > 0.05, "{r}");
    }
}

/// The route stage on a model through `run` and `eval`: a dense file's tokens labelled by a
/// MoEfication's router (the FFN dense), crossed with the route stage's routers under H2O at
/// equal K/V bytes (`--bytes`); each row names its routing source and router; options that
/// need a routing source, or a bytes share too small for the shards, are refused by name.
#[test]
fn eval_crosses_routing_sources_and_routers_at_equal_bytes() {
    use expertkv_model::SyntheticModel;
    let path = tmp("labels.gguf");
    std::fs::write(&path, SyntheticModel::dense(11).gguf()).expect("write the model");
    let model = path.to_str().expect("utf-8 path");
    let out = ok(&[
        "run",
        "--model",
        model,
        "--prompt",
        "Hello there",
        "--tokens",
        "3",
        "--labels",
        "4:2",
        "--shards",
        "2",
        "--kv-router",
        "hash",
    ]);
    assert!(
        out.contains("routing labels: the MoEfication router, labels only (dense FFN)") && out.contains("router hash, 2 shards by expert"),
        "{out}"
    );
    let checked = ok(&[
        "run",
        "--model",
        model,
        "--prompt",
        "Hello there, general",
        "--tokens",
        "8",
        "--labels",
        "4:2",
        "--scheduler",
        "h2o",
        "--budget",
        "16",
        "--allocator",
        "ekva",
        "--verify-evictions",
    ]);
    assert!(checked.contains("every eviction equal to the CPU reference's") && !checked.contains(" 0 token K/V evicted"), "{checked}");
    let out = ok(&[
        "eval",
        "--model",
        model,
        "--tokens",
        "64",
        "--needle-filler",
        "0",
        "--schedulers",
        "h2o:sinks=2,window=4",
        "--bytes",
        "50%",
        "--labels",
        "4:2",
        "--kv-routers",
        "topk,hash",
        "--json",
    ]);
    let rows: Vec<serde_json::Value> =
        out.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).expect("json row")).collect();
    let names: Vec<(String, String, String)> = rows
        .iter()
        .map(|r| {
            (
                r["ffn"].as_str().unwrap_or("").into(),
                r["routing"].as_str().unwrap_or("").into(),
                r["scheduler"].as_str().unwrap_or("").into(),
            )
        })
        .collect();
    let want = [
        ("dense", "-", "none"),
        ("dense", "-", "h2o"),
        ("dense, labels E4 k2", "topk", "none"),
        ("dense, labels E4 k2", "topk", "h2o"),
        ("dense, labels E4 k2", "hash", "h2o"),
    ];
    assert_eq!(names.iter().map(|(a, b, c)| (a.as_str(), b.as_str(), c.as_str())).collect::<Vec<_>>(), want, "{out}");
    // 64 tokens are 4 pages per (layer, KV head): half of them is 2 pages, 32 tokens.
    for r in &rows[1..] {
        if r["scheduler"] == "h2o" {
            assert_eq!((r["budget"].as_u64(), r["bytes_share"].as_str()), (Some(32), Some("50%")), "{out}");
            assert!(r["kv_bytes"].as_u64() <= rows[0]["kv_bytes"].as_u64().map(|b| b / 2), "{out}");
        }
    }
    assert_eq!(rows[2]["label_source"], "the MoEfication router, labels only (dense FFN)");
    // Labels alone leave the dense model's logits: the same perplexity as the dense full cache.
    assert_eq!(rows[2]["perplexity"], rows[0]["perplexity"], "{out}");
    // int4 pages under H2O: every eviction checked against the CPU reference (the compressed
    // pages it touches thawed), and at equal bytes the codec keeps more tokens.
    let checked = ok(&[
        "run",
        "--model",
        model,
        "--prompt",
        "Hello there, general",
        "--tokens",
        "40",
        "--codec",
        "int4",
        "--scheduler",
        "h2o",
        "--budget",
        "20",
        "--verify-evictions",
    ]);
    assert!(checked.contains("every eviction equal to the CPU reference's") && !checked.contains(" 0 token K/V evicted"), "{checked}");
    let out = ok(&[
        "eval",
        "--model",
        model,
        "--tokens",
        "64",
        "--needle-filler",
        "0",
        "--schedulers",
        "h2o:sinks=2,window=4",
        "--bytes",
        "50%",
        "--codecs",
        "int4",
        "--json",
    ]);
    let rows: Vec<serde_json::Value> =
        out.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).expect("json row")).collect();
    let names: Vec<(&str, &str)> =
        rows.iter().map(|r| (r["codec"].as_str().unwrap_or(""), r["scheduler"].as_str().unwrap_or(""))).collect();
    assert_eq!(names, [("none", "none"), ("none", "h2o"), ("int4:group=32", "h2o"), ("int4:group=32", "none")], "{out}");
    let (plain, int4) = (&rows[1], &rows[2]);
    assert!(int4["budget"].as_u64() > plain["budget"].as_u64(), "{out}");
    assert!(int4["kv_bytes"].as_u64() <= rows[0]["kv_bytes"].as_u64().map(|b| b / 2), "{out}");
    for (args, needle) in [
        (&["eval", "--model", model, "--kv-routers", "hash"][..], "routing source"),
        (&["run", "--model", model, "--shards", "2"][..], "routing source"),
        (&["eval", "--model", model, "--tokens", "64", "--labels", "4:2", "--shards", "4", "--bytes", "50%"][..], "--bytes 50%"),
    ] {
        let o = expertkv(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(needle) && !err.contains("panicked"), "{args:?}: {err}");
    }
}

/// `soak` with churn (sequences finishing and joining) under H2O and under a page codec: the
/// pool's invariants checked at every window, and combinations that cannot run refused by name.
#[test]
fn soak_checks_the_pool_under_churn() {
    for extra in
        [&["--scheduler", "h2o"][..], &["--scheduler", "none", "--codec", "int4"][..], &["--scheduler", "h2o", "--codec", "int4"][..]]
    {
        let mut args = vec!["soak", "--steps", "150", "--check-every", "50", "--lengths", "8:40", "--layers", "1", "--json"];
        args.extend(extra);
        let out = ok(&args);
        let rows: Vec<serde_json::Value> =
            out.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).expect("json")).collect();
        assert_eq!(rows.len(), 4, "three windows and the summary: {out}");
        assert!(rows[2]["finished"].as_u64().is_some_and(|f| f >= 8), "sequences finished and were replaced: {out}");
        assert!(rows[3]["summary"].as_str().is_some_and(|s| s.contains("the invariants held at every check")), "{out}");
    }
    let o = expertkv(&["soak", "--steps", "10", "--codec", "low-rank"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--codec low-rank") && !err.contains("panicked"), "{err}");
    // The whole model engine: rounds of random prompts continuously batched under H2O over int4
    // pages, the pool checked every 20 steps and empty after every round.
    let path = tmp("soak-model.gguf");
    std::fs::write(&path, expertkv_model::SyntheticModel { layers: 1, ..expertkv_model::SyntheticModel::dense(5) }.gguf()).expect("write");
    let model = path.to_str().expect("utf-8 path");
    let args = ["soak", "--model", model, "--steps", "60", "--check-every", "20", "--seqs", "3", "--lengths", "6:40", "--budget", "16"];
    let out = ok(&[&args[..], &["--codec", "int4"]].concat());
    assert!(out.contains("the invariants held at every check and the pool was empty after every round"), "{out}");
    assert!(out.lines().filter(|l| l.starts_with("| ") && !l.starts_with("| step")).count() >= 3, "a row per check: {out}");
    // Lengths near the top of the range fit the context (prompt and generated together).
    let out =
        ok(&["soak", "--model", model, "--steps", "30", "--check-every", "15", "--seqs", "2", "--lengths", "30:40", "--budget", "16"]);
    assert!(out.contains("the invariants held at every check"), "{out}");
}

/// `bench upload`: host-to-GPU bandwidth through the queue's `write_buffer` and as a copy from
/// a host-memory buffer (the expert cache's path), the uploaded words checked, a JSON record
/// each beside the copy roofline's; then a copy beside a compute dispatch.
#[test]
fn bench_upload_measures_the_host_to_gpu_path() {
    let out = ok(&["bench", "upload", "--quick", "--json", "--reps", "2"]);
    let mut recs: Vec<serde_json::Value> =
        out.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).expect("json")).collect();
    // Last, the copy beside a compute dispatch on the one queue: four medians above the empty
    // submission's and a finite share hidden (on a CPU adapter the share is the host clock's
    // noise, past 1 on a busy machine: the number lives in BENCHMARKS.md, measured on a GPU).
    let o = recs.pop().expect("the overlap line");
    assert_eq!((o["measure"].as_str(), o["bytes"].as_u64()), (Some("copy_compute_overlap"), Some(32 << 20)), "{out}");
    for k in ["copy_ms", "compute_ms", "copy_then_compute_ms", "compute_then_copy_ms"] {
        assert!(o[k].as_f64().is_some_and(|t| t > 0.0 && t > o["empty_ms"].as_f64().unwrap_or(f64::MAX)), "{k}: {o}");
    }
    assert!(o["hidden"].as_f64().is_some_and(f64::is_finite) && o["flops"].as_u64().is_some_and(|f| f > 0), "{o}");
    assert_eq!(recs.iter().map(|r| r["kernel"].as_str()).collect::<Vec<_>>(), [Some("copy"), Some("upload"), Some("upload")], "{out}");
    assert_eq!(recs[1..].iter().map(|r| r["variant"].as_str()).collect::<Vec<_>>(), [Some("write_buffer"), Some("host_copy")], "{out}");
    for up in &recs[1..] {
        assert_eq!(up["bytes"].as_u64(), Some(32 << 20), "{up}");
        assert!(up["gbps"].as_f64().is_some_and(|g| g.is_finite() && g > 0.0), "{up}");
    }
}

/// `run --kv-store`: a second process given the same prompt fetches the first's full pages
/// instead of prefilling them and generates the same tokens, and so does a prompt of a
/// continuously batched run that joins after its twin was fed; `store stats`, `clear` and
/// `bench` on the same server; FlexGen spilling its host tier to the store gives the tokens of
/// FlexGen alone; an unreachable server and store options without a store are refused by name.
#[test]
fn a_second_process_reuses_the_first_ones_prefix_pages() {
    let Ok(url) = std::env::var("EXPERTKV_REDIS_URL") else {
        return skip(
            "a_second_process_reuses_the_first_ones_prefix_pages",
            "EXPERTKV_REDIS_URL is not set (scripts/test.sh starts a Redis server)",
        );
    };
    let path = tmp("store.gguf");
    let p = path.to_str().expect("utf-8 path");
    ok(&["synth", "--out", p, "--experts", "0", "--layers", "2", "--untied-output", "--seed", "7"]);
    let ns = format!("cli{}", std::process::id());
    ok(&["store", "clear", "--kv-store", &url, "--kv-store-namespace", &ns]);
    let prompt = "the quick brown fox jumps over the lazy dog, twice over";
    let run = || {
        let out =
            ok(&["run", "--model", p, "--prompt", prompt, "--tokens", "4", "--json", "--kv-store", &url, "--kv-store-namespace", &ns]);
        let line = out.lines().rev().find(|l| l.starts_with('{')).expect("json line").to_string();
        (out, serde_json::from_str::<serde_json::Value>(&line).expect("json"))
    };
    let (_, cold) = run();
    let n = cold["prompt_ids"].as_array().expect("ids").len() as u64;
    assert!(n > 32, "{cold}");
    assert_eq!(cold["kv_store"]["tokens_reused"], 0, "{cold}");
    assert_eq!(cold["kv_store"]["pages_stored"].as_u64(), Some(n / 16 * 2), "{cold}");
    let (out, warm) = run();
    assert_eq!(warm["kv_store"]["tokens_reused"].as_u64(), Some((n - 1) / 16 * 16), "{out}");
    assert_eq!(warm["kv_store"]["pages_stored"], 0, "{out}");
    assert_eq!(warm["generated_ids"], cold["generated_ids"], "{out}");
    assert!(out.contains("prompt tokens fetched instead of prefilled"), "{out}");
    // A run whose route stage labels its tokens: refused by name, before any output.
    let o = expertkv(&[
        "run",
        "--model",
        p,
        "--prompt",
        prompt,
        "--tokens",
        "1",
        "--labels",
        "4:2",
        "--kv-store",
        &url,
        "--kv-store-namespace",
        &ns,
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("the route stage labels every token"), "{err}");
    assert!(!String::from_utf8_lossy(&o.stdout).contains(prompt), "the prompt printed before the refusal");
    // A MoEfied run prefills in chunks and keeps its own pages (its keys fold the MoEfication
    // in): it misses the dense run's, then a second process reuses its own.
    let moefied = || {
        let out = ok(&[
            "run",
            "--model",
            p,
            "--prompt",
            prompt,
            "--tokens",
            "2",
            "--json",
            "--moe",
            "4:2",
            "--kv-store",
            &url,
            "--kv-store-namespace",
            &ns,
        ]);
        let line = out.lines().rev().find(|l| l.starts_with('{')).expect("json line").to_string();
        serde_json::from_str::<serde_json::Value>(&line).expect("json")
    };
    let (moe_cold, moe_warm) = (moefied(), moefied());
    assert_eq!((&moe_cold["kv_store"]["tokens_reused"], &moe_cold["prefill_chunked"]), (&0.into(), &true.into()), "{moe_cold}");
    assert_eq!(moe_warm["kv_store"]["tokens_reused"].as_u64(), Some((n - 1) / 16 * 16), "{moe_warm}");
    assert_eq!(moe_warm["generated_ids"], moe_cold["generated_ids"]);
    let stats: serde_json::Value =
        serde_json::from_str(ok(&["store", "stats", "--kv-store", &url, "--kv-store-namespace", &ns, "--json"]).trim()).expect("json");
    assert_eq!(stats["keys"].as_u64(), Some(n / 16 * 4), "{stats}");
    assert_eq!(stats["models"], 2, "{stats}");
    assert!(ok(&["store", "clear", "--kv-store", &url, "--kv-store-namespace", &ns]).contains(&format!("deleted {} keys", n / 16 * 4)));
    // Continuous batching: the third prompt joins once the first has been fed and stored, and
    // reuses its pages; both generate the single run's tokens.
    let prompts = tmp("store_prompts.txt");
    std::fs::write(&prompts, format!("{prompt}\nan unrelated line of text, long enough for two full pages of tokens\n{prompt}\n"))
        .expect("write");
    let out = ok(&[
        "run",
        "--model",
        p,
        "--prompts",
        prompts.to_str().expect("utf-8"),
        "--batch",
        "2",
        "--tokens",
        "4",
        "--json",
        "--kv-store",
        &url,
        "--kv-store-namespace",
        &ns,
    ]);
    let lines: Vec<serde_json::Value> =
        out.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).expect("json")).collect();
    let done: Vec<&serde_json::Value> = lines.iter().filter(|j| j.get("generated_ids").is_some()).collect();
    assert_eq!(done.len(), 3, "{out}");
    for c in done.iter().filter(|c| c["prompt"] != 1) {
        assert_eq!(c["generated_ids"], cold["generated_ids"], "{out}");
    }
    let summary = lines.last().expect("the batch's line");
    assert!(summary["kv_store"]["tokens_reused"].as_u64().is_some_and(|r| r >= (n - 1) / 16 * 16), "{out}");
    assert!(out.contains("prompt tokens fetched instead of prefilled"), "{out}");
    ok(&["store", "clear", "--kv-store", &url, "--kv-store-namespace", &ns]);
    let bench = ok(&["store", "bench", "--kv-store", &url, "--kv-store-namespace", &ns, "--values", "50", "--rounds", "1"]);
    let b: serde_json::Value = serde_json::from_str(bench.lines().find(|l| l.starts_with('{')).expect("json")).expect("json");
    assert!(b["fetch_gb_per_s"].as_f64().is_some_and(|g| g > 0.0) && b["store_gb_per_s"].as_f64().is_some_and(|g| g > 0.0), "{b}");
    // Under FlexGen the store is the tier below host memory: the same tokens, pages through it.
    let flexgen = |store: bool| {
        let mut args = vec!["run", "--model", p, "--prompt", prompt, "--tokens", "6", "--json", "--scheduler", "flexgen", "--budget", "16"];
        if store {
            args.extend(["--kv-store", url.as_str(), "--kv-store-namespace", ns.as_str(), "--kv-store-host-pages", "1"]);
        }
        let out = ok(&args);
        let line = out.lines().rev().find(|l| l.starts_with('{')).expect("json line").to_string();
        (out, serde_json::from_str::<serde_json::Value>(&line).expect("json")["generated_ids"].clone())
    };
    let ((_, alone), (out, spilled)) = (flexgen(false), flexgen(true));
    assert_eq!(spilled, alone, "{out}");
    assert!(out.contains("the page store holds") && out.contains(", 0 lost)") && !out.contains("warning:"), "{out}");
    let sent = out.split(" sent,").next().and_then(|s| s.rsplit('(').next()).and_then(|s| s.trim().parse::<u64>().ok());
    assert!(sent.is_some_and(|n| n > 0), "{out}");
    assert!(
        ok(&["store", "stats", "--kv-store", &url, "--kv-store-namespace", &ns]).contains(": 0 keys under"),
        "spilled pages left behind"
    );
    // Refusals, before the model loads.
    let o = expertkv(&["run", "--model", p, "--prompt", prompt, "--kv-store", "redis://127.0.0.1:1/0"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("127.0.0.1:1") && err.contains("could not be reached"), "{err}");
    let o = expertkv(&["run", "--model", p, "--prompt", prompt, "--kv-store-codec", "int8"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("need --kv-store URL"));
    let o = expertkv(&["run", "--model", p, "--prompt", prompt, "--kv-store", &url, "--kv-store-host-pages", "2"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("give it with --scheduler flexgen"));
    let o = expertkv(&["store", "clear", "--kv-store", &url, "--kv-store-namespace", "*"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("namespace `*`"));
    let o = expertkv(&["run", "--model", p, "--prompt", prompt, "--kv-store", "redis://:hunter2@127.0.0.1:1/0"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && !err.contains("hunter2") && err.contains("***"), "{err}");
    let o = expertkv(&["run", "--model", p, "--prompt", prompt, "--kv-store", &url, "--codec", "int8"]);
    assert!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("a page codec is on"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `run --gpu-mem`: a budget that holds everything keeps every expert on the GPU; the exact
/// minimum (the pool and one step's experts) gives the fewest slots, one byte less is refused
/// with that minimum stated; in between, as many slots as fit. The bytes allocated are the
/// planned ones, within the budget, and the tokens are the run without a budget's.
#[test]
fn one_gpu_budget_splits_between_the_pool_and_the_experts() {
    let path = tmp("gpu_mem.gguf");
    let p = path.to_str().expect("utf-8 path");
    ok(&["synth", "--out", p, "--experts", "8", "--top-k", "2", "--layers", "2", "--untied-output", "--seed", "5"]);
    let args = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> =
            ["run", "--model", p, "--prompt", "a budget for pages and experts", "--tokens", "6", "--json"].map(String::from).to_vec();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let run = |extra: &[&str]| -> (String, serde_json::Value) {
        let a = args(extra);
        let out = ok(&a.iter().map(String::as_str).collect::<Vec<_>>());
        let line = out.lines().rev().find(|l| l.starts_with('{')).expect("json line").to_string();
        (out, serde_json::from_str(&line).expect("json"))
    };
    let (_, alone) = run(&[]);
    let (out, all) = run(&["--gpu-mem", "4G"]);
    let g = &all["gpu_mem"];
    assert_eq!(g["slots_per_layer"], 8, "{out}");
    assert!(all["expert_cache"].is_null(), "{out}");
    let (kv, eb, allocated) =
        (g["kv_bytes"].as_u64().expect("kv"), g["expert_bytes"].as_u64().expect("experts"), g["allocated"].as_u64().expect("allocated"));
    assert_eq!(allocated, kv + eb, "{out}");
    assert!(out.contains("gpu-mem: 4.0 GiB budget"), "{out}");
    assert_eq!(all["generated_ids"], alone["generated_ids"], "{out}");
    // Each layer's slot table is 8 u32; the rest is 8 experts' weights in 2 layers.
    let fixed = 2 * 8 * 4;
    let per_slot = (eb - fixed) / 8;
    assert_eq!(fixed + 8 * per_slot, eb, "{out}");
    let least = kv + fixed + 2 * per_slot;
    let a = args(&["--gpu-mem", &(least - 1).to_string()]);
    let o = expertkv(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains(&format!("give at least {least} bytes")), "{err}");
    for (budget, slots) in [(least, 2u32), (least + 3 * per_slot + per_slot / 2, 5)] {
        let (out, r) = run(&["--gpu-mem", &budget.to_string(), "--expert-policy", "lfu"]);
        assert_eq!(r["gpu_mem"]["slots_per_layer"], slots, "{out}");
        assert_eq!(r["expert_cache"]["slots_per_layer"], slots, "{out}");
        assert_eq!(r["expert_cache"]["policy"], "lfu", "{out}");
        assert!(r["expert_cache"]["misses"].as_u64().is_some_and(|m| m > 0), "{out}");
        let allocated = r["gpu_mem"]["allocated"].as_u64().expect("allocated");
        assert!(allocated <= budget && allocated == kv + fixed + u64::from(slots) * per_slot, "{out}");
        assert_eq!(r["generated_ids"], alone["generated_ids"], "{out}");
    }
    let a = args(&["--gpu-mem", "4G", "--expert-slots", "4"]);
    let o = expertkv(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("not both"));
    // A dense model: the pool alone, refused with its size when it does not fit.
    let dense = tmp("gpu_mem_dense.gguf");
    let d = dense.to_str().expect("utf-8 path");
    ok(&["synth", "--out", d, "--experts", "0", "--layers", "1", "--untied-output"]);
    // The K/V side counts QUEST's page bounds under QUEST and FlexGen (planned, then measured).
    for sched in ["quest", "flexgen"] {
        let out = ok(&[
            "run",
            "--model",
            d,
            "--prompt",
            "a few words of a prompt",
            "--tokens",
            "2",
            "--scheduler",
            sched,
            "--budget",
            "16",
            "--gpu-mem",
            "64M",
        ]);
        assert!(out.contains("gpu-mem: 64.0 MiB budget: K/V pool"), "{out}");
    }
    let o = expertkv(&["run", "--model", d, "--prompt", "x", "--tokens", "2", "--gpu-mem", "1K"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("the K/V pool (1 sequence of") && err.contains("give at least"), "{err}");
}

/// `run --trace` writes one record per pass, aligned: every decode step's chosen experts per
/// layer, the expert cache's fetches (whose bytes add up to what `run --json` reports moved),
/// FlexGen's page moves; `compare` finds the all-resident and the cached run's routing equal
/// and their residency parting at the first pass, and two cached runs equal throughout; a
/// trace cut mid-record compares over its whole passes, and a damaged one is refused with its
/// line.
#[test]
fn a_trace_aligns_routing_residency_and_pages_per_pass() {
    use expertkv_model::forward::trace::{compare, read_model_trace};
    let path = tmp("trace_moe.gguf");
    let p = path.to_str().expect("utf-8 path");
    ok(&["synth", "--out", p, "--experts", "8", "--top-k", "2", "--layers", "2", "--untied-output", "--seed", "9"]);
    let traced = |name: &str, extra: &[&str]| {
        let file = tmp(name);
        let mut args = vec![
            "run",
            "--model",
            p,
            "--prompt",
            "where the experts live",
            "--tokens",
            "5",
            "--json",
            "--trace",
            file.to_str().expect("utf-8"),
        ];
        args.extend(extra);
        let out = ok(&args);
        let json: serde_json::Value = serde_json::from_str(out.lines().rev().find(|l| l.starts_with('{')).expect("json")).expect("json");
        let t = read_model_trace(std::io::BufReader::new(std::fs::File::open(&file).expect("trace"))).expect("a readable trace");
        assert!(!t.torn);
        (file, json, t.header, t.passes)
    };
    // The route stage feeds the prompt token by token, as the expert cache does.
    let (fa, ja, ha, a) = traced("trace_a.jsonl", &["--kv-router", "topk"]);
    let (fb, jb, _, b) = traced("trace_b.jsonl", &["--expert-slots", "2"]);
    let (_, _, _, c) = traced("trace_c.jsonl", &["--expert-slots", "2"]);
    assert_eq!((ha.layers, ha.experts, ha.top_k, ha.n_seqs), (2, 8, 2, 1));
    let prompt = ja["prompt_ids"].as_array().expect("ids").len();
    assert_eq!((&ja["prefill_chunked"], &jb["prefill_chunked"]), (&false.into(), &false.into()), "{ja}\n{jb}");
    // A MoE file alone routes only its FFN: the prompt goes through in one chunk, to the same tokens.
    let (_, jd, _, d) = traced("trace_d.jsonl", &[]);
    assert_eq!(jd["prefill_chunked"], true, "{jd}");
    assert_eq!(jd["generated_ids"], ja["generated_ids"]);
    assert!(d[0].prefill && d[0].tokens as usize == prompt && d.len() == 1 + 4, "{d:?}");
    // Every forward pass: the prompt's tokens, then each generated token but the last.
    assert_eq!(a.len(), prompt + 5 - 1, "{ja}");
    for r in a.iter().filter(|r| !r.prefill) {
        assert!(r.experts.len() == 2 && r.experts.iter().all(|l| l.len() == 2 && l.iter().all(|&e| e < 8)), "{r:?}");
        assert!(r.fetched.is_empty() && r.kv_pages_in_use > 0, "{r:?}");
    }
    assert_eq!(jb["generated_ids"], ja["generated_ids"]);
    let moved: u64 = b.iter().map(|r| r.expert_bytes).sum();
    assert_eq!(Some(moved), jb["expert_cache"]["bytes_moved"].as_u64(), "{jb}");
    assert_eq!(b.iter().map(|r| r.fetched.len() as u64).sum::<u64>(), jb["expert_cache"]["misses"].as_u64().expect("misses"));
    let ab = compare(&a, &b);
    assert_eq!((ab.routing_parts_at, ab.residency_parts_at, ab.kv_parts_at), (None, Some(0), None));
    let bc = compare(&b, &c);
    assert_eq!((bc.routing_parts_at, bc.residency_parts_at, bc.kv_parts_at), (None, None, None));
    let out = ok(&["compare", fa.to_str().expect("utf-8"), fb.to_str().expect("utf-8")]);
    assert!(
        out.contains("routing (tokens, positions, chosen experts): equal") && out.contains("expert residency (fetches): parts at pass 0"),
        "{out}"
    );
    // FlexGen on a dense model: the trace counts its page moves.
    let dense = tmp("trace_dense.gguf");
    let d = dense.to_str().expect("utf-8 path");
    ok(&["synth", "--out", d, "--experts", "0", "--layers", "2", "--untied-output", "--seed", "3"]);
    let file = tmp("trace_flexgen.jsonl");
    let prompt = "a prompt long enough that FlexGen's host tier takes the oldest pages of every list";
    ok(&[
        "run",
        "--model",
        d,
        "--prompt",
        prompt,
        "--tokens",
        "6",
        "--scheduler",
        "flexgen",
        "--budget",
        "16",
        "--trace",
        file.to_str().expect("utf-8"),
    ]);
    let f = read_model_trace(std::io::BufReader::new(std::fs::File::open(&file).expect("trace"))).expect("trace").passes;
    assert!(f.iter().map(|r| r.kv_to_host).sum::<u64>() > 0, "{f:?}");
    // A trace cut mid-record (a killed run) compares over its whole passes and says so; a
    // damaged record within it is refused with its line.
    let text = std::fs::read_to_string(&fa).expect("trace");
    let torn = tmp("trace_torn.jsonl");
    std::fs::write(&torn, &text[..text.len() - 20]).expect("write");
    let out = ok(&["compare", torn.to_str().expect("utf-8"), fb.to_str().expect("utf-8")]);
    assert!(out.contains("cut short") && out.contains(&format!("compared over the first {}", a.len() - 1)), "{out}");
    let damaged = tmp("trace_damaged.jsonl");
    std::fs::write(&damaged, text.replacen("\"pass\":3,", "\"pass\":3,,", 1)).expect("write");
    let o = expertkv(&["compare", damaged.to_str().expect("utf-8"), fb.to_str().expect("utf-8")]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("line 5"), "{err}");
    let o = expertkv(&[
        "run",
        "--model",
        p,
        "--prompt",
        "x",
        "--tokens",
        "2",
        "--time-steps",
        "4",
        "--trace",
        damaged.to_str().expect("utf-8"),
    ]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("give one or the other"));
}

/// `mix`: one model, a budget split request by request. The joint controller keeps every
/// context whole (logits equal to the reference's: KL 0, the same top token every step) with
/// more slots for the short requests than a fixed split gives; experts-first evicts the long one
/// (KL above 0); MoE-Infinity's shares refuse it (the K/V share holds no page of it). Every
/// request's measured allocation is within the budget; a dense file and a bad policy are refused.
#[test]
fn mix_splits_one_budget_request_by_request() {
    let path = tmp("mix.gguf");
    let p = path.to_str().expect("utf-8 path");
    ok(&["synth", "--out", p, "--experts", "8", "--top-k", "2", "--layers", "2", "--ffn", "32", "--weights", "q8_0", "--untied-output"]);
    let out = ok(&[
        "mix",
        "--model",
        p,
        "--gpu-mem",
        "210K",
        "--requests",
        "1x8,1x96",
        "--tokens",
        "4",
        "--policies",
        "joint,0.75/0.15,experts-first:32",
        "--json",
    ]);
    let rows: Vec<serde_json::Value> =
        out.lines().filter(|l| l.starts_with("{\"measure\":\"mix_policy\"")).map(|l| serde_json::from_str(l).expect("json")).collect();
    assert_eq!(rows.len(), 3, "{out}");
    let row = |name: &str| rows.iter().map(|r| &r["row"]).find(|r| r["policy"] == name).expect("policy row");
    let slots = |r: &serde_json::Value, prompt: u64| -> Vec<u64> {
        let reqs = r["requests"].as_array().expect("requests");
        reqs.iter()
            .filter(|q| q["prompt"] == prompt && q["split"].is_object())
            .map(|q| q["split"]["slots"].as_u64().expect("slots"))
            .collect()
    };
    let total = 210 * 1024;
    for r in &rows {
        for q in r["row"]["requests"].as_array().expect("requests") {
            assert!(q["allocated"].as_u64().is_some_and(|a| a <= total), "{out}");
        }
    }
    let joint = row("joint");
    assert_eq!((joint["all"]["served"].as_u64(), joint["all"]["mean_kl"].as_f64()), (Some(2), Some(0.0)), "{out}");
    assert_eq!(joint["all"]["same_top"].as_f64(), Some(1.0), "{out}");
    assert!(joint["requests"].as_array().expect("requests").iter().all(|q| q["split"]["h2o_budget"].is_null()), "{out}");
    let (ef, mi) = (row("experts-first:32"), row("0.75/0.15"));
    assert!(slots(joint, 8).iter().zip(slots(mi, 8)).all(|(j, f)| *j > f), "{out}");
    assert!(ef["long"]["mean_kl"].as_f64().is_some_and(|k| k > 0.0), "{out}");
    assert_eq!(ef["requests"].as_array().expect("requests").iter().filter(|q| q["split"]["h2o_budget"] == 32).count(), 1, "{out}");
    assert!(
        mi["requests"].as_array().expect("requests").iter().any(|q| q["refused"].as_str().is_some_and(|w| w.contains("holds no page"))),
        "{out}"
    );
    let dense = tmp("mix_dense.gguf");
    let d = dense.to_str().expect("utf-8 path");
    ok(&["synth", "--out", d, "--experts", "0", "--layers", "1"]);
    let o = expertkv(&["mix", "--model", d, "--gpu-mem", "1M"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("dense FFN"));
    let o = expertkv(&["mix", "--model", p, "--gpu-mem", "1M", "--policies", "60/60"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("more than the total"));
}

/// `mix`'s online split, told only the prompt: it admits a short request with more slots than
/// the joint split (sized for the whole request) gives, grows the pool mid-request with the K/V
/// carried across (every step's logits the reference's: KL 0), stays within the total, and
/// refuses, at the token, a context that no longer fits whole beside one step's experts.
#[test]
fn mix_online_grows_the_pool_mid_request() {
    let path = tmp("mix_online.gguf");
    let p = path.to_str().expect("utf-8 path");
    ok(&["synth", "--out", p, "--experts", "8", "--top-k", "2", "--layers", "2", "--ffn", "32", "--weights", "q8_0", "--untied-output"]);
    let run = |budget: &str| {
        ok(&["mix", "--model", p, "--gpu-mem", budget, "--requests", "1x8", "--tokens", "40", "--policies", "joint,online", "--json"])
    };
    let out = run("210K");
    let rows: Vec<serde_json::Value> =
        out.lines().filter(|l| l.starts_with("{\"measure\":\"mix_policy\"")).map(|l| serde_json::from_str(l).expect("json")).collect();
    let row = |name: &str| rows.iter().map(|r| &r["row"]).find(|r| r["policy"] == name).expect("policy row");
    let (joint, online) = (row("joint"), row("online"));
    let q = &online["requests"][0];
    assert_eq!((online["all"]["served"].as_u64(), online["all"]["mean_kl"].as_f64()), (Some(1), Some(0.0)), "{out}");
    assert!(online["all"]["grown"].as_u64().is_some_and(|g| g >= 1) && q["grow_s"].as_f64().is_some_and(|t| t > 0.0), "{out}");
    let (first, last) = (q["admitted"]["slots"].as_u64().expect("admitted"), q["split"]["slots"].as_u64().expect("split"));
    assert!(first > last && first > joint["requests"][0]["split"]["slots"].as_u64().expect("joint slots"), "{out}");
    assert!(
        q["split"]["pool_tokens"].as_u64().is_some_and(|t| t >= 48) && q["allocated"].as_u64().is_some_and(|a| a <= 210 * 1024),
        "{out}"
    );
    let out = run("80K");
    assert!(out.contains("refused at token 16") && out.contains("a live context is not evicted"), "{out}");
}

/// `bench devices`: two devices opened from the one adapter; every token on one of them, the
/// merged output agreeing with one device's, the merge timed; one device is refused.
#[test]
fn bench_devices_splits_attention_over_two_devices() {
    // One adapter name per device (the same adapter twice here).
    let out =
        ok(&["bench", "devices", "--quick", "--batch", "2", "--tokens", "512", "--reps", "2", "--json", "--adapter", "llvmpipe,LLVMPIPE"]);
    let line = out.lines().find(|l| l.starts_with('{')).expect("json line");
    let j: serde_json::Value = serde_json::from_str(line).expect("json");
    assert_eq!(j["devices"], 2, "{out}");
    let held: Vec<u64> = j["tokens_per_device"].as_array().expect("per device").iter().map(|v| v.as_u64().expect("count")).collect();
    assert!(held.len() == 2 && held.iter().sum::<u64>() == 1024 && held.iter().all(|&n| n > 0), "{out}");
    assert!(j["worst_relative_difference"].as_f64().is_some_and(|d| d < 1e-3), "{out}");
    assert!(j["merge_ms"].as_f64().is_some_and(|m| m > 0.0) && j["scaling"].as_f64().is_some_and(|s| s > 0.0), "{out}");
    let o = expertkv(&["bench", "devices", "--quick", "--devices", "1"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("give 2 or more"));
    for (list, says) in [("llvmpipe,no-such-gpu", "no-such-gpu"), ("llvmpipe,", "an empty name")] {
        let o = expertkv(&["bench", "devices", "--quick", "--adapter", list]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(says), "{list}: {err}");
    }
}
