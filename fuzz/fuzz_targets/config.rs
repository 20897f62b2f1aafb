//! Demo configuration files (TOML, `expertkv demo --config`) on arbitrary text, through the
//! checks `demo` runs before any GPU work: the workload, the router, the budget, every layer's
//! budget and the pool's configuration.
#![no_main]

use expertkv_core::pipeline::DemoConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(cfg) = toml::from_str::<DemoConfig>(text) else { return };
    if cfg.workload.validate().is_err() || cfg.router.validate(cfg.workload.n_experts, cfg.workload.top_k).is_err() {
        return;
    }
    if cfg.budget_tokens().is_err() || cfg.layer_budgets().is_err() {
        return;
    }
    let _ = cfg.pool_config().validate();
});
