//! PNG plots of a sweep (plotters, bitmap backend; text in egui's bundled Ubuntu Light font, so
//! no system font is needed): attention error against the bytes the cache holds, and against
//! the GPU time per step, one marker per configuration.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow};
use plotters::prelude::*;

/// One configuration of the sweep.
pub struct Point {
    pub label: String,
    /// Series it belongs to (a colour): the scheduler or codec family.
    pub series: String,
    pub kv_bytes: f64,
    pub gpu_ms: f64,
    pub error: f64,
}

fn register_font() -> Result<()> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, epaint_default_fonts::UBUNTU_LIGHT)
        .map_err(|_| anyhow!("the bundled font did not load"))
}

/// Write `quality_vs_bytes.png` and `quality_vs_time.png` into `dir`; points without an error
/// (the full cache) are drawn at the lowest error shown.
pub fn write(dir: &Path, title: &str, points: &[Point]) -> Result<Vec<PathBuf>> {
    if points.is_empty() {
        return Ok(Vec::new());
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    register_font()?;
    let mut out = Vec::new();
    for (file, xlabel, x_of) in [
        ("quality_vs_bytes.png", "K/V resident (MiB)", (|p: &Point| p.kv_bytes / 1048576.0) as fn(&Point) -> f64),
        ("quality_vs_time.png", "GPU time per decode step (ms)", |p: &Point| p.gpu_ms),
    ] {
        let path = dir.join(file);
        chart(&path, title, xlabel, "attention error (rel. L2, log)", 1e-3, points, x_of)
            .with_context(|| format!("drawing {}", path.display()))?;
        out.push(path);
    }
    Ok(out)
}

/// Write `perplexity_vs_bytes.png` into `dir` (`Point::error` holds the perplexity).
pub fn write_perplexity(dir: &Path, title: &str, points: &[Point]) -> Result<Vec<PathBuf>> {
    if points.is_empty() {
        return Ok(Vec::new());
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    register_font()?;
    let path = dir.join("perplexity_vs_bytes.png");
    chart(&path, title, "K/V pages in use (KiB)", "perplexity (log)", f64::INFINITY, points, |p: &Point| p.kv_bytes / 1024.0)
        .with_context(|| format!("drawing {}", path.display()))?;
    Ok(vec![path])
}

fn chart(path: &Path, title: &str, xlabel: &str, ylabel: &str, lo_cap: f64, points: &[Point], x_of: fn(&Point) -> f64) -> Result<()> {
    let errs: Vec<f64> = points.iter().map(|p| p.error).filter(|e| *e > 0.0 && e.is_finite()).collect();
    let y_lo = errs.iter().cloned().fold(f64::INFINITY, f64::min).min(lo_cap) / 2.0;
    let y_hi = errs.iter().cloned().fold(0.0, f64::max).max(y_lo * 10.0) * 2.0;
    let xs: Vec<f64> = points.iter().map(x_of).collect();
    let x_hi = xs.iter().cloned().fold(0.0, f64::max) * 1.1 + 1e-9;
    let root = BitMapBackend::new(path, (1000, 640)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(0.0..x_hi, (y_lo..y_hi).log_scale())
        .map_err(|e| anyhow!("{e}"))?;
    chart.configure_mesh().x_desc(xlabel).y_desc(ylabel).label_style(("sans-serif", 15)).draw().map_err(|e| anyhow!("{e}"))?;
    let mut series: Vec<&str> = points.iter().map(|p| p.series.as_str()).collect();
    series.dedup();
    series.sort_unstable();
    series.dedup();
    for (i, s) in series.iter().enumerate() {
        let colour = Palette99::pick(i).to_rgba();
        let pts: Vec<(f64, f64, &str)> = points
            .iter()
            .filter(|p| p.series == *s)
            .map(|p| (x_of(p), if p.error > 0.0 && p.error.is_finite() { p.error } else { y_lo * 1.01 }, p.label.as_str()))
            .collect();
        chart
            .draw_series(pts.iter().map(|&(x, y, _)| Circle::new((x, y), 6, colour.filled())))
            .map_err(|e| anyhow!("{e}"))?
            .label(*s)
            .legend(move |(x, y)| Circle::new((x, y), 6, colour.filled()));
        chart
            .draw_series(pts.iter().map(|&(x, y, l)| Text::new(l.to_string(), (x, y), ("sans-serif", 12).into_font())))
            .map_err(|e| anyhow!("{e}"))?;
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.9))
        .label_font(("sans-serif", 15))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}
