//! The panels, each drawn from a [`ViewerState`] (immediate mode: nothing is kept between
//! frames but the state).

use egui::{Align2, Color32, FontId, Rect, Sense, Stroke, StrokeKind, Ui, pos2, vec2};

use crate::state::{HeatMode, STAGES, ViewerState};

/// Colour of each stage in [`STAGES`] order.
pub const STAGE_COLORS: [Color32; 7] = [
    Color32::from_rgb(86, 156, 214),
    Color32::from_rgb(106, 190, 110),
    Color32::from_rgb(200, 200, 90),
    Color32::from_rgb(78, 201, 176),
    Color32::from_rgb(236, 160, 64),
    Color32::from_rgb(220, 90, 80),
    Color32::from_rgb(170, 120, 210),
];

const GRID_LINE: Color32 = Color32::from_gray(70);

/// A perceptual ramp (viridis at five stops) for `t` in [0, 1].
pub fn heat_color(t: f32) -> Color32 {
    const STOPS: [[f32; 3]; 5] = [[68.0, 1.0, 84.0], [59.0, 82.0, 139.0], [33.0, 145.0, 140.0], [94.0, 201.0, 98.0], [253.0, 231.0, 37.0]];
    let t = if t.is_finite() { t.clamp(0.0, 1.0) } else { 0.0 };
    let x = t * (STOPS.len() - 1) as f32;
    let i = (x.floor() as usize).min(STOPS.len() - 2);
    let f = x - i as f32;
    let c = |k: usize| (STOPS[i][k] + (STOPS[i + 1][k] - STOPS[i][k]) * f).round() as u8;
    Color32::from_rgb(c(0), c(1), c(2))
}

fn small() -> FontId {
    FontId::proportional(11.0)
}

fn text_color(ui: &Ui) -> Color32 {
    ui.visuals().text_color()
}

/// Bytes as B, KiB, MiB, GiB.
pub fn fmt_bytes(b: u64) -> String {
    const U: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 { format!("{b} B") } else { format!("{v:.1} {}", U[i]) }
}

/// A model's prompt and the text it generated so far.
pub fn text_panel(ui: &mut Ui, state: &ViewerState) {
    let Some(text) = state.latest.as_ref().and_then(|s| s.text.as_deref()) else { return };
    ui.strong("generated text");
    egui::ScrollArea::vertical().id_salt("generated_text").max_height(120.0).stick_to_bottom(true).show(ui, |ui| {
        ui.add(egui::Label::new(egui::RichText::new(text).monospace()).wrap());
    });
}

/// The latest step's scalars.
pub fn step_summary(ui: &mut Ui, state: &ViewerState) {
    let Some(s) = &state.latest else {
        ui.weak("no decode step yet");
        return;
    };
    let r = &s.report;
    egui::Grid::new("step_summary").num_columns(4).spacing([16.0, 2.0]).show(ui, |ui| {
        ui.label("step");
        ui.strong(format!("{}", r.step));
        ui.label("context");
        ui.strong(format!("{} tokens", r.context));
        ui.end_row();
        ui.label("KV resident");
        ui.strong(format!("{} ({} of {} pages)", fmt_bytes(r.kv_bytes_resident), r.pages_in_use, r.pages_total));
        ui.label("full cache");
        ui.strong(r.full_kv_bytes.map_or_else(|| "-".into(), fmt_bytes));
        ui.end_row();
        ui.label("kept attention");
        ui.strong(format!("{:.1}%", 100.0 * r.kept_attention));
        ui.label("attention error");
        ui.strong(r.attention_error.map_or_else(|| "-".into(), |e| format!("{e:.1e}")));
        ui.end_row();
        ui.label("routing entropy");
        ui.strong(format!("{:.2} nats", r.routing_entropy));
        ui.label("miss rate");
        ui.strong(format!("{:.1}%", 100.0 * r.miss_rate));
        ui.end_row();
    });
}

/// Layers x experts heat grid of the chosen statistic, with a switch between them.
pub fn heat_panel(ui: &mut Ui, state: &ViewerState, mode: &mut HeatMode) {
    ui.horizontal(|ui| {
        ui.strong("Expert cache heat");
        for m in HeatMode::ALL {
            ui.selectable_value(mode, m, m.label());
        }
    });
    let Some(h) = state.heat(*mode) else {
        ui.weak("no data yet");
        return;
    };
    let label_w = 34.0;
    let cell_w = ((ui.available_width() - label_w) / h.cols.max(1) as f32).clamp(6.0, 40.0);
    let cell_h = if h.rows <= 4 { 26.0 } else { (160.0 / h.rows as f32).clamp(8.0, 26.0) };
    let size = vec2(label_w + cell_w * h.cols as f32, 14.0 + cell_h * h.rows as f32);
    let (rect, resp) = ui.allocate_exact_size(size, Sense::hover());
    let p = ui.painter_at(rect);
    let col_step = h.cols.div_ceil(16).max(1);
    for c in (0..h.cols).step_by(col_step) {
        let x = rect.left() + label_w + (c as f32 + 0.5) * cell_w;
        p.text(pos2(x, rect.top()), Align2::CENTER_TOP, format!("e{c}"), small(), text_color(ui));
    }
    let top = rect.top() + 14.0;
    for (r, label) in h.row_labels.iter().enumerate() {
        let y = top + r as f32 * cell_h;
        p.text(pos2(rect.left(), y + cell_h / 2.0), Align2::LEFT_CENTER, label, small(), text_color(ui));
        for c in 0..h.cols {
            let v = h.values[r * h.cols + c];
            let cell = Rect::from_min_size(pos2(rect.left() + label_w + c as f32 * cell_w, y), vec2(cell_w, cell_h)).shrink(0.5);
            p.rect_filled(cell, 1.0, heat_color(v / h.max));
        }
    }
    if let Some(pos) = resp.hover_pos() {
        let c = ((pos.x - rect.left() - label_w) / cell_w).floor();
        let r = ((pos.y - top) / cell_h).floor();
        if c >= 0.0 && r >= 0.0 && (c as usize) < h.cols && (r as usize) < h.rows {
            let (r, c) = (r as usize, c as usize);
            resp.on_hover_text(format!("{} e{c}: {:.4} ({})", h.row_labels[r], h.values[r * h.cols + c], h.unit));
        }
    }
    // The colour scale.
    ui.horizontal(|ui| {
        ui.small("0");
        let (bar, _) = ui.allocate_exact_size(vec2(120.0, 10.0), Sense::hover());
        let n = 24;
        for i in 0..n {
            let x0 = bar.left() + bar.width() * i as f32 / n as f32;
            let cell = Rect::from_min_max(pos2(x0, bar.top()), pos2(x0 + bar.width() / n as f32 + 0.5, bar.bottom()));
            ui.painter().rect_filled(cell, 0.0, heat_color(i as f32 / (n - 1) as f32));
        }
        let max = if *mode == HeatMode::Occupancy { format!("{:.0}", h.max) } else { format!("{:.3}", h.max) };
        ui.small(format!("{max}  {}", h.unit));
    });
}

/// A MoE model's experts in tiers: layers x experts, resident (in one of the layer's GPU slots)
/// or in host memory, the step's choices outlined; the step's and the run's hits, misses and
/// bytes moved.
pub fn residency_panel(ui: &mut Ui, state: &ViewerState) {
    ui.strong("Expert residency");
    let Some(r) = state.latest.as_ref().and_then(|s| s.residency.as_ref()) else {
        ui.weak("every expert on the GPU (--expert-slots keeps fewer there)");
        return;
    };
    let rate = |[h, m, _]: [u64; 3]| if h + m == 0 { 0.0 } else { 100.0 * h as f64 / (h + m) as f64 };
    ui.small(format!(
        "{} of {} slots per layer on the GPU ({}; every expert in host memory, {})",
        r.slots,
        r.experts,
        fmt_bytes(r.bytes[0]),
        fmt_bytes(r.bytes[1])
    ));
    ui.small(format!(
        "step: {} hits, {} misses, {} moved; run: {:.0}% hits, {} moved",
        r.step[0],
        r.step[1],
        fmt_bytes(r.step[2]),
        rate(r.total),
        fmt_bytes(r.total[2])
    ));
    if r.prefetch[2] > 0 {
        ui.small(format!(
            "prefetch: {} fetched ahead this step, {} of them chosen; run: {} ahead, {:.0}% of them chosen",
            r.prefetch[0],
            r.prefetch[1],
            r.prefetch[2],
            100.0 * r.prefetch[3] as f64 / r.prefetch[2] as f64
        ));
    }
    if !r.reuse.is_empty() {
        let rates: Vec<String> = r.reuse.iter().map(|(s, h)| format!("{s}: {:.0}%", 100.0 * h)).collect();
        ui.small(format!("an LRU cache of each size, on this run's routing: {}", rates.join(", ")));
    }
    let label_w = 34.0;
    let cell_w = ((ui.available_width() - label_w) / r.experts.max(1) as f32).clamp(6.0, 40.0);
    let cell_h = if r.layers <= 4 { 22.0 } else { (140.0 / r.layers as f32).clamp(6.0, 22.0) };
    let (rect, _) = ui.allocate_exact_size(vec2(label_w + cell_w * r.experts as f32, cell_h * r.layers as f32), Sense::hover());
    let p = ui.painter_at(rect);
    let (on_gpu, on_host) = (heat_color(0.85), heat_color(0.08));
    for l in 0..r.layers {
        let y = rect.top() + l as f32 * cell_h;
        p.text(pos2(rect.left(), y + cell_h / 2.0), Align2::LEFT_CENTER, format!("L{l}"), small(), text_color(ui));
        for e in 0..r.experts {
            let i = l * r.experts + e;
            let cell = Rect::from_min_size(pos2(rect.left() + label_w + e as f32 * cell_w, y), vec2(cell_w, cell_h)).shrink(1.0);
            p.rect_filled(cell, 1.0, if r.resident.get(i).copied().unwrap_or(false) { on_gpu } else { on_host });
            if r.chosen.get(i).copied().unwrap_or(false) {
                p.rect_stroke(cell, 1.0, egui::Stroke::new(1.5, text_color(ui)), egui::StrokeKind::Inside);
            }
        }
    }
    ui.horizontal(|ui| {
        legend_swatch(ui, on_gpu, "on the GPU");
        legend_swatch(ui, on_host, "host memory");
        ui.small("outlined: chosen this step");
    });
}

/// Pages per shard, the fill of every shard ring, and pages per tier.
pub fn shard_panel(ui: &mut Ui, state: &ViewerState) {
    ui.strong("Shard occupancy");
    let (Some(s), Some(info)) = (&state.latest, &state.info) else {
        ui.weak("no data yet");
        return;
    };
    let r = &s.report;
    let rings_per_shard = (s.ring_pages.len() / info.pool.n_shards.max(1) as usize).max(1) as u64;
    let shard_cap = rings_per_shard * u64::from(info.pool.ring_capacity);
    egui::Grid::new("shards").num_columns(2).spacing([8.0, 2.0]).show(ui, |ui| {
        for (i, &pages) in r.shard_pages.iter().enumerate() {
            ui.small(format!("shard {i}"));
            let frac = pages as f32 / shard_cap.max(1) as f32;
            ui.add(egui::ProgressBar::new(frac).desired_width(220.0).text(format!("{pages} pages")));
            ui.end_row();
        }
    });
    if let Some((lists, shards, pages, cap)) = state.ring_fill() {
        let most = pages.iter().copied().max().unwrap_or(0).max(1);
        ui.small(format!(
            "pages per shard ring: {lists} page lists (layer, sequence, KV head) across, {shards} shards down; \
             colour up to {most} (ring capacity {cap})"
        ));
        let w = ui.available_width().min(560.0);
        let cell_w = (w / lists.max(1) as f32).clamp(1.5, 28.0);
        let cell_h = 16.0;
        let (rect, resp) = ui.allocate_exact_size(vec2(cell_w * lists as f32, cell_h * shards as f32), Sense::hover());
        let p = ui.painter_at(rect);
        for l in 0..lists {
            for sh in 0..shards {
                let v = pages[l * shards + sh];
                let cell =
                    Rect::from_min_size(pos2(rect.left() + l as f32 * cell_w, rect.top() + sh as f32 * cell_h), vec2(cell_w, cell_h));
                let t = v as f32 / most as f32;
                p.rect_filled(cell.shrink(0.5), 0.0, heat_color(t));
                if cell_w >= 14.0 {
                    let ink = if t > 0.6 { Color32::BLACK } else { Color32::from_gray(230) };
                    p.text(cell.center(), Align2::CENTER_CENTER, v.to_string(), FontId::proportional(10.0), ink);
                }
            }
        }
        let layer_lists = lists / info.pool.layers.max(1) as usize;
        for l in 1..info.pool.layers as usize {
            let x = rect.left() + (l * layer_lists) as f32 * cell_w;
            p.vline(x, rect.y_range(), Stroke::new(2.0, Color32::WHITE));
        }
        if let Some(pos) = resp.hover_pos() {
            let l = ((pos.x - rect.left()) / cell_w) as usize;
            let sh = ((pos.y - rect.top()) / cell_h) as usize;
            if l < lists && sh < shards {
                let per_layer = (info.pool.max_seqs * info.pool.kv_heads).max(1) as usize;
                let (layer, rest) = (l / per_layer, l % per_layer);
                let (seq, head) = (rest / info.pool.kv_heads.max(1) as usize, rest % info.pool.kv_heads.max(1) as usize);
                resp.on_hover_text(format!("layer {layer} seq {seq} head {head} shard {sh}: {} of {cap} pages", pages[l * shards + sh]));
            }
        }
    }
    let t = &s.tiers;
    ui.add_space(4.0);
    egui::Grid::new("tiers").num_columns(2).spacing([8.0, 2.0]).show(ui, |ui| {
        ui.small("GPU raw pages");
        let f = t.gpu_raw as f32 / t.gpu_raw_capacity.max(1) as f32;
        ui.add(egui::ProgressBar::new(f).desired_width(220.0).text(format!("{} / {}", t.gpu_raw, t.gpu_raw_capacity)));
        ui.end_row();
        if t.gpu_codec_capacity > 0 {
            ui.small("GPU compressed");
            let f = t.gpu_codec as f32 / t.gpu_codec_capacity.max(1) as f32;
            ui.add(egui::ProgressBar::new(f).desired_width(220.0).text(format!("{} / {}", t.gpu_codec, t.gpu_codec_capacity)));
            ui.end_row();
        }
        ui.small("host (FlexGen)");
        ui.small(format!("{} pages, {} moved", t.host, fmt_bytes(r.tier_bytes_moved)));
        ui.end_row();
    });
    if r.ring_overflows > 0 {
        ui.colored_label(Color32::from_rgb(230, 90, 80), format!("{} ring overflows", r.ring_overflows));
    }
}

/// Vertical bars of `values` (one per step) in a frame of `height`, scaled to their maximum.
fn bars(ui: &mut Ui, id: &str, values: &[(u32, Vec<(f64, Color32)>)], height: f32, unit: &str) {
    let max = values.iter().map(|(_, segs)| segs.iter().map(|s| s.0).sum::<f64>()).fold(0.0, f64::max);
    let axis_w = 56.0;
    let width = ui.available_width().clamp(160.0, 560.0);
    let (rect, resp) = ui.allocate_exact_size(vec2(width, height + 14.0), Sense::hover());
    let p = ui.painter_at(rect);
    let plot = Rect::from_min_max(pos2(rect.left() + axis_w, rect.top() + 2.0), pos2(rect.right() - 2.0, rect.top() + height));
    p.rect_stroke(plot, 0.0, Stroke::new(1.0, GRID_LINE), StrokeKind::Inside);
    let scale = if max > 0.0 { f64::from(plot.height() - 2.0) / max } else { 0.0 };
    let fmt = |v: f64| {
        if v >= 100.0 || v.fract() == 0.0 {
            format!("{v:.0}")
        } else if v >= 1.0 {
            format!("{v:.1}")
        } else {
            format!("{v:.2}")
        }
    };
    p.text(pos2(plot.left() - 4.0, plot.top()), Align2::RIGHT_TOP, fmt(max), small(), text_color(ui));
    p.text(pos2(plot.left() - 4.0, plot.bottom()), Align2::RIGHT_BOTTOM, "0", small(), text_color(ui));
    let n = values.len().max(1);
    let slot = plot.width() / n as f32;
    let bar_w = (slot * 0.8).max(1.0);
    for (i, (_, segs)) in values.iter().enumerate() {
        let x = plot.left() + i as f32 * slot + (slot - bar_w) / 2.0;
        let mut y = plot.bottom() - 1.0;
        for &(v, color) in segs {
            let h = (v * scale) as f32;
            if h > 0.0 {
                p.rect_filled(Rect::from_min_max(pos2(x, y - h), pos2(x + bar_w, y)), 0.0, color);
            }
            y -= h;
        }
    }
    if let (Some((first, _)), Some((last, _))) = (values.first(), values.last()) {
        p.text(pos2(plot.left(), plot.bottom() + 1.0), Align2::LEFT_TOP, format!("step {first}"), small(), text_color(ui));
        p.text(pos2(plot.right(), plot.bottom() + 1.0), Align2::RIGHT_TOP, format!("step {last}"), small(), text_color(ui));
    }
    if let Some(pos) = resp.hover_pos() {
        let i = ((pos.x - plot.left()) / slot).floor();
        if i >= 0.0 && (i as usize) < values.len() {
            let (step, segs) = &values[i as usize];
            let total: f64 = segs.iter().map(|s| s.0).sum();
            resp.on_hover_text(format!("{id}, step {step}: {} {unit}", fmt(total)));
        }
    }
}

/// Tokens evicted at every step.
pub fn evictions_panel(ui: &mut Ui, state: &ViewerState) {
    ui.horizontal(|ui| {
        ui.strong("Evictions over time");
        ui.small("tokens per step, all lists");
    });
    let ev = state.evictions();
    if ev.is_empty() {
        ui.weak("no data yet");
        return;
    }
    let vals: Vec<(u32, Vec<(f64, Color32)>)> = ev.iter().map(|&(s, n)| (s, vec![(n as f64, STAGE_COLORS[5])])).collect();
    bars(ui, "evicted", &vals, 70.0, "tokens");
    if let Some(s) = &state.latest {
        let total: u64 = ev.iter().map(|e| e.1).sum();
        ui.small(format!(
            "{total} tokens evicted over the last {} steps; {} pages returned to the free list since the start",
            ev.len(),
            s.report.pages_evicted
        ));
    }
}

/// The EKVA allocator's budget split over experts.
pub fn budget_panel(ui: &mut Ui, state: &ViewerState) {
    ui.strong("Budget split (EKVA allocator)");
    let Some(b) = state.budget_split() else {
        ui.weak("no allocator in this run: --allocator ekva splits each list's budget over its experts");
        return;
    };
    let n = b.tokens.len().max(1);
    let width = ui.available_width().clamp(160.0, 560.0);
    let height = 70.0;
    let (rect, resp) = ui.allocate_exact_size(vec2(width, height + 14.0), Sense::hover());
    let p = ui.painter_at(rect);
    let plot = Rect::from_min_max(pos2(rect.left() + 56.0, rect.top() + 2.0), pos2(rect.right() - 2.0, rect.top() + height));
    p.rect_stroke(plot, 0.0, Stroke::new(1.0, GRID_LINE), StrokeKind::Inside);
    let max_share = b.shares.iter().copied().fold(0.0, f64::max).max(1e-9);
    let max_imp = b.importance.iter().copied().fold(0.0, f32::max).max(1e-9);
    let slot = plot.width() / n as f32;
    for (e, &share) in b.shares.iter().enumerate() {
        let x = plot.left() + e as f32 * slot;
        let h = (share / max_share) as f32 * (plot.height() - 4.0);
        p.rect_filled(
            Rect::from_min_max(pos2(x + slot * 0.15, plot.bottom() - 1.0 - h), pos2(x + slot * 0.85, plot.bottom() - 1.0)),
            0.0,
            STAGE_COLORS[0],
        );
        if let Some(&imp) = b.importance.get(e) {
            let y = plot.bottom() - 1.0 - imp / max_imp * (plot.height() - 4.0);
            p.circle_filled(pos2(x + slot / 2.0, y), 2.5, STAGE_COLORS[4]);
        }
        if n <= 32 || e % 4 == 0 {
            p.text(pos2(x + slot / 2.0, plot.bottom() + 1.0), Align2::CENTER_TOP, format!("{e}"), small(), text_color(ui));
        }
    }
    p.text(pos2(plot.left() - 4.0, plot.top()), Align2::RIGHT_TOP, format!("{:.1}%", 100.0 * max_share), small(), text_color(ui));
    p.text(pos2(plot.left() - 4.0, plot.bottom()), Align2::RIGHT_BOTTOM, "0", small(), text_color(ui));
    if let Some(pos) = resp.hover_pos() {
        let e = ((pos.x - plot.left()) / slot).floor();
        if e >= 0.0 && (e as usize) < b.tokens.len() {
            let e = e as usize;
            resp.on_hover_text(format!(
                "expert {e}: {} tokens ({:.1}%), importance {:.3}",
                b.tokens[e],
                100.0 * b.shares[e],
                b.importance.get(e).copied().unwrap_or(0.0)
            ));
        }
    }
    ui.horizontal(|ui| {
        legend_swatch(ui, STAGE_COLORS[0], "share of the budget");
        legend_swatch(ui, STAGE_COLORS[4], "importance");
        ui.small(format!("{} tokens over {} experts", b.total, b.tokens.len()));
    });
}

fn legend_swatch(ui: &mut Ui, color: Color32, label: &str) {
    let (r, _) = ui.allocate_exact_size(vec2(10.0, 10.0), Sense::hover());
    ui.painter().rect_filled(r, 2.0, color);
    ui.small(label);
}

/// GPU time of every stage of every step, stacked.
pub fn step_time_panel(ui: &mut Ui, state: &ViewerState) {
    ui.horizontal(|ui| {
        ui.strong("Step time per stage");
        ui.small("GPU timestamps, ms");
    });
    let times = state.step_times();
    if times.is_empty() {
        ui.weak(if state.history.is_empty() { "no data yet" } else { "no GPU timestamps on this adapter" });
        return;
    }
    let vals: Vec<(u32, Vec<(f64, Color32)>)> =
        times.iter().map(|(s, t)| (*s, t.iter().zip(STAGE_COLORS).map(|(&ms, c)| (ms, c)).collect())).collect();
    bars(ui, "GPU time", &vals, 90.0, "ms");
    ui.horizontal_wrapped(|ui| {
        let last = times.last().map(|t| t.1).unwrap_or_default();
        for ((name, color), ms) in STAGES.iter().zip(STAGE_COLORS).zip(last) {
            legend_swatch(ui, color, &format!("{name} {ms:.2}"));
        }
        ui.small(format!("ms at step {}", times.last().map_or(0, |t| t.0)));
    });
}

/// A replayed trace's step beside its recording.
pub fn trace_panel(ui: &mut Ui, state: &ViewerState) {
    let Some(t) = state.latest.as_ref().and_then(|s| s.trace.as_ref()) else {
        return;
    };
    ui.strong("Trace");
    match state.departures.first() {
        None => {
            ui.colored_label(Color32::from_rgb(106, 190, 110), "every replayed step so far matches the recording");
        }
        Some((step, d)) => {
            ui.colored_label(Color32::from_rgb(230, 90, 80), format!("departs from the recording at step {step}: {d}"));
        }
    }
    egui::Grid::new("trace_records").num_columns(6).spacing([10.0, 1.0]).striped(true).show(ui, |ui| {
        for h in ["layer", "pages read", "in use", "evicted", "moved", "freed"] {
            ui.small(h);
        }
        ui.end_row();
        for r in &t.recorded {
            for v in [u64::from(r.layer), r.pages_read, r.pages_in_use, r.tokens_evicted, r.slots_moved, r.pages_freed] {
                ui.small(v.to_string());
            }
            ui.end_row();
        }
    });
}

/// The most recent steps as a table (the columns of `expertkv demo`, without host times).
pub fn history_table(ui: &mut Ui, state: &ViewerState, rows: usize) {
    ui.strong("Recent steps");
    if state.history.is_empty() {
        ui.weak("no data yet");
        return;
    }
    egui::Grid::new("history").num_columns(8).spacing([12.0, 1.0]).striped(true).show(ui, |ui| {
        for h in ["step", "context", "KV resident", "pages", "evicted", "kept attn", "attn err", "miss"] {
            ui.small(h);
        }
        ui.end_row();
        let skip = state.history.len().saturating_sub(rows);
        for r in state.history.iter().skip(skip) {
            ui.small(r.step.to_string());
            ui.small(r.context.to_string());
            ui.small(fmt_bytes(r.kv_bytes_resident));
            ui.small(format!("{}/{}", r.pages_in_use, r.pages_total));
            ui.small(r.evicted.to_string());
            ui.small(format!("{:.1}%", 100.0 * r.kept_attention));
            ui.small(r.attention_error.map_or_else(|| "-".into(), |e| format!("{e:.1e}")));
            ui.small(format!("{:.1}%", 100.0 * r.miss_rate));
            ui.end_row();
        }
    });
}
