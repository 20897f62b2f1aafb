#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Headless tests of the viewer on real pipeline state: a small pipeline (2 sequences x 2
//! layers, prompt 128, H2O at 25% with the EKVA allocator, fixed seed) runs prefill and a few
//! decode steps on the GPU adapter (Mesa lavapipe where there is no GPU), its snapshots feed the
//! viewer, and egui_kittest renders the panels with wgpu and compares them with the images under
//! `tests/snapshots/` (`UPDATE_SNAPSHOTS=1` rewrites them; keep them made on lavapipe).
//!
//! GPU stage times change from run to run, so the snapshots draw the step-time panel from fixed
//! times (the real ones are checked on their own); host times are never drawn. The README's
//! docs/viewer.png comes from `cargo run -p expertkv-viewer --example screenshot -- docs/viewer.png`.

use std::sync::OnceLock;

use egui_kittest::Harness;
use egui_kittest::kittest::Queryable;
use expertkv_core::evict::config::{EkvaConfig, SchedulerConfig};
use expertkv_core::pipeline::{DemoConfig, Pipeline, StageTimes};
use expertkv_core::runtime::{Runtime, RuntimeOptions};
use expertkv_core::workload::WorkloadConfig;
use expertkv_viewer::state::{HeatMode, STAGES, Source, stage_segments};
use expertkv_viewer::{Event, Request, RunInfo, Snapshot, Viewer, ViewerState, capture, panels};

const STEPS: u32 = 6;
const WINDOW: egui::Vec2 = egui::vec2(1320.0, 900.0);

struct Run {
    info: RunInfo,
    /// Whether the pipeline ran on lavapipe, where the snapshots were made.
    lavapipe: bool,
    snaps: Vec<Snapshot>,
}

fn config() -> DemoConfig {
    DemoConfig {
        workload: WorkloadConfig { seed: 7, n_seqs: 2, layers: 2, prompt_len: 128, ..Default::default() },
        steps: STEPS,
        scheduler: Some(SchedulerConfig::H2o { sinks: 4, window: 32 }),
        budget: "25%".into(),
        allocator: Some(EkvaConfig::default()),
        verify: false,
        ..Default::default()
    }
}

/// Lavapipe when it is there (the snapshots are made on it), else whatever adapter the
/// environment picks.
fn runtime() -> Runtime {
    let mut opts = RuntimeOptions::from_env().expect("EXPERTKV_* environment variables");
    if opts.adapter.is_none() {
        let lavapipe = RuntimeOptions { adapter: Some("llvmpipe".into()), ..opts.clone() };
        if let Ok(rt) = pollster::block_on(Runtime::new(lavapipe)) {
            return rt;
        }
        opts.adapter = None;
    }
    pollster::block_on(Runtime::new(opts))
        .unwrap_or_else(|e| panic!("these tests need a GPU adapter (scripts/test.sh installs Mesa lavapipe when none exists): {e}"))
}

/// The pipeline's state after prefill and every decode step, captured once for all tests.
fn run() -> &'static Run {
    static RUN: OnceLock<Run> = OnceLock::new();
    RUN.get_or_init(|| {
        let rt = runtime();
        let mut p = pollster::block_on(Pipeline::new(&rt, config())).expect("pipeline");
        let info = capture::run_info(&rt, &p, Source::Live);
        pollster::block_on(p.prefill(&rt, &mut |_, _| {})).expect("prefill");
        let snaps = (0..STEPS)
            .map(|_| {
                let report = pollster::block_on(p.step(&rt)).expect("step");
                pollster::block_on(capture::capture(&rt, &p, report)).expect("capture")
            })
            .collect();
        Run { lavapipe: rt.info.name.contains("llvmpipe"), info, snaps }
    })
}

/// Stage times that do not change between runs, different per step.
fn fixed_times(step: u32) -> StageTimes {
    let s = f64::from(step);
    StageTimes {
        route_ms: 0.4,
        append_ms: 0.6 + 0.05 * s,
        compress_ms: 0.1,
        gather_ms: 0.3,
        attend_ms: 3.0 + 0.25 * s,
        evict_ms: 1.2,
        miss_ms: 0.2,
    }
}

/// The viewer state of the run; `deterministic`: stage times fixed, host times zero and the
/// adapter named plainly, so that renders do not change from run to run.
fn state(deterministic: bool) -> ViewerState {
    let r = run();
    let mut s = ViewerState::default();
    let mut info = r.info.clone();
    if deterministic {
        info.adapter = "lavapipe".into();
    }
    s.apply(Event::Started(Box::new(info)));
    for snap in &r.snaps {
        let mut snap = snap.clone();
        if deterministic {
            snap.report.gpu = Some(fixed_times(snap.report.step));
            snap.report.host_ms = 0.0;
        }
        s.apply(Event::Step(Box::new(snap)));
    }
    s.apply(Event::Finished);
    s
}

fn viewer(deterministic: bool) -> Viewer {
    let mut v = Viewer::new(&config(), false);
    let s = state(deterministic);
    v.apply(Event::Started(Box::new(s.info.clone().expect("run info"))));
    v.state = s;
    v
}

/// Compare with `tests/snapshots/NAME.png` where the pipeline ran on lavapipe (the snapshots are
/// made there; another adapter may route or evict a tie differently), else only render and record
/// the comparison as skipped (`scripts/test.sh` fails on a skip its adapter's list does not expect).
fn snapshot<S>(h: &mut Harness<'_, S>, name: &str) {
    if run().lavapipe {
        h.snapshot(name);
    } else {
        h.render().unwrap_or_else(|e| panic!("{name}: {e}"));
        expertkv_tests::skip(
            &format!("viewer snapshot {name}"),
            "not compared (the snapshots are made on lavapipe; this run used another adapter)",
        );
    }
}

fn panel_harness<'a>(size: egui::Vec2, mut draw: impl FnMut(&mut egui::Ui) + 'a) -> Harness<'a> {
    Harness::builder().with_size(size).wgpu().build_ui(move |ui| {
        egui::CentralPanel::default().show(ui, |ui| draw(ui));
    })
}

#[test]
fn viewer_window_renders_real_pipeline_state() {
    let mut harness = Harness::builder().with_size(WINDOW).wgpu().build_ui_state(
        |ui, v: &mut Viewer| {
            v.ui(ui);
        },
        viewer(true),
    );
    harness.run();
    snapshot(&mut harness, "viewer_window");
}

#[test]
fn heat_grid_covers_every_layer_and_expert_in_each_mode() {
    let s = state(true);
    let cfg = config();
    let (layers, experts) = (cfg.workload.layers as usize, cfg.workload.n_experts as usize);
    let last = &s.latest.as_ref().expect("a step").report;
    for mode in HeatMode::ALL {
        let h = s.heat(mode).expect("grid");
        assert_eq!((h.rows, h.cols), (layers, experts), "{mode:?}");
        assert_eq!(h.values.len(), layers * experts, "{mode:?}: one cell per (layer, expert)");
        assert!(h.values.iter().all(|v| v.is_finite() && *v >= 0.0 && *v <= h.max), "{mode:?}: {:?}", h.values);
        match mode {
            // Each layer's moving-average routing shares sum to one.
            HeatMode::Routing => {
                for l in 0..layers {
                    let sum: f32 = h.values[l * experts..(l + 1) * experts].iter().sum();
                    assert!((sum - 1.0).abs() < 1e-3, "layer {l}: routing shares sum to {sum}");
                }
            }
            // The per-(layer, expert) cached tokens add up to the report's per-expert hits.
            HeatMode::Occupancy => {
                let cells: f64 = h.values.iter().map(|&v| f64::from(v)).sum();
                assert_eq!(cells, last.expert_hits.iter().sum::<u64>() as f64);
            }
            // Under a 25% budget most routed tokens are gone again.
            HeatMode::MissRate => {
                assert!(h.values.iter().any(|&v| v > 0.3), "{:?}", h.values);
                assert_eq!(h.max, 1.0);
            }
        }
    }
    let mut results = egui_kittest::SnapshotResults::new();
    for (mode, name) in
        [(HeatMode::Routing, "heat_routing"), (HeatMode::Occupancy, "heat_occupancy"), (HeatMode::MissRate, "heat_miss_rate")]
    {
        let mut m = mode;
        let mut h = panel_harness(egui::vec2(640.0, 150.0), |ui| panels::heat_panel(ui, &s, &mut m));
        h.run();
        snapshot(&mut h, name);
        results.extend_harness(&mut h);
    }
    results.unwrap();
}

#[test]
fn budget_split_accounts_for_every_list_budget() {
    let s = state(true);
    let info = s.info.as_ref().expect("info");
    let b = s.budget_split().expect("EKVA runs in this pipeline");
    let last = &s.latest.as_ref().expect("a step").report;
    assert_eq!(b.tokens.len(), config().workload.n_experts as usize);
    assert_eq!(b.total, last.expert_budget.iter().sum::<u64>());
    // EKVA splits every (layer, sequence, KV head) list's budget exactly over its experts.
    let lists = u64::from(info.pool.layers * info.pool.max_seqs * info.pool.kv_heads);
    assert_eq!(b.total, lists * u64::from(info.budget_tokens.expect("a budget")), "{:?}", b.tokens);
    assert!((b.shares.iter().sum::<f64>() - 1.0).abs() < 1e-9);
    assert_eq!(b.importance.len(), b.tokens.len());
    let mut h = panel_harness(egui::vec2(640.0, 130.0), |ui| panels::budget_panel(ui, &s));
    h.run();
    snapshot(&mut h, "budget_split");
}

#[test]
fn shard_rings_and_tiers_match_the_step_report() {
    let s = state(true);
    let info = s.info.as_ref().expect("info");
    let snap = s.latest.as_ref().expect("a step");
    let r = &snap.report;
    assert_eq!(snap.ring_pages.len() as u32, info.pool.n_keys());
    assert_eq!(snap.ring_pages.iter().sum::<u32>(), r.pages_in_use);
    let shards = info.pool.n_shards as usize;
    for (sh, &pages) in r.shard_pages.iter().enumerate() {
        let from_rings: u32 = snap.ring_pages.iter().skip(sh).step_by(shards).sum();
        assert_eq!(from_rings, pages, "shard {sh}");
    }
    assert!(snap.ring_pages.iter().all(|&p| p <= info.pool.ring_capacity));
    assert_eq!(snap.tiers.gpu_raw, u64::from(r.pages_in_use));
    assert_eq!(snap.tiers.host, 0);
    let (lists, cols, _, cap) = s.ring_fill().expect("rings");
    assert_eq!((lists * cols) as u32, info.pool.n_keys());
    assert_eq!(cap, info.pool.ring_capacity);
    let mut h = panel_harness(egui::vec2(640.0, 230.0), |ui| panels::shard_panel(ui, &s));
    h.run();
    snapshot(&mut h, "shard_occupancy");
}

#[test]
fn evictions_over_time_come_from_every_step() {
    let s = state(true);
    let ev = s.evictions();
    assert_eq!(ev.len(), STEPS as usize);
    assert_eq!(ev.iter().map(|e| e.0).collect::<Vec<_>>(), (0..STEPS).collect::<Vec<_>>());
    assert!(ev.iter().all(|&(_, n)| n > 0), "a 25% budget evicts every step: {ev:?}");
    let mut h = panel_harness(egui::vec2(640.0, 130.0), |ui| panels::evictions_panel(ui, &s));
    h.run();
    snapshot(&mut h, "evictions");
}

#[test]
fn step_time_panel_stacks_the_stages() {
    // The real GPU times: every stage measured, the stack is their sum (not drawn in a snapshot).
    let real = state(false);
    let times = real.step_times();
    assert_eq!(times.len(), STEPS as usize, "lavapipe has timestamp queries");
    for (step, t) in &times {
        let g = real.history.iter().find(|r| r.step == *step).and_then(|r| r.gpu.clone()).expect("times");
        let sum: f64 = t.iter().sum();
        let want = g.total_ms();
        assert!((sum - want).abs() < 1e-9 && sum > 0.0, "step {step}: {t:?}");
        assert!(t[4] > 0.0, "step {step}: attention takes time");
    }
    let mut h = panel_harness(egui::vec2(640.0, 160.0), |ui| panels::step_time_panel(ui, &real));
    h.run();
    h.render().expect("the panel renders with real times");
    // Fixed times: a deterministic picture of the stacked bars.
    let fixed = state(true);
    assert_eq!(stage_segments(&fixed_times(2)), [0.4, 0.7, 0.1, 0.3, 3.5, 1.2, 0.2]);
    assert_eq!(STAGES.len(), panels::STAGE_COLORS.len());
    let mut h = panel_harness(egui::vec2(640.0, 160.0), |ui| panels::step_time_panel(ui, &fixed));
    h.run();
    snapshot(&mut h, "step_times_fixed");
}

#[test]
fn controls_ask_for_pause_step_and_a_rebuilt_pipeline() {
    let mut harness = Harness::builder().with_size(WINDOW).wgpu().build_ui_state(
        |ui, (v, out): &mut (Viewer, Vec<Request>)| {
            out.extend(v.ui(ui));
        },
        (viewer(true), Vec::new()),
    );
    harness.run();
    // Opened paused: Run starts it, Pause holds it, Step asks for one step.
    harness.get_by_label("Run").click();
    harness.run();
    harness.get_by_label("Pause").click();
    harness.run();
    harness.get_by_label("Step").click();
    harness.run();
    let got: Vec<String> = harness.state().1.iter().map(|r| format!("{r:?}")).collect();
    assert_eq!(got, ["SetRunning(true)", "SetRunning(false)", "Step"]);
    // A new router and budget: parsed by core's parsers, handed over as a whole config.
    harness.state_mut().1.clear();
    harness.state_mut().0.controls.router = "topk".into();
    harness.state_mut().0.controls.budget = "40%".into();
    harness.get_by_label("Apply").click();
    harness.run();
    match harness.state().1.as_slice() {
        [Request::Rebuild(cfg)] => {
            assert_eq!(cfg.router, expertkv_core::route::config::RouterConfig::Topk);
            assert_eq!(cfg.budget, "40%");
            assert_eq!(cfg.workload.n_seqs, 2, "the rest of the run stays");
        }
        other => panic!("expected one rebuild, got {other:?}"),
    }
    // A spec core refuses: no request, the reason shown.
    harness.state_mut().1.clear();
    harness.state_mut().0.controls.router = "bogus".into();
    harness.get_by_label("Apply").click();
    harness.run();
    assert!(harness.state().1.is_empty());
    let err = harness.state().0.controls.error.clone().expect("an error");
    assert!(err.contains("bogus"), "{err}");
    harness.get_by_label_contains("bogus");
    // The heat grid's mode switch.
    harness.get_by_role_and_label(egui::accesskit::Role::Button, "miss rate").click();
    harness.run();
    assert_eq!(harness.state().0.heat_mode, HeatMode::MissRate);
}

/// A QUEST run (pages selected per query, nothing evicted) through the viewer: every panel
/// renders from its snapshots, the run line says what QUEST does, and the pool keeps every token.
#[test]
fn a_quest_run_renders_and_says_it_attends_a_whole_cache() {
    let cfg = DemoConfig {
        workload: WorkloadConfig { seed: 3, n_seqs: 2, layers: 2, prompt_len: 96, ..Default::default() },
        steps: 3,
        scheduler: Some(SchedulerConfig::Quest),
        budget: "32".into(),
        verify: false,
        ..Default::default()
    };
    let rt = runtime();
    let mut p = pollster::block_on(Pipeline::new(&rt, cfg.clone())).expect("pipeline");
    let mut s = ViewerState::default();
    s.apply(Event::Started(Box::new(capture::run_info(&rt, &p, Source::Live))));
    pollster::block_on(p.prefill(&rt, &mut |_, _| {})).expect("prefill");
    for _ in 0..cfg.steps {
        let report = pollster::block_on(p.step(&rt)).expect("step");
        assert_eq!(report.evicted, 0, "QUEST evicts nothing");
        s.apply(Event::Step(Box::new(pollster::block_on(capture::capture(&rt, &p, report)).expect("capture"))));
    }
    s.apply(Event::Finished);
    let mut v = Viewer::new(&cfg, false);
    v.apply(Event::Started(Box::new(s.info.clone().expect("run info"))));
    v.state = s;
    let mut harness = Harness::builder().with_size(WINDOW).wgpu().build_ui_state(
        |ui, v: &mut Viewer| {
            v.ui(ui);
        },
        v,
    );
    harness.run();
    harness.get_by_label_contains("quest attending 32 tokens/list (32) of a whole cache");
    harness.render().expect("the window renders");
}

/// A model's run as the viewer shows it (`expertkv view --model`; the driver's data path is
/// tested in the CLI crate): the header names the model and where its experts come from, the
/// generated text has its panel, and the controls say the configuration is fixed.
#[test]
fn a_model_run_shows_its_source_and_text() {
    let mut s = state(true);
    if let Some(info) = &mut s.info {
        info.source = Source::Model { path: "models/m.gguf".into(), labels: "the MoE file's router".into() };
    }
    if let Some(latest) = &mut s.latest {
        latest.text = Some("The capital of France is Paris.".into());
    }
    let mut v = Viewer::new(&config(), false);
    v.apply(Event::Started(Box::new(s.info.clone().expect("run info"))));
    assert!(v.controls.locked.as_deref().is_some_and(|l| l.contains("models/m.gguf")), "{:?}", v.controls.locked);
    v.state = s;
    let mut harness = Harness::builder().with_size(WINDOW).wgpu().build_ui_state(
        |ui, v: &mut Viewer| {
            v.ui(ui);
        },
        v,
    );
    harness.run();
    harness.get_by_label_contains("model models/m.gguf (experts: the MoE file's router)");
    harness.get_by_label_contains("The capital of France is Paris.");
    harness.render().expect("the window renders");
}

/// A MoE model's experts in tiers: the panel names the slots and the traffic, and draws every
/// layer's experts (fixed data: 3 of 8 slots over 3 layers, the step's 2 choices among them).
#[test]
fn expert_residency_panel_shows_the_slots_and_traffic() {
    let mut s = state(true);
    let (layers, experts) = (3, 8);
    let resident: Vec<bool> = (0..layers * experts).map(|i| [1, 5, 6].contains(&((i + i / experts) % experts))).collect();
    let chosen: Vec<bool> = (0..layers * experts).map(|i| [1, 6].contains(&((i + i / experts) % experts))).collect();
    if let Some(latest) = &mut s.latest {
        latest.residency = Some(expertkv_viewer::state::ExpertResidency {
            layers,
            experts,
            slots: 3,
            resident,
            chosen,
            step: [3, 3, 3 << 20],
            total: [120, 40, 40 << 20],
            bytes: [9 << 20, 24 << 20],
            prefetch: [0; 4],
            reuse: Vec::new(),
        });
    }
    let mut h = panel_harness(egui::vec2(640.0, 170.0), |ui| panels::residency_panel(ui, &s));
    h.run();
    h.get_by_label_contains("3 of 8 slots per layer on the GPU (9.0 MiB; every expert in host memory, 24.0 MiB)");
    h.get_by_label_contains("step: 3 hits, 3 misses, 3.0 MiB moved; run: 75% hits, 40.0 MiB moved");
    // Without tiers the panel says every expert is on the GPU.
    let plain = state(true);
    let mut p = panel_harness(egui::vec2(640.0, 60.0), |ui| panels::residency_panel(ui, &plain));
    p.run();
    p.get_by_label_contains("every expert on the GPU");
    // With prefetch and the run's reuse curve, two more lines (text only: the snapshot above
    // has neither).
    let mut more = state(true);
    if let (Some(latest), Some(r)) = (&mut more.latest, s.latest.as_ref().and_then(|l| l.residency.clone())) {
        latest.residency =
            Some(expertkv_viewer::state::ExpertResidency { prefetch: [2, 1, 40, 30], reuse: vec![(2, 0.3), (3, 0.44)], ..r });
    }
    let mut m = panel_harness(egui::vec2(640.0, 200.0), |ui| panels::residency_panel(ui, &more));
    m.run();
    m.get_by_label_contains("prefetch: 2 fetched ahead this step, 1 of them chosen; run: 40 ahead, 75% of them chosen");
    m.get_by_label_contains("an LRU cache of each size, on this run's routing: 2: 30%, 3: 44%");
    snapshot(&mut h, "expert_residency");
}
