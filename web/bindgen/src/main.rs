//! `expertkv-bindgen --out-dir DIR FILE.wasm`: what `wasm-bindgen --target web --no-typescript`
//! does, from wasm-bindgen's own library (`wasm-bindgen-cli-support`, the crate the CLI wraps) at
//! the version of the workspace's `wasm-bindgen`. Built with the rest of the workspace, it saves
//! installing `wasm-bindgen-cli`, which no registry here ships prebuilt and whose build (the test
//! runner's HTTP stack included) takes about 9 minutes on two cores.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

const USAGE: &str = "usage: expertkv-bindgen --out-dir DIR FILE.wasm";

fn main() {
    if let Err(e) = run() {
        eprintln!("expertkv-bindgen: error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let mut out: Option<PathBuf> = None;
    let mut input: Option<PathBuf> = None;
    let mut args = std::env::args_os().skip(1);
    while let Some(a) = args.next() {
        match a.to_str() {
            Some("--out-dir") => out = Some(args.next().context("--out-dir needs a folder")?.into()),
            Some("-h" | "--help") => {
                println!("{USAGE}");
                return Ok(());
            }
            Some(s) if s.starts_with('-') => bail!("unknown option {s}\n{USAGE}"),
            _ if input.is_none() => input = Some(a.into()),
            _ => bail!("one input file only\n{USAGE}"),
        }
    }
    let (Some(out), Some(input)) = (out, input) else { bail!("{USAGE}") };
    if !input.is_file() {
        bail!("{} is not a file", input.display());
    }
    // The CLI's settings for `--target web --no-typescript`, where the library's defaults
    // differ: the glue fetches `<name>_bg.wasm` beside itself when `init()` gets no path.
    wasm_bindgen_cli_support::Bindgen::new()
        .input_path(&input)
        .web(true)?
        .typescript(false)
        .omit_default_module_path(false)
        .generate(&out)
        .with_context(|| format!("generating the JS glue of {} into {}", input.display(), out.display()))?;
    Ok(())
}
