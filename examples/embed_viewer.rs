//! An application that renders with wgpu shares its device with expertkv and draws the viewer
//! inside its own egui window, beside its own panels.
//!
//! ```sh
//! cargo run --release -p expertkv-examples --bin embed_viewer              # a window
//! cargo run --release -p expertkv-examples --bin embed_viewer -- --headless 12 --png out.png
//! ```
//!
//! In a window, eframe creates the device (asking for the features expertkv's faster kernels use,
//! [`Runtime::device_descriptor`]) and the application hands it to [`Runtime::from_device`].
//! Headless (CI), egui_kittest renders the same application offscreen on a device made the same
//! way, shared the same way, and saves a PNG.

use std::sync::Arc;

use eframe::egui;
use eframe::egui_wgpu::{self, RenderState, WgpuSetup, WgpuSetupCreateNew};
use expertkv_core::Runtime;
use expertkv_core::pipeline::{DemoConfig, Pipeline};
use expertkv_core::runtime::ShaderChecks;
use expertkv_examples::{flag, number};
use expertkv_viewer::state::Source;
use expertkv_viewer::{Event, Request, Viewer, capture};

/// The application: its own state (a frame counter, a note) and expertkv's pipeline and viewer.
struct App {
    rt: Runtime,
    cfg: DemoConfig,
    pipeline: Option<Pipeline>,
    viewer: Viewer,
    running: bool,
    step: u32,
    frames: u64,
    note: String,
}

impl App {
    /// expertkv on the device the application renders with.
    fn new(rs: &RenderState) -> Result<App, String> {
        let rt = Runtime::from_device(rs.instance.clone(), rs.adapter.clone(), rs.device.clone(), rs.queue.clone(), ShaderChecks::Checked)
            .map_err(|e| format!("expertkv on the application's device: {e}"))?;
        let mut cfg = DemoConfig { verify: false, ..Default::default() };
        cfg.workload.n_seqs = 2;
        cfg.workload.layers = 2;
        cfg.workload.prompt_len = 256;
        cfg.steps = 200;
        let viewer = Viewer::new(&cfg, true);
        let mut app = App { rt, cfg, pipeline: None, viewer, running: true, step: 0, frames: 0, note: String::new() };
        app.rebuild()?;
        Ok(app)
    }

    fn rebuild(&mut self) -> Result<(), String> {
        let mut p = pollster::block_on(Pipeline::new(&self.rt, self.cfg.clone())).map_err(|e| e.to_string())?;
        self.viewer.apply(Event::Started(Box::new(capture::run_info(&self.rt, &p, Source::Live))));
        pollster::block_on(p.prefill(&self.rt, &mut |_, _| {})).map_err(|e| e.to_string())?;
        self.viewer.apply(Event::Ready);
        self.pipeline = Some(p);
        self.step = 0;
        Ok(())
    }

    /// One decode step between frames (the pipeline is small: a step takes milliseconds on a
    /// GPU; a real application would step on its own task, as `expertkv view` does).
    fn step(&mut self) -> Result<(), String> {
        let Some(p) = &mut self.pipeline else { return Ok(()) };
        if self.step >= self.cfg.steps {
            return Ok(());
        }
        let report = pollster::block_on(p.step(&self.rt)).map_err(|e| e.to_string())?;
        let snap = pollster::block_on(capture::capture(&self.rt, p, report)).map_err(|e| e.to_string())?;
        self.viewer.apply(Event::Step(Box::new(snap)));
        self.step += 1;
        if self.step == self.cfg.steps {
            self.viewer.apply(Event::Finished);
        }
        Ok(())
    }

    fn ui(&mut self, ui: &mut egui::Ui) {
        self.frames += 1;
        let mut one = false;
        // The application's own panel.
        egui::Panel::left("app").show(ui, |ui| {
            ui.heading("My application");
            ui.label(format!("frame {}", self.frames));
            ui.label(format!("expertkv on {}", self.rt.info.name));
            ui.label(format!("decode step {} of {}", self.step, self.cfg.steps));
            ui.text_edit_singleline(&mut self.note);
        });
        // expertkv's viewer in the rest of the window.
        egui::CentralPanel::default().show(ui, |ui| {
            for r in self.viewer.ui(ui) {
                match r {
                    Request::SetRunning(b) => self.running = b,
                    Request::Step => one = true,
                    Request::Restart => self.pipeline = None,
                    Request::Rebuild(c) => {
                        self.cfg = *c;
                        self.pipeline = None;
                    }
                }
            }
        });
        let result = if self.pipeline.is_none() { self.rebuild() } else { Ok(()) }
            .and_then(|()| if self.running || one { self.step() } else { Ok(()) });
        if let Err(e) = result {
            self.viewer.apply(Event::Error(e));
            self.pipeline = None;
            self.running = false;
        }
        if self.running {
            ui.ctx().request_repaint();
        }
    }
}

impl eframe::App for App {
    fn ui(&mut self, ui: &mut egui::Ui, _frame: &mut eframe::Frame) {
        App::ui(self, ui);
    }
}

/// The device request: expertkv's wanted features and limits where the adapter has them.
fn setup() -> WgpuSetup {
    WgpuSetup::CreateNew(WgpuSetupCreateNew {
        device_descriptor: Arc::new(|adapter: &wgpu::Adapter| Runtime::device_descriptor(adapter)),
        ..WgpuSetupCreateNew::without_display_handle()
    })
}

fn headless(frames: u32, png: Option<String>) -> Result<(), String> {
    let rs = egui_kittest::wgpu::create_render_state(setup(), egui_wgpu::RendererOptions::PREDICTABLE);
    let app = App::new(&rs)?;
    let mut harness = egui_kittest::Harness::builder()
        .with_size(egui::vec2(1280.0, 800.0))
        .renderer(egui_kittest::wgpu::WgpuTestRenderer::from_render_state(rs))
        .build_ui_state(|ui, app: &mut App| app.ui(ui), app);
    harness.run_steps(frames as usize);
    let app = harness.state();
    if app.step == 0 || app.frames < u64::from(frames) {
        return Err(format!("{} frames drawn but {} decode steps made", app.frames, app.step));
    }
    println!(
        "{} frames drawn, {} decode steps made on {}, the viewer beside the application's panel",
        app.frames, app.step, app.rt.info.name
    );
    if let Some(path) = png {
        let image = harness.render().map_err(|e| format!("rendering: {e}"))?;
        image.save(&path).map_err(|e| format!("writing {path}: {e}"))?;
        println!("wrote {path}");
    }
    Ok(())
}

fn main() -> Result<(), String> {
    if flag("--headless").is_some() {
        return headless(number("--headless", 12)?, flag("--png"));
    }
    let mut options = eframe::NativeOptions::default();
    options.wgpu_options.wgpu_setup = setup();
    eframe::run_native(
        "expertkv embedded",
        options,
        Box::new(|cc| {
            let rs = cc.wgpu_render_state.as_ref().ok_or("eframe gave no wgpu render state (the wgpu renderer is needed)")?;
            Ok(Box::new(App::new(rs)?))
        }),
    )
    .map_err(|e| format!("the window: {e}"))
}
