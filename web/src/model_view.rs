//! The viewer beside a model in the browser (the JS API's `showViewer`): the panels of
//! `expertkv-viewer` on a canvas of the page, fed by the JS API as the loaded model decodes.
//! `loadModel` starts the viewer's run (the model's pool and policies, in the synthetic run's
//! vocabulary, as `expertkv view --model` does natively), and `generate` sends one snapshot per
//! generated token: the pool's occupancy, shard rings, evictions and the text so far (expert heat
//! needs the route stage, which the JS API does not load).

use std::cell::RefCell;
use std::rc::Rc;

use eframe::egui;
use expertkv_core::Runtime;
use expertkv_core::pipeline::DemoConfig;
use expertkv_model::text::TextModel;
use expertkv_viewer::state::{RunInfo, Source};
use expertkv_viewer::{Event, Snapshot, Viewer, capture};
use wasm_bindgen::prelude::*;

/// What the API sends and the viewer draws.
#[derive(Default)]
struct Shared {
    events: Vec<Event>,
    ctx: Option<egui::Context>,
}

thread_local! {
    static VIEW: RefCell<Option<Rc<RefCell<Shared>>>> = const { RefCell::new(None) };
}

struct ModelViewApp {
    viewer: Viewer,
    shared: Rc<RefCell<Shared>>,
    /// Decode steps drawn so far (published on `window.expertkvViewer` for the browser test).
    steps: u32,
}

impl eframe::App for ModelViewApp {
    fn ui(&mut self, ui: &mut egui::Ui, _frame: &mut eframe::Frame) {
        let events = std::mem::take(&mut self.shared.borrow_mut().events);
        let mut changed = false;
        for ev in events {
            match &ev {
                Event::Started(_) => self.steps = 0,
                Event::Step(_) => self.steps += 1,
                _ => {}
            }
            changed = true;
            self.viewer.apply(ev);
        }
        // The controls act on a synthetic pipeline; beside a model they are informational.
        let _ = self.viewer.ui(ui);
        if changed {
            publish(self.steps);
        }
    }
}

fn publish(steps: u32) {
    let Some(window) = web_sys::window() else { return };
    let obj = js_sys::Object::new();
    let _ = js_sys::Reflect::set(&obj, &JsValue::from_str("steps"), &JsValue::from(steps));
    let _ = js_sys::Reflect::set(&window, &JsValue::from_str("expertkvViewer"), &obj);
}

/// Put the viewer on the canvas with id `canvas_id` (drawn through WebGL2; the model computes on
/// WebGPU). Later `loadModel` and `generate` calls feed it.
#[wasm_bindgen(js_name = showViewer)]
pub async fn show_viewer(canvas_id: String) -> Result<(), JsValue> {
    if VIEW.with(|v| v.borrow().is_some()) {
        return Err(JsValue::from_str("showViewer: the viewer is already shown"));
    }
    let canvas =
        crate::wasm::canvas(&canvas_id).map_err(|e| JsValue::from_str(&format!("showViewer: {}", e.as_string().unwrap_or_default())))?;
    let shared = Rc::new(RefCell::new(Shared::default()));
    // WebGL2 for the drawing: headless Chromium on SwiftShader loses its WebGPU instance when a
    // page presents WebGPU frames, which would take the model's device down (see wasm.rs).
    let options = crate::wasm::web_options(wgpu::Backends::GL);
    let app_shared = shared.clone();
    let viewer = Viewer::new(&DemoConfig::default(), true);
    eframe::WebRunner::new()
        .start(
            canvas,
            options,
            Box::new(move |cc| {
                app_shared.borrow_mut().ctx = Some(cc.egui_ctx.clone());
                Ok(Box::new(ModelViewApp { viewer, shared: app_shared, steps: 0 }))
            }),
        )
        .await?;
    VIEW.with(|v| *v.borrow_mut() = Some(shared));
    publish(0);
    Ok(())
}

/// Whether `showViewer` put a viewer on the page.
pub(crate) fn shown() -> bool {
    VIEW.with(|v| v.borrow().is_some())
}

/// Send an event to the viewer, if one is shown.
pub(crate) fn send(ev: Event) {
    let Some(shared) = VIEW.with(|v| v.borrow().clone()) else { return };
    let ctx = {
        let mut s = shared.borrow_mut();
        s.events.push(ev);
        s.ctx.clone()
    };
    if let Some(c) = ctx {
        c.request_repaint();
    }
}

/// The loaded model's run in the viewer's terms: its layers, heads and pool, its scheduler and
/// budget, one sequence, `name` as the source.
pub(crate) fn run_info(rt: &Runtime, model: &TextModel, name: &str) -> RunInfo {
    let m = model.llama();
    let c = &m.cfg;
    let mut cfg = DemoConfig::default();
    cfg.workload.n_seqs = 1;
    cfg.workload.layers = c.block_count;
    cfg.workload.kv_heads = c.head_count_kv;
    cfg.workload.group = c.head_count / c.head_count_kv.max(1);
    cfg.workload.head_dim = c.head_dim;
    cfg.workload.n_experts = c.expert_count.max(1);
    cfg.workload.top_k = c.expert_used_count.max(1);
    // A step is a generated token; the prompt is not known at load.
    cfg.steps = m.max_context();
    cfg.workload.prompt_len = 0;
    cfg.router = expertkv_core::route::config::RouterConfig::Topk;
    cfg.page_size = m.kv.pool.cfg.page_size;
    cfg.dtype = m.kv.pool.cfg.dtype;
    cfg.codec = m.kv.pool.cfg.codec;
    cfg.scheduler = m.kv.scheduler.as_ref().map(|s| s.cfg.clone());
    let budget = m.kv.scheduler.as_ref().map(|s| s.budget);
    if let Some(b) = budget {
        cfg.budget = b.to_string();
    }
    RunInfo {
        config: cfg,
        pool: m.kv.pool.cfg.clone(),
        budget_tokens: budget,
        adapter: format!("{} ({:?})", rt.info.name, rt.info.backend),
        source: Source::Model { path: name.to_string(), labels: "none (the JS API loads no route stage)".into() },
    }
}

/// A snapshot of the model's pool after a token, with `text` (the prompt and the tokens so far).
pub(crate) async fn snapshot(rt: &Runtime, model: &TextModel, text: String) -> expertkv_core::Result<Snapshot> {
    let m = model.llama();
    let report = m.step_report(rt).await?;
    let host = m.kv.flexgen.as_ref().map_or(0, |(fg, _)| fg.stats.host_pages);
    let mut snap = capture::capture_pool(rt, &m.kv.pool, (&[], 0), host, report).await?;
    snap.text = Some(text);
    Ok(snap)
}
