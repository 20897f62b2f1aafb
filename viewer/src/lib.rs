//! egui panels that draw expertkv pipeline state from snapshots produced by `expertkv-core`.
//!
//! For now: shard occupancy and the per-stage step time of a [`StepReport`]. The eframe app
//! (native and web), cache heat, evictions and the budget split come with the viewer issue.

use expertkv_core::pipeline::StepReport;

/// Pages per shard as horizontal bars, scaled to the fullest shard.
pub fn shard_occupancy(ui: &mut egui::Ui, report: &StepReport) {
    ui.heading("Shard occupancy");
    let max = report.shard_pages.iter().copied().max().unwrap_or(0).max(1);
    for (s, pages) in report.shard_pages.iter().enumerate() {
        ui.horizontal(|ui| {
            ui.label(format!("shard {s:>3}"));
            ui.add(egui::ProgressBar::new(*pages as f32 / max as f32).text(format!("{pages} pages")));
        });
    }
    ui.label(format!("{} of {} pages in use; {} ring overflows", report.pages_in_use, report.pages_total, report.ring_overflows));
}

/// GPU time of each stage of the step.
pub fn stage_times(ui: &mut egui::Ui, report: &StepReport) {
    ui.heading(format!("Step {}", report.step));
    match &report.gpu {
        Some(g) => {
            egui::Grid::new("stage_times").show(ui, |ui| {
                for (name, ms) in [("append", g.append_ms), ("gather", g.gather_ms), ("attend", g.attend_ms)] {
                    ui.label(name);
                    ui.label(format!("{ms:.3} ms"));
                    ui.end_row();
                }
            });
        }
        None => {
            ui.label("no GPU timestamps on this adapter");
        }
    }
}
