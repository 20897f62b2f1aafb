//! Every example runs (on lavapipe when no GPU is there) and does what its doc says.

use std::process::Command;

fn run(bin: &str, args: &[&str]) -> String {
    let out = Command::new(bin).args(args).output().unwrap_or_else(|e| panic!("{bin}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{bin} {args:?} failed:\n{text}");
    text
}

#[test]
fn generate_streams_tokens_under_a_policy() {
    let out = run(env!("CARGO_BIN_EXE_generate"), &["--tokens", "12", "--scheduler", "h2o", "--budget", "16", "--codec", "int8"]);
    let stats = out.lines().last().unwrap_or_default();
    assert!(stats.contains("12 generated"), "{out}");
    let evicted: u64 = stats.rsplit(", ").next().and_then(|s| s.split(' ').next()).and_then(|n| n.parse().ok()).unwrap_or(0);
    assert!(evicted > 0, "a budget of 16 tokens over 36 must evict: {out}");
}

#[test]
fn the_pool_serves_as_a_kv_cache() {
    let out = run(env!("CARGO_BIN_EXE_kv_cache"), &["--steps", "48", "--budget", "16"]);
    let last = out.lines().rev().find(|l| l.starts_with("step")).unwrap_or_default();
    assert!(last.starts_with("step  48") && !last.contains(" 0 evicted"), "{out}");
}

#[test]
fn the_pipeline_reports_its_steps() {
    let out = run(env!("CARGO_BIN_EXE_pipeline_steps"), &["--steps", "3"]);
    assert_eq!(out.lines().filter(|l| l.starts_with("step")).count(), 3, "{out}");
}

#[test]
fn the_viewer_draws_inside_an_application_on_its_device() {
    let png = std::env::temp_dir().join(format!("expertkv-embed-{}.png", std::process::id()));
    let out = run(env!("CARGO_BIN_EXE_embed_viewer"), &["--headless", "6", "--png", &png.to_string_lossy()]);
    assert!(out.contains("decode steps made on"), "{out}");
    let bytes = std::fs::read(&png).unwrap_or_else(|e| panic!("{}: {e}", png.display()));
    let _ = std::fs::remove_file(&png);
    assert!(bytes.starts_with(b"\x89PNG") && bytes.len() > 10_000, "a PNG of the window: {} bytes", bytes.len());
}
