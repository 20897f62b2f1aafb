//! expertkv in the browser: the synthetic-workload pipeline on WebGPU through wasm32, with the
//! viewer (`expertkv-viewer`, eframe's wgpu renderer) beside it on one canvas.
//!
//! The page (`web/www/index.html`) checks for WebGPU itself and says so when the browser has
//! none; otherwise it calls `start()`. One async task (`wasm_bindgen_futures::spawn_local`) owns
//! the [`Runtime`](expertkv_core::Runtime) and the [`Pipeline`](expertkv_core::pipeline::Pipeline):
//! it prefills, steps, captures a snapshot for the viewer after every step and folds the step's
//! decisions into a [`DecisionDigest`](expertkv_core::digest::DecisionDigest). The viewer runs in
//! eframe's frame loop and talks to that task through a shared queue (events one way, requests
//! the other), as the native shell talks to its worker thread. Progress and the checksum are
//! published on `window.expertkv` for the browser test (`scripts/web.sh test`), which compares
//! the checksum with the native run of the same configuration ([`BROWSER_TOML`]).
//!
//! On native targets this crate holds only the configuration and its tests.

use expertkv_core::pipeline::DemoConfig;

/// The browser demo's run, shared with the native check (`expertkv demo --config web/browser.toml`).
pub const BROWSER_TOML: &str = include_str!("../browser.toml");

/// [`BROWSER_TOML`] parsed and checked, with `steps` replaced when given.
pub fn browser_config(steps: Option<u32>) -> Result<DemoConfig, String> {
    let mut cfg: DemoConfig = toml::from_str(BROWSER_TOML).map_err(|e| format!("web/browser.toml: {e}"))?;
    if let Some(s) = steps {
        if s == 0 {
            return Err("steps must be at least 1".into());
        }
        cfg.steps = s;
    }
    cfg.workload.validate().map_err(|e| e.to_string())?;
    cfg.router.validate(cfg.workload.n_experts, cfg.workload.top_k).map_err(|e| e.to_string())?;
    cfg.budget_tokens().map_err(|e| e.to_string())?;
    cfg.pool_config().validate().map_err(|e| e.to_string())?;
    Ok(cfg)
}

/// The version string the page shows.
pub fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

#[cfg(target_arch = "wasm32")]
mod api;
#[cfg(target_arch = "wasm32")]
mod model_view;
#[cfg(target_arch = "wasm32")]
mod wasm;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_is_the_workspace_version() {
        assert_eq!(version(), "0.1.0");
    }

    #[test]
    fn the_browser_config_parses_and_fits_webgpu_defaults() {
        let cfg = browser_config(None).expect("web/browser.toml");
        assert!(!cfg.verify, "the page has no time for the CPU lockstep");
        assert!(cfg.scheduler.is_some(), "the demo should show evictions");
        let pool = cfg.pool_config();
        // WebGPU's default binding limit (128 MiB) must hold the pool without asking for more.
        assert!(pool.n_ids() as u64 * pool.page_bytes() < 128 << 20);
        assert_eq!(browser_config(Some(3)).expect("steps").steps, 3);
        assert!(browser_config(Some(0)).is_err());
    }
}
