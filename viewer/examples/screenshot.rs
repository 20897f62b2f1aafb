//! The viewer window rendered headless (egui_kittest with wgpu) from a real pipeline run, saved
//! as a PNG: the README's docs/viewer.png.
//!
//! ```sh
//! cargo run -p expertkv-viewer --example screenshot -- docs/viewer.png [--seqs N] [--layers N] [--prompt N] [--steps N]
//! ```
//!
//! The run: the demo's defaults (H2O at 25%, the cache-aware router) with the EKVA allocator and
//! without the CPU lockstep, on lavapipe when it is there.

use egui_kittest::Harness;
use expertkv_core::evict::config::EkvaConfig;
use expertkv_core::pipeline::{DemoConfig, Pipeline};
use expertkv_core::runtime::{Runtime, RuntimeOptions};
use expertkv_viewer::state::Source;
use expertkv_viewer::{Event, Viewer, capture};

fn main() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let mut out = None;
    let mut cfg = DemoConfig { allocator: Some(EkvaConfig::default()), verify: false, ..Default::default() };
    while let Some(a) = args.next() {
        let mut num = |name: &str| -> Result<u32, String> {
            args.next().and_then(|v| v.parse().ok()).ok_or_else(|| format!("{name} needs a whole number"))
        };
        match a.as_str() {
            "--seqs" => cfg.workload.n_seqs = num("--seqs")?,
            "--layers" => cfg.workload.layers = num("--layers")?,
            "--prompt" => cfg.workload.prompt_len = num("--prompt")?,
            "--steps" => cfg.steps = num("--steps")?,
            path if !path.starts_with("--") && out.is_none() => out = Some(path.to_string()),
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    let out = out.ok_or("usage: screenshot OUT.png [--seqs N] [--layers N] [--prompt N] [--steps N]")?;
    let mut opts = RuntimeOptions::from_env().map_err(|e| e.to_string())?;
    if opts.adapter.is_none() {
        opts.adapter = Some("llvmpipe".into());
    }
    let rt = pollster::block_on(Runtime::new(opts.clone()))
        .or_else(|_| pollster::block_on(Runtime::new(RuntimeOptions { adapter: None, ..opts })))
        .map_err(|e| format!("opening the GPU: {e}"))?;
    let mut viewer = Viewer::new(&cfg, false);
    let mut p = pollster::block_on(Pipeline::new(&rt, cfg.clone())).map_err(|e| e.to_string())?;
    viewer.apply(Event::Started(Box::new(capture::run_info(&rt, &p, Source::Live))));
    pollster::block_on(p.prefill(&rt, &mut |_, _| {})).map_err(|e| e.to_string())?;
    for _ in 0..cfg.steps {
        let r = pollster::block_on(p.step(&rt)).map_err(|e| e.to_string())?;
        let snap = pollster::block_on(capture::capture(&rt, &p, r)).map_err(|e| e.to_string())?;
        viewer.apply(Event::Step(Box::new(snap)));
    }
    viewer.apply(Event::Finished);
    // The harness draws a Ui inside an 8-point margin: render that much larger and crop it, so the
    // picture is the 1320 x 900 window `expertkv view` opens.
    const MARGIN: u32 = 8;
    let mut harness =
        Harness::builder().with_size(egui::vec2(1320.0 + 2.0 * MARGIN as f32, 900.0 + 2.0 * MARGIN as f32)).wgpu().build_ui_state(
            |ui, v: &mut Viewer| {
                v.ui(ui);
            },
            viewer,
        );
    harness.run();
    let full = harness.render()?;
    let img = image::imageops::crop_imm(&full, MARGIN, MARGIN, full.width() - 2 * MARGIN, full.height() - 2 * MARGIN).to_image();
    img.save(&out).map_err(|e| format!("saving {out}: {e}"))?;
    println!("{out}: {}x{} on {}", img.width(), img.height(), rt.info.name);
    Ok(())
}
