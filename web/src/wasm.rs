//! The wasm32 entry point: [`start`] puts the viewer on the page's canvas and runs the pipeline
//! task beside it.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use eframe::egui;
use expertkv_core::digest::DecisionDigest;
use expertkv_core::pipeline::{DemoConfig, Pipeline};
use expertkv_core::{Runtime, RuntimeOptions};
use expertkv_viewer::state::Source;
use expertkv_viewer::{Event, Request, Viewer, capture};
use wasm_bindgen::prelude::*;

/// What the pipeline task and the viewer exchange.
#[derive(Default)]
struct Shared {
    events: Vec<Event>,
    requests: VecDeque<Request>,
    ctx: Option<egui::Context>,
}

impl Shared {
    fn send(cell: &RefCell<Shared>, ev: Event) {
        let ctx = {
            let mut s = cell.borrow_mut();
            s.events.push(ev);
            s.ctx.clone()
        };
        if let Some(c) = ctx {
            c.request_repaint();
        }
    }
}

struct WebApp {
    viewer: Viewer,
    shared: Rc<RefCell<Shared>>,
}

impl eframe::App for WebApp {
    fn ui(&mut self, ui: &mut egui::Ui, _frame: &mut eframe::Frame) {
        let events = std::mem::take(&mut self.shared.borrow_mut().events);
        for ev in events {
            self.viewer.apply(ev);
        }
        let requests = self.viewer.ui(ui);
        self.shared.borrow_mut().requests.extend(requests);
    }
}

/// The page's view of the run, on `window.expertkv` (read by the browser test).
#[derive(Clone, Default)]
struct Published {
    phase: &'static str,
    steps_done: u32,
    steps: u32,
    checksum: Option<String>,
    /// The steps' attention-output sums ([`DecisionDigest::fingerprint`]).
    fingerprint: Vec<f64>,
    adapter: String,
    /// Whether the run is still `web/browser.toml` as shipped (controls can change it).
    shipped_config: bool,
    error: Option<String>,
}

fn publish(p: &Published) {
    let v = serde_json::json!({
        "phase": p.phase,
        "stepsDone": p.steps_done,
        "steps": p.steps,
        "checksum": p.checksum,
        "fingerprint": p.fingerprint,
        "adapter": p.adapter,
        "shippedConfig": p.shipped_config,
        "error": p.error,
        "version": crate::version(),
    });
    let Some(window) = web_sys::window() else {
        return;
    };
    let text = v.to_string();
    if let Ok(obj) = js_sys::JSON::parse(&text) {
        let _ = js_sys::Reflect::set(&window, &JsValue::from_str("expertkv"), &obj);
    }
    if let Some(el) = window.document().and_then(|d| d.get_element_by_id("status")) {
        let line = match (&p.error, &p.checksum) {
            (Some(e), _) => format!("stopped: {e}"),
            (None, Some(c)) => format!("{}: {} of {} steps on {}; decision checksum {c}", p.phase, p.steps_done, p.steps, p.adapter),
            (None, None) => format!("{}: {} of {} steps", p.phase, p.steps_done, p.steps),
        };
        el.set_text_content(Some(&line));
    }
}

/// Resolve after `ms` milliseconds of the browser's event loop (0: just yield to it).
async fn sleep(ms: i32) {
    let promise = js_sys::Promise::new(&mut |resolve, _reject| {
        if let Some(w) = web_sys::window() {
            let _ = w.set_timeout_with_callback_and_timeout_and_arguments_0(&resolve, ms);
        }
    });
    let _ = wasm_bindgen_futures::JsFuture::from(promise).await;
}

/// The page's canvas with id `id`, or an error naming it.
pub(crate) fn canvas(id: &str) -> Result<web_sys::HtmlCanvasElement, JsValue> {
    let document = web_sys::window().and_then(|w| w.document()).ok_or_else(|| JsValue::from_str("no document"))?;
    document
        .get_element_by_id(id)
        .ok_or_else(|| JsValue::from_str(&format!("no element with id `{id}`")))?
        .dyn_into::<web_sys::HtmlCanvasElement>()
        .map_err(|_| JsValue::from_str(&format!("`{id}` is not a canvas")))
}

/// eframe's options for a viewer drawn through `backends` (a wgpu instance of its own, apart
/// from the engine's device).
pub(crate) fn web_options(backends: wgpu::Backends) -> eframe::WebOptions {
    let mut options = eframe::WebOptions::default();
    options.wgpu_options.wgpu_setup = eframe::egui_wgpu::WgpuSetup::CreateNew(eframe::egui_wgpu::WgpuSetupCreateNew {
        instance_descriptor: wgpu::InstanceDescriptor { backends, ..wgpu::InstanceDescriptor::new_without_display_handle() },
        ..eframe::egui_wgpu::WgpuSetupCreateNew::without_display_handle()
    });
    options
}

/// Start the demo on the canvas with id `canvas_id`: `steps` replaces the shipped step count
/// (0 keeps it); `paused` opens with the pipeline held (Step and Run in the viewer);
/// `renderer` is the backend the viewer draws with, `webgl` (default) or `webgpu`.
///
/// The pipeline always computes on WebGPU. The viewer draws through wgpu's WebGL2 backend by
/// default: headless Chromium on SwiftShader loses its WebGPU instance as soon as a page presents
/// WebGPU frames to a canvas, which would take the pipeline's device down with it.
#[wasm_bindgen]
pub async fn start(canvas_id: String, steps: u32, paused: bool, renderer: String) -> Result<(), JsValue> {
    let _ = eframe::WebLogger::init(log::LevelFilter::Warn);
    let cfg = crate::browser_config((steps > 0).then_some(steps)).map_err(|e| JsValue::from_str(&e))?;
    let canvas = canvas(&canvas_id)?;
    let shared = Rc::new(RefCell::new(Shared::default()));
    let running = !paused;
    let viewer = Viewer::new(&cfg, running);
    let view_backends = match renderer.as_str() {
        "" | "webgl" | "gl" => wgpu::Backends::GL,
        "webgpu" => wgpu::Backends::BROWSER_WEBGPU,
        other => return Err(JsValue::from_str(&format!("renderer `{other}`: allowed values are webgl, webgpu"))),
    };
    let app_shared = shared.clone();
    eframe::WebRunner::new()
        .start(
            canvas,
            web_options(view_backends),
            Box::new(move |cc| {
                app_shared.borrow_mut().ctx = Some(cc.egui_ctx.clone());
                Ok(Box::new(WebApp { viewer, shared: app_shared }))
            }),
        )
        .await?;
    wasm_bindgen_futures::spawn_local(drive(cfg, running, shared));
    Ok(())
}

/// The pipeline task: open the GPU, build, prefill, step while running; act on the viewer's
/// requests between steps.
async fn drive(mut cfg: DemoConfig, mut running: bool, shared: Rc<RefCell<Shared>>) {
    let mut shipped = true;
    let mut pubd = Published { phase: "opening the GPU", steps: cfg.steps, shipped_config: true, ..Default::default() };
    publish(&pubd);
    let opts = RuntimeOptions { backends: wgpu::Backends::BROWSER_WEBGPU, ..RuntimeOptions::default() };
    let rt = match Runtime::new(opts).await {
        Ok(rt) => rt,
        Err(e) => {
            let msg = format!("opening the GPU: {e}");
            Shared::send(&shared, Event::Error(msg.clone()));
            pubd.error = Some(msg);
            publish(&pubd);
            return;
        }
    };
    pubd.adapter = rt.info.name.clone();
    'build: loop {
        pubd =
            Published { phase: "prefill", steps: cfg.steps, adapter: pubd.adapter.clone(), shipped_config: shipped, ..Default::default() };
        publish(&pubd);
        let mut p = match build(&rt, &cfg, &shared).await {
            Ok(p) => Some(p),
            Err(e) => {
                Shared::send(&shared, Event::Error(e.clone()));
                pubd.error = Some(e);
                publish(&pubd);
                None
            }
        };
        let mut digest = DecisionDigest::new();
        pubd.fingerprint.clear();
        let mut step = 0u32;
        if p.is_some() {
            pubd.phase = "decoding";
            publish(&pubd);
        }
        loop {
            let requests: Vec<Request> = shared.borrow_mut().requests.drain(..).collect();
            let mut one = false;
            for r in requests {
                match r {
                    Request::SetRunning(b) => running = b,
                    Request::Step => one = true,
                    Request::Restart => continue 'build,
                    Request::Rebuild(c) => {
                        cfg = *c;
                        shipped = false;
                        continue 'build;
                    }
                }
            }
            let Some(pipe) = p.as_mut().filter(|_| step < cfg.steps && (running || one)) else {
                sleep(50).await;
                continue;
            };
            match step_once(&rt, pipe, &mut digest).await {
                Ok(snap) => {
                    step += 1;
                    Shared::send(&shared, Event::Step(Box::new(snap)));
                    pubd.steps_done = step;
                    pubd.checksum = Some(digest.hex());
                    pubd.fingerprint = digest.fingerprint().to_vec();
                    if step == cfg.steps {
                        Shared::send(&shared, Event::Finished);
                        pubd.phase = "finished";
                    }
                    publish(&pubd);
                }
                Err(e) => {
                    let msg = format!("step {step}: {e}");
                    Shared::send(&shared, Event::Error(msg.clone()));
                    pubd.error = Some(msg);
                    publish(&pubd);
                    p = None;
                }
            }
            // Let the browser draw the viewer between steps.
            sleep(0).await;
        }
    }
}

async fn build(rt: &Runtime, cfg: &DemoConfig, shared: &Rc<RefCell<Shared>>) -> Result<Pipeline, String> {
    let mut p = Pipeline::new(rt, cfg.clone()).await.map_err(|e| format!("building the pipeline: {e}"))?;
    Shared::send(shared, Event::Started(Box::new(capture::run_info(rt, &p, Source::Live))));
    let mut last = 0u64;
    p.prefill(rt, &mut |done, total| {
        if done == total || done >= last + total / 20 {
            last = done;
            Shared::send(shared, Event::Prefill { done, total });
        }
    })
    .await
    .map_err(|e| format!("prefill: {e}"))?;
    Shared::send(shared, Event::Ready);
    Ok(p)
}

async fn step_once(rt: &Runtime, p: &mut Pipeline, digest: &mut DecisionDigest) -> expertkv_core::Result<expertkv_viewer::Snapshot> {
    let report = p.step(rt).await?;
    digest.absorb_step(rt, p).await?;
    capture::capture(rt, p, report).await
}
