//! Decode a GGUF model with a K/V policy and stream its tokens.
//!
//! ```sh
//! cargo run --release -p expertkv-examples --bin generate -- \
//!     --model models/SmolLM2-135M-Instruct.Q4_1.gguf --prompt "The capital of France is" \
//!     --tokens 16 --scheduler h2o --budget 25% --codec int4
//! ```
//!
//! Without `--model` it writes a small random model in memory (the output is noise, the
//! machinery the same).

use expertkv_core::{Runtime, RuntimeOptions};
use expertkv_examples::{flag, number};
use expertkv_model::SyntheticModel;
use expertkv_model::text::{GenerateOptions, KvPolicy, TextModel};
use std::io::Write;

fn main() -> std::process::ExitCode {
    expertkv_examples::exit(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let gguf = match flag("--model") {
        Some(path) => std::fs::read(&path).map_err(|e| format!("reading {path}: {e}"))?,
        None => SyntheticModel::dense(7).gguf(),
    };
    let prompt = flag("--prompt").unwrap_or_else(|| "The capital of France is".into());
    let policy = KvPolicy { scheduler: flag("--scheduler"), budget: flag("--budget"), codec: flag("--codec"), ..Default::default() };

    let rt = pollster::block_on(Runtime::new(RuntimeOptions::from_env()?))?;
    let mut model = pollster::block_on(TextModel::load_with_policy(&rt, &gguf, &policy))?;
    print!("{prompt}");
    let opts = GenerateOptions { max_tokens: number("--tokens", 16)?, ..Default::default() };
    let out = pollster::block_on(model.generate(&rt, &prompt, &opts, |piece| {
        print!("{}", piece.text);
        std::io::stdout().flush().is_ok()
    }))?;
    println!();
    let s = pollster::block_on(model.stats(&rt))?;
    println!(
        "{} prompt tokens, {} generated ({:?}); K/V: {} pages, {} bytes in use for {} tokens ({} as a full f16 cache), {} evicted",
        out.prompt_tokens,
        out.tokens.len(),
        out.stop,
        s.pages_in_use,
        s.kv_bytes_in_use,
        s.context_tokens,
        s.full_cache_bytes,
        s.evicted
    );
    Ok(())
}
