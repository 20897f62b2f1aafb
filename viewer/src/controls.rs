//! The run controls: pause, step, restart, and a new router, scheduler, codec, budget or
//! allocator given as the same text specs as the command line, parsed by core's parsers. The
//! viewer only asks ([`Request`]); the app loop that owns the pipeline acts.

use expertkv_core::config::Codec;
use expertkv_core::evict::config::{EkvaConfig, SchedulerConfig};
use expertkv_core::pipeline::DemoConfig;
use expertkv_core::route::config::RouterConfig;

/// What the person asked the app loop to do.
#[derive(Clone, Debug)]
pub enum Request {
    /// Run steps continuously (`true`) or hold (`false`).
    SetRunning(bool),
    /// Run one step (while paused).
    Step,
    /// Rebuild the pipeline with the same configuration and start over.
    Restart,
    /// Rebuild the pipeline with this configuration and start over.
    Rebuild(Box<DemoConfig>),
}

/// A parsed change of router, scheduler, codec, budget and allocator.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigEdit {
    /// The router the rebuilt pipeline routes with.
    pub router: RouterConfig,
    /// The scheduler; `None` (spec `none`): the full cache.
    pub scheduler: Option<SchedulerConfig>,
    /// How full pages are stored; [`Codec::None`]: raw.
    pub codec: Codec,
    /// Tokens each page list keeps, as [`DemoConfig::budget`] reads it: a number or a share of the
    /// final context such as `25%`.
    pub budget: String,
    /// The EKVA allocator; `None` (spec `none`): expert-blind budgets.
    pub allocator: Option<EkvaConfig>,
}

impl ConfigEdit {
    /// Parse the five specs (`scheduler` and `allocator` take `none`).
    pub fn parse(router: &str, scheduler: &str, codec: &str, budget: &str, allocator: &str) -> Result<ConfigEdit, String> {
        let scheduler = match scheduler.trim() {
            "none" | "" => None,
            s => Some(SchedulerConfig::parse(s).map_err(|e| e.to_string())?),
        };
        Ok(ConfigEdit {
            router: RouterConfig::parse(router.trim()).map_err(|e| e.to_string())?,
            scheduler,
            codec: Codec::parse(codec.trim()).map_err(|e| e.to_string())?,
            budget: budget.trim().to_string(),
            allocator: EkvaConfig::parse(allocator.trim()).map_err(|e| e.to_string())?,
        })
    }

    /// `base` with this edit, checked the way the command line checks it.
    pub fn apply(&self, base: &DemoConfig) -> Result<DemoConfig, String> {
        let mut c = base.clone();
        c.router = self.router.clone();
        c.scheduler = self.scheduler.clone();
        c.codec = self.codec;
        c.budget = self.budget.clone();
        c.allocator = self.allocator;
        c.router.validate(c.workload.n_experts, c.workload.top_k).map_err(|e| e.to_string())?;
        c.budget_tokens().map_err(|e| e.to_string())?;
        c.layer_budgets().map_err(|e| e.to_string())?;
        c.pool_config().validate().map_err(|e| e.to_string())?;
        Ok(c)
    }
}

/// `name:key=value,...` (the form core's `parse` reads back) of a config whose serde form is
/// tagged by `name` with its parameters as fields (the parse keys are the field names).
fn spec_of(name: &str, v: Option<serde_json::Value>) -> String {
    let params: Vec<String> = v
        .as_ref()
        .and_then(|v| v.as_object())
        .map(|o| o.iter().filter(|(k, _)| k.as_str() != "name").map(|(k, v)| format!("{k}={v}")).collect())
        .unwrap_or_default();
    if params.is_empty() { name.to_string() } else { format!("{name}:{}", params.join(",")) }
}

/// `r` as its command-line spec, `name:key=value,...`, which [`RouterConfig::parse`] reads back.
pub fn router_spec(r: &RouterConfig) -> String {
    spec_of(r.name(), serde_json::to_value(r).ok())
}

/// `s` as its command-line spec (`none` without a scheduler), which [`SchedulerConfig::parse`]
/// reads back.
pub fn scheduler_spec(s: Option<&SchedulerConfig>) -> String {
    s.map_or_else(|| "none".into(), |s| spec_of(s.name(), serde_json::to_value(s).ok()))
}

/// `a` as its command-line spec ([`EkvaConfig::spec`]; `none` without the allocator).
pub fn allocator_spec(a: Option<&EkvaConfig>) -> String {
    a.map_or_else(|| "none".into(), EkvaConfig::spec)
}

/// The controls' own state: whether steps run, and the text of each spec field.
#[derive(Clone, Debug, PartialEq)]
pub struct Controls {
    /// Whether steps run continuously; otherwise they wait for Step or Run.
    pub running: bool,
    /// Text of the router field: a router spec such as `cache-aware:lambda=2.0`.
    pub router: String,
    /// Text of the scheduler field: a scheduler spec, or `none`.
    pub scheduler: String,
    /// Text of the codec field: a codec spec, or `none`.
    pub codec: String,
    /// Text of the budget field: tokens per page list, or a share such as `25%`.
    pub budget: String,
    /// Text of the allocator field: an EKVA spec, or `none`.
    pub allocator: String,
    /// Why the last Apply was refused.
    pub error: Option<String>,
    /// Why the configuration cannot change (a replayed trace fixes it).
    pub locked: Option<String>,
}

impl Controls {
    /// Controls showing `cfg`'s specs, with steps running from the start when `running`.
    pub fn new(cfg: &DemoConfig, running: bool) -> Controls {
        let mut c = Controls {
            running,
            router: String::new(),
            scheduler: String::new(),
            codec: String::new(),
            budget: String::new(),
            allocator: String::new(),
            error: None,
            locked: None,
        };
        c.load(cfg);
        c
    }

    /// Show `cfg`'s specs in the fields.
    pub fn load(&mut self, cfg: &DemoConfig) {
        self.router = router_spec(&cfg.router);
        self.scheduler = scheduler_spec(cfg.scheduler.as_ref());
        self.codec = cfg.codec.spec();
        self.budget = cfg.budget.clone();
        self.allocator = allocator_spec(cfg.allocator.as_ref());
    }

    /// The configuration the fields describe, over `base`.
    pub fn edited(&self, base: &DemoConfig) -> Result<DemoConfig, String> {
        ConfigEdit::parse(&self.router, &self.scheduler, &self.codec, &self.budget, &self.allocator)?.apply(base)
    }

    /// Draw the controls; returns what was asked. `base`: the configuration being run.
    pub fn ui(&mut self, ui: &mut egui::Ui, base: Option<&DemoConfig>) -> Vec<Request> {
        let mut out = Vec::new();
        ui.horizontal_wrapped(|ui| {
            let label = if self.running { "Pause" } else { "Run" };
            if ui.button(label).on_hover_text("run steps continuously, or hold").clicked() {
                self.running = !self.running;
                out.push(Request::SetRunning(self.running));
            }
            if ui.add_enabled(!self.running, egui::Button::new("Step")).on_hover_text("one decode step").clicked() {
                out.push(Request::Step);
            }
            if ui.button("Restart").on_hover_text("rebuild the pipeline and prefill again").clicked() {
                out.push(Request::Restart);
            }
            ui.separator();
            let editable = self.locked.is_none() && base.is_some();
            ui.add_enabled_ui(editable, |ui| {
                for (name, text, width) in [
                    ("router", &mut self.router, 170.0),
                    ("scheduler", &mut self.scheduler, 160.0),
                    ("codec", &mut self.codec, 100.0),
                    ("budget", &mut self.budget, 44.0),
                    ("allocator", &mut self.allocator, 236.0),
                ] {
                    let label = ui.label(name);
                    ui.add(egui::TextEdit::singleline(text).desired_width(width)).labelled_by(label.id);
                }
                if ui.button("Apply").on_hover_text("rebuild the pipeline with these specs").clicked()
                    && let Some(base) = base
                {
                    match self.edited(base) {
                        Ok(cfg) => {
                            self.error = None;
                            out.push(Request::Rebuild(Box::new(cfg)));
                        }
                        Err(e) => self.error = Some(e),
                    }
                }
            });
        });
        if let Some(l) = &self.locked {
            ui.weak(l.as_str());
        }
        if let Some(e) = &self.error {
            ui.colored_label(egui::Color32::from_rgb(230, 90, 80), e.as_str());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_round_trip_through_the_parsers() {
        let cfg = DemoConfig::default();
        let c = Controls::new(&cfg, true);
        assert_eq!(c.router, "cache-aware:lambda=2.0");
        assert_eq!(RouterConfig::parse(&c.router).expect("router"), cfg.router);
        assert_eq!(SchedulerConfig::parse(&c.scheduler).expect("scheduler"), cfg.scheduler.clone().expect("h2o"));
        let json = |c: &DemoConfig| serde_json::to_string(c).expect("json");
        assert_eq!(json(&c.edited(&cfg).expect("same config")), json(&cfg));
        for r in ["hash", "adaptive:lr=1.5,kappa=0.5", "hierarchical:groups=4,topk_groups=2"] {
            let parsed = RouterConfig::parse(r).expect("router");
            assert_eq!(RouterConfig::parse(&router_spec(&parsed)).expect("round trip"), parsed);
        }
        for s in ["streaming-llm:sinks=8", "adakv:floor=0.3", "lru-plus:w_freq=0.5", "duo:tau=0.25", "quest", "fastv-tokens:from_layer=1"] {
            let parsed = SchedulerConfig::parse(s).expect("scheduler");
            assert_eq!(SchedulerConfig::parse(&scheduler_spec(Some(&parsed))).expect("round trip"), parsed);
        }
    }

    #[test]
    fn edits_are_parsed_and_checked() {
        let base = DemoConfig::default();
        let cfg = ConfigEdit::parse("topk", "streaming-llm:sinks=8", "none", "10%", "ekva:floor=0.5").and_then(|e| e.apply(&base));
        let cfg = cfg.expect("valid edit");
        assert_eq!(cfg.router, RouterConfig::Topk);
        assert_eq!(cfg.scheduler, Some(SchedulerConfig::StreamingLlm { sinks: 8 }));
        assert_eq!(cfg.budget, "10%");
        assert_eq!(cfg.allocator.map(|a| a.floor), Some(0.5));
        assert_eq!(cfg.workload.n_seqs, base.workload.n_seqs);
        for bad in [("nope", "h2o", "none", "25%", "none"), ("topk", "h2o", "int9", "25%", "none"), ("topk", "h2o", "none", "lots", "none")]
        {
            let r = ConfigEdit::parse(bad.0, bad.1, bad.2, bad.3, bad.4).and_then(|e| e.apply(&base));
            assert!(r.is_err(), "{bad:?} must be refused");
        }
    }
}
