use anyhow::Result;
use clap::Args;
use serde_json::json;

use crate::GpuArgs;
use crate::fmt_bytes;

#[derive(Args)]
pub struct InfoArgs {
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(gpu: &GpuArgs, a: &InfoArgs) -> Result<()> {
    let opts = gpu.options()?;
    let adapters = pollster::block_on(expertkv_core::runtime::list_adapters(opts.backends));
    let listed: Vec<_> = adapters
        .iter()
        .map(|ad| {
            let i = ad.get_info();
            json!({"name": i.name, "backend": format!("{:?}", i.backend), "type": format!("{:?}", i.device_type), "driver": i.driver, "driver_info": i.driver_info})
        })
        .collect();
    let rt = gpu.runtime()?;
    let features: Vec<String> = rt.device.features().iter_names().map(|(n, _)| n.to_owned()).collect();
    // The probe kernel's answer (a dispatch, once): whether the tile kernel's codes may be subnormal f16.
    let subnormals = pollster::block_on(rt.f16_subnormals())?;
    if a.json {
        let out = json!({
            "adapters": listed,
            "chosen": {
                "name": rt.info.name, "backend": format!("{:?}", rt.info.backend), "type": format!("{:?}", rt.info.device_type),
                "driver": rt.info.driver, "driver_info": rt.info.driver_info,
            },
            "tier": rt.tier.name(),
            "shader_checks": rt.checks.name(),
            "capabilities": rt.caps,
            "f16_subnormals": subnormals,
            "features": features,
            "limits": {
                "max_storage_buffer_binding_size": rt.limits.max_storage_buffer_binding_size,
                "max_buffer_size": rt.limits.max_buffer_size,
                "max_storage_buffers_per_shader_stage": rt.limits.max_storage_buffers_per_shader_stage,
                "max_compute_workgroup_storage_size": rt.limits.max_compute_workgroup_storage_size,
                "max_compute_invocations_per_workgroup": rt.limits.max_compute_invocations_per_workgroup,
                "max_compute_workgroups_per_dimension": rt.limits.max_compute_workgroups_per_dimension,
            },
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("adapters:");
    for (i, ad) in adapters.iter().enumerate() {
        let inf = ad.get_info();
        println!("  [{i}] {} ({:?}, {:?}) driver {} {}", inf.name, inf.backend, inf.device_type, inf.driver, inf.driver_info);
    }
    let c = &rt.caps;
    println!("chosen: {} ({:?}, {:?})", rt.info.name, rt.info.backend, rt.info.device_type);
    println!("tier: {}   shader checks: {}", rt.tier.name(), rt.checks.name());
    println!(
        "capabilities: f16 {} (subnormals {})  subgroups {} (size {}..{})  timestamps {} ({} ns/tick)",
        c.f16,
        match (c.f16, subnormals) {
            (false, _) => "n/a",
            (true, true) => "kept",
            (true, false) => "flushed",
        },
        c.subgroups,
        c.subgroup_min_size,
        c.subgroup_max_size,
        c.timestamps,
        c.timestamp_period_ns
    );
    println!(
        "limits: storage binding {}  buffer {}  storage buffers/stage {}  workgroup storage {}  invocations/workgroup {}",
        fmt_bytes(c.max_storage_binding_bytes),
        fmt_bytes(c.max_buffer_bytes),
        c.max_storage_buffers_per_stage,
        fmt_bytes(u64::from(c.max_workgroup_storage_bytes)),
        c.max_invocations_per_workgroup
    );
    println!("features: {}", features.join(", "));
    Ok(())
}
