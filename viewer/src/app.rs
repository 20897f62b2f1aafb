//! The whole viewer window: a header with the run, its phase and the controls, then the panels in
//! two columns. Independent of the windowing shell (eframe natively, a canvas on the web) and of
//! who drives the pipeline: events go in through [`Viewer::apply`], requests come out of
//! [`Viewer::ui`].

use egui::{Color32, Ui};

use crate::controls::{Controls, Request};
use crate::panels;
use crate::state::{Event, HeatMode, Phase, Source, ViewerState};

/// The whole viewer window: the run's data, the heat grid's mode and the run controls.
pub struct Viewer {
    /// What the panels draw: the run, its latest snapshot and recent step reports.
    pub state: ViewerState,
    /// The statistic the expert heat grid shows (routing frequency at first).
    pub heat_mode: HeatMode,
    /// The run controls and the text of their spec fields.
    pub controls: Controls,
}

impl Viewer {
    /// A viewer for runs of (initially) `cfg`, stepping right away when `running`.
    pub fn new(cfg: &expertkv_core::pipeline::DemoConfig, running: bool) -> Viewer {
        Viewer { state: ViewerState::default(), heat_mode: HeatMode::default(), controls: Controls::new(cfg, running) }
    }

    /// Take in an event from whatever drives the pipeline. A started run also loads its
    /// configuration into the controls, and locks them for a replayed trace or a model.
    pub fn apply(&mut self, ev: Event) {
        if let Event::Started(info) = &ev {
            self.controls.load(&info.config);
            self.controls.locked = match &info.source {
                Source::Live => None,
                Source::Trace(path) => Some(format!("replaying {path}: the trace fixes the configuration")),
                Source::Model { path, .. } => Some(format!("decoding {path}: restart the command to change its configuration")),
            };
        }
        self.state.apply(ev);
    }

    /// Draw the window; returns what the person asked for this frame.
    pub fn ui(&mut self, ui: &mut Ui) -> Vec<Request> {
        let mut requests = Vec::new();
        egui::Panel::top("viewer_header").show(ui, |ui| {
            ui.add_space(4.0);
            ui.horizontal_wrapped(|ui| {
                ui.heading("expertkv viewer");
                self.run_line(ui);
            });
            self.phase_line(ui);
            requests = self.controls.ui(ui, self.state.info.as_ref().map(|i| &i.config));
            ui.add_space(2.0);
        });
        egui::CentralPanel::default().show(ui, |ui| {
            egui::ScrollArea::vertical().auto_shrink([false, false]).show(ui, |ui| {
                ui.columns(2, |cols| {
                    let [left, right] = cols else {
                        return;
                    };
                    if self.state.latest.as_ref().is_some_and(|s| s.text.is_some()) {
                        panels::text_panel(left, &self.state);
                        left.separator();
                    }
                    panels::step_summary(left, &self.state);
                    left.separator();
                    panels::heat_panel(left, &self.state, &mut self.heat_mode);
                    left.separator();
                    panels::budget_panel(left, &self.state);
                    left.separator();
                    panels::history_table(left, &self.state, 10);
                    if self.state.latest.as_ref().is_some_and(|s| s.trace.is_some()) {
                        left.separator();
                        panels::trace_panel(left, &self.state);
                    }
                    if self.state.latest.as_ref().is_some_and(|s| s.residency.is_some()) {
                        panels::residency_panel(right, &self.state);
                        right.separator();
                    }
                    panels::shard_panel(right, &self.state);
                    right.separator();
                    panels::evictions_panel(right, &self.state);
                    right.separator();
                    panels::step_time_panel(right, &self.state);
                });
            });
        });
        requests
    }

    fn run_line(&self, ui: &mut Ui) {
        let Some(info) = &self.state.info else {
            ui.weak("starting…");
            return;
        };
        let c = &info.config;
        let w = &c.workload;
        let sched = match (&c.scheduler, info.budget_tokens) {
            // QUEST selects pages to read and evicts nothing.
            (Some(s @ expertkv_core::evict::config::SchedulerConfig::Quest), Some(b)) => {
                format!("{} attending {b} tokens/list ({}) of a whole cache", s.name(), c.budget)
            }
            (Some(s), Some(b)) => format!("{} keeping {b} tokens/list ({})", s.name(), c.budget),
            (Some(s), None) => s.name().to_string(),
            (None, _) => "full cache".into(),
        };
        let source = match &info.source {
            Source::Live => "live".to_string(),
            Source::Trace(p) => format!("trace {p}"),
            Source::Model { path, labels } => format!("model {path} (experts: {labels})"),
        };
        ui.label(format!(
            "{source}: {} seqs x {} layers, prompt {}, {} experts top-{}; router {}; {sched}; codec {}; {}",
            w.n_seqs,
            w.layers,
            w.prompt_len,
            w.n_experts,
            w.top_k,
            c.router.name(),
            c.codec.name(),
            info.adapter
        ));
    }

    fn phase_line(&self, ui: &mut Ui) {
        let steps = self.state.info.as_ref().map_or(0, |i| i.config.steps);
        match &self.state.phase {
            Phase::Idle => {
                ui.weak("building the pipeline…");
            }
            Phase::Prefill { done, total } => {
                let f = *done as f32 / (*total).max(1) as f32;
                ui.add(egui::ProgressBar::new(f).desired_width(360.0).text(format!("prefill {done}/{total} tokens")));
            }
            Phase::Decoding => {
                let done = self.state.latest.as_ref().map_or(0, |s| s.report.step + 1);
                let what = if self.controls.running { "decoding" } else { "paused" };
                ui.label(format!("{what}: {done} of {steps} steps done"));
            }
            Phase::Finished => {
                ui.label(format!("finished: {steps} of {steps} steps done (Restart runs it again)"));
            }
            Phase::Failed(e) => {
                ui.colored_label(Color32::from_rgb(230, 90, 80), format!("stopped: {e}"));
            }
        }
    }
}
