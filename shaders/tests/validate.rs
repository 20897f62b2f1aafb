#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Every WGSL file, resolved exactly as the runtime resolves it, must parse and validate with
//! naga (all validation flags, all capabilities the kernel may use). Needs no GPU: a broken
//! shader fails here even if no test dispatches it.

use std::path::Path;

use expertkv_shaders::{ALL_SOURCES, Kernel, expects, resolve};

fn validate(path: &str, text: &str) -> Result<(), String> {
    let module = naga::front::wgsl::parse_str(text).map_err(|e| format!("{path}: parse error:\n{}", e.emit_to_string(text)))?;
    let caps = naga::valid::Capabilities::all();
    naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps)
        .subgroup_stages(naga::valid::ShaderStages::COMPUTE)
        .subgroup_operations(naga::valid::SubgroupOperationSet::all())
        .validate(&module)
        .map_err(|e| format!("{path}: validation error:\n{}", e.emit_to_string(text)))?;
    Ok(())
}

#[test]
fn every_kernel_validates_with_naga() {
    let mut failures = Vec::new();
    for kernel in Kernel::ALL {
        let text = kernel.resolved().expect("imports resolve");
        if let Err(e) = validate(kernel.label(), &text) {
            failures.push(e);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn every_wgsl_file_validates_with_naga() {
    // Shared pieces validate on their own too, behind what they expect of their importers.
    let mut failures = Vec::new();
    for source in ALL_SOURCES {
        let mut text: String = expects(*source).iter().map(|e| format!("{e}\n")).collect();
        text.push_str(&resolve(*source).expect("imports resolve"));
        if let Err(e) = validate(source.path, &text) {
            failures.push(e);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn every_wgsl_file_on_disk_is_embedded() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("wgsl");
    let mut on_disk = Vec::new();
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read wgsl dir") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "wgsl") {
                let rel = path.strip_prefix(&root).expect("under root").to_string_lossy().replace('\\', "/");
                on_disk.push(rel);
            }
        }
    }
    for path in &on_disk {
        assert!(ALL_SOURCES.iter().any(|s| s.path == path), "{path} is not embedded in expertkv-shaders");
    }
    assert_eq!(on_disk.len(), ALL_SOURCES.len());
}

#[test]
fn subgroup_attention_validates_for_every_shape_knob() {
    // Its `//!define`s change array sizes and branches: validate a spread of them.
    let mut failures = Vec::new();
    for group in [1u32, 2, 3, 4, 8] {
        for (lanes, vpl, f16) in [(16u32, 1u32, true), (8, 2, true), (16, 2, false), (8, 4, false)] {
            for u in [1u32, 4, 8] {
                for transpose in [true, false] {
                    let defines = [
                        ("GROUP", format!("{group}u")),
                        ("LANES", format!("{lanes}u")),
                        ("VPL", format!("{vpl}u")),
                        ("F16", f16.to_string()),
                        ("U", format!("{u}u")),
                        ("TRANSPOSE", (transpose && group.is_power_of_two()).to_string()),
                    ];
                    let text = Kernel::AttendSplitSubgroup.resolved_with(&defines).expect("defines resolve");
                    if let Err(e) = validate(&format!("attend/split_subgroup.wgsl {defines:?}"), &text) {
                        failures.push(e);
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn quantised_attention_validates_for_every_shape_knob() {
    let mut failures = Vec::new();
    for group in [1u32, 3, 4, 8] {
        for (lanes, bits, d) in [(16u32, 4u32, 128u32), (8, 4, 128), (16, 8, 128), (8, 8, 64), (16, 8, 256), (8, 4, 64)] {
            for u in [1u32, 4, 8] {
                for transpose in [true, false] {
                    let defines = [
                        ("GROUP", format!("{group}u")),
                        ("LANES", format!("{lanes}u")),
                        ("BITS", format!("{bits}u")),
                        ("HEAD_DIM", format!("{d}u")),
                        ("U", format!("{u}u")),
                        ("TRANSPOSE", (transpose && group.is_power_of_two() && group <= lanes).to_string()),
                    ];
                    let text = Kernel::AttendSplitQuant.resolved_with(&defines).expect("defines resolve");
                    if let Err(e) = validate(&format!("attend/split_quant.wgsl {defines:?}"), &text) {
                        failures.push(e);
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn quantised_tile_attention_validates_for_every_shape_knob() {
    let mut failures = Vec::new();
    for group in [1u32, 2, 3, 4, 5, 8] {
        for (d, ng) in [(32u32, 1u32), (32, 4), (64, 2), (64, 8), (128, 4), (128, 8), (128, 2)] {
            if ng * group.div_ceil(4) > 8 {
                continue;
            }
            for (p, wg) in [(16u32, 128u32), (32, 128), (64, 128), (128, 128), (16, 32), (32, 32), (32, 64), (64, 64)] {
                // KSIGNED and PS_EARLY in all four pairings, the defaults (both on) among them.
                for (raw, flush, fc, denorm, ksigned, ps_early) in [
                    (true, 1u32, 16u32, false, false, false),
                    (false, 3, 8, true, true, true),
                    (true, 2, 8, true, true, false),
                    (false, 1, 16, false, false, true),
                ] {
                    let defines = [
                        ("PS_EARLY", ps_early.to_string()),
                        ("DENORM", denorm.to_string()),
                        ("KSIGNED", ksigned.to_string()),
                        ("FC", format!("{fc}u")),
                        ("WG", format!("{wg}u")),
                        ("GROUP", format!("{group}u")),
                        ("HEAD_DIM", format!("{d}u")),
                        ("PAGE_SIZE", format!("{p}u")),
                        ("NG", format!("{ng}u")),
                        ("FLUSH", format!("{flush}u")),
                        ("RAW", raw.to_string()),
                    ];
                    let text = Kernel::AttendSplitQuantTile.resolved_with(&defines).expect("defines resolve");
                    if let Err(e) = validate(&format!("attend/split_quant_tile.wgsl {defines:?}"), &text) {
                        failures.push(e);
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn quantised_coop_attention_validates_for_every_shape_knob() {
    let mut failures = Vec::new();
    for group in [1u32, 2, 3, 4, 5, 8] {
        for (d, ng) in [(32u32, 1u32), (32, 2), (64, 1), (64, 4), (128, 1), (128, 2), (128, 8)] {
            for (p, nw) in [(16u32, 1u32), (32, 2), (64, 4), (64, 1), (128, 4), (128, 2)] {
                let defines = [
                    ("GROUP", format!("{group}u")),
                    ("HEAD_DIM", format!("{d}u")),
                    ("PAGE_SIZE", format!("{p}u")),
                    ("NG", format!("{ng}u")),
                    ("NW", format!("{nw}u")),
                    ("SLACK", "0.5".to_string()),
                ];
                let text = Kernel::AttendSplitQuantCoop.resolved_with(&defines).expect("defines resolve");
                if let Err(e) = validate(&format!("attend/split_quant_coop.wgsl {defines:?}"), &text) {
                    failures.push(e);
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn route_topk_validates_for_every_define() {
    let mut failures = Vec::new();
    for k in 1u32..=8 {
        for groups in [1u32, 3, 8] {
            for vec4 in [true, false] {
                let defines = [("K", format!("{k}u")), ("TOPK_GROUPS", format!("{groups}u")), ("E_VEC4", vec4.to_string())];
                let text = Kernel::RouteTopk.resolved_with(&defines).expect("defines resolve");
                if let Err(e) = validate(&format!("route/topk.wgsl {defines:?}"), &text) {
                    failures.push(e);
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn model_kernels_validate_for_every_weight_format() {
    let mut failures = Vec::new();
    // FORMAT_* of common/quant.wgsl: F32, Q8_0, Q4_1, F16, BF16, Q4_0, Q4_K, Q5_K, Q6_K.
    for kernel in [
        Kernel::ModelMatVec,
        Kernel::ModelMatMul,
        Kernel::ModelEmbed,
        Kernel::ModelMoeGateUp,
        Kernel::ModelMoeDown,
        Kernel::ModelMoeGateUpTiled,
        Kernel::ModelMoeDownTiled,
    ] {
        for format in 0..9u32 {
            let text = kernel.resolved_with(&[("FORMAT", format!("{format}u"))]).expect("defines resolve");
            if let Err(e) = validate(&format!("{} FORMAT={format}", kernel.label()), &text) {
                failures.push(e);
            }
        }
    }
    // The one-token matrix-vector kernel (a decode step at batch 1).
    for format in 0..9u32 {
        let text =
            Kernel::ModelMatVec.resolved_with(&[("FORMAT", format!("{format}u")), ("MAX_TOKENS", "1u".into())]).expect("defines resolve");
        if let Err(e) = validate(&format!("model/matvec.wgsl FORMAT={format} MAX_TOKENS=1"), &text) {
            failures.push(e);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// Workgroup memory a kernel declares, in bytes (naga's layout of its `var<workgroup>`s).
fn workgroup_bytes(text: &str) -> u32 {
    let module = naga::front::wgsl::parse_str(text).expect("parses");
    let mut layouter = naga::proc::Layouter::default();
    layouter.update(module.to_ctx()).expect("layout");
    module.global_variables.iter().filter(|(_, g)| g.space == naga::AddressSpace::WorkGroup).map(|(_, g)| layouter[g.ty].size).sum()
}

/// The model's kernels run wherever the model loads, the browser included: each fits WebGPU's
/// default 16 KiB of workgroup memory in every weight format (a device with no more than that
/// must still load a model).
#[test]
fn model_kernels_fit_webgpus_default_workgroup_memory() {
    let model = [
        Kernel::ModelMatVec,
        Kernel::ModelMatMul,
        Kernel::ModelEmbed,
        Kernel::ModelMoeGateUp,
        Kernel::ModelMoeDown,
        Kernel::ModelMoeDownQ,
        Kernel::ModelMoeGroup,
        Kernel::ModelMoeGateUpTiled,
        Kernel::ModelMoeDownTiled,
        Kernel::ModelMoeCombine,
        Kernel::ModelRmsNorm,
        Kernel::ModelRopeQk,
        Kernel::ModelKvPack,
        Kernel::ModelMoeTopk,
        Kernel::ModelMoeWeights,
    ];
    for kernel in model {
        for format in 0..9u32 {
            let text = kernel.resolved_with(&[("FORMAT", format!("{format}u"))]).or_else(|_| kernel.resolved()).expect("resolves");
            let bytes = workgroup_bytes(&text);
            assert!(bytes <= 16_384, "{} FORMAT={format}: {bytes} bytes of workgroup memory", kernel.label());
        }
    }
}

/// Decimal float literals of every WGSL file, as written.
fn float_literals(text: &str) -> Vec<String> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let starts = b[i].is_ascii_digit() && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_' || b[i - 1] == b'.'));
        if !starts {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len()
            && (b[i].is_ascii_alphanumeric() || b[i] == b'.' || ((b[i] == b'-' || b[i] == b'+') && matches!(b[i - 1], b'e' | b'E')))
        {
            i += 1;
        }
        let lit = &text[start..i];
        if (lit.contains('.') || lit.contains(['e', 'E'])) && !lit.starts_with("0x") {
            out.push(lit.trim_end_matches(['f', 'h']).to_string());
        }
    }
    out
}

/// Browsers' WGSL compilers (Tint, Naga in Firefox) refuse a literal beyond f32's range even
/// where it would round to f32::MAX (naga here accepts it): `-3.4028235e38` broke a kernel in
/// Chromium. Every literal must lie within the range as written.
#[test]
fn every_float_literal_lies_in_f32_range() {
    let mut bad = Vec::new();
    let mut seen = 0;
    for source in ALL_SOURCES {
        for lit in float_literals(source.text) {
            let Ok(v) = lit.parse::<f64>() else { continue };
            seen += 1;
            if v.abs() > f64::from(f32::MAX) {
                bad.push(format!("{}: {lit}", source.path));
            }
        }
    }
    assert!(seen > 50, "only {seen} float literals found: the scan is broken");
    assert!(bad.is_empty(), "literals beyond f32's range: {bad:?}");
    assert_eq!(float_literals("let a = 1.5e-3; let b = x2.0; let c = 3.4028235e38f;"), ["1.5e-3", "3.4028235e38"]);
}
