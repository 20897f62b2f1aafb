//! The tensor cores through wgpu's experimental cooperative matrices (native only): times
//! `shaders/wgsl/bench/coop.wgsl` (16 x 16 x 16 f16 products accumulated in f32, four
//! independent accumulators per subgroup-sized workgroup) and checks every accumulator against
//! the product computed on the CPU (exact: small integers; column-major, as naga loads). Prints
//! TFLOP/s, or why the adapter cannot run it.
//!
//! `cargo run --release -p expertkv --example coop_probe -- [WORKGROUPS] [ITERS]`

use anyhow::{Context, Result, bail};
use expertkv_shaders::Kernel;
use wgpu::util::DeviceExt;

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let groups: u32 = args.next().map_or(Ok(132 * 32), |a| a.parse()).context("WORKGROUPS: an integer")?;
    let iters: u32 = args.next().map_or(Ok(4096), |a| a.parse()).context("ITERS: an integer")?;
    if groups == 0 || groups > 65535 || iters == 0 {
        bail!("WORKGROUPS must be in 1..=65535 and ITERS at least 1");
    }
    pollster::block_on(run(groups, iters))
}

async fn run(groups: u32, iters: u32) -> Result<()> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle());
    let adapter = instance.request_adapter(&wgpu::RequestAdapterOptions::default()).await.context("no adapter")?;
    let name = adapter.get_info().name;
    let want = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX | wgpu::Features::SHADER_F16;
    if !adapter.features().contains(want) {
        println!("{name}: no cooperative matrices with f16 in wgpu (features {:?})", adapter.features() & want);
        return Ok(());
    }
    let shapes = adapter.cooperative_matrix_properties();
    if !shapes.iter().any(|p| {
        (p.m_size, p.n_size, p.k_size) == (16, 16, 16)
            && p.ab_type == wgpu::CooperativeScalarType::F16
            && p.cr_type == wgpu::CooperativeScalarType::F32
    }) {
        println!("{name}: no 16 x 16 x 16 f16 -> f32 shape ({} shapes offered)", shapes.len());
        return Ok(());
    }
    let (device, queue) = adapter
        .request_device(&wgpu::DeviceDescriptor {
            label: Some("coop probe"),
            required_features: want,
            // SAFETY: the experimental cooperative-matrix feature may hold wgpu bugs; this probe
            // checks its every output against the CPU.
            experimental_features: unsafe { wgpu::ExperimentalFeatures::enabled() },
            ..Default::default()
        })
        .await?;
    let text = Kernel::BenchCoop.resolved_with(&[("ITERS", format!("{iters}u"))]).map_err(|e| anyhow::anyhow!("{e}"))?;
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("bench/coop.wgsl"),
        source: wgpu::ShaderSource::Wgsl(text.into()),
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("bench/coop.wgsl"),
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    });
    // A and B: small integers (exact in f16; every product and sum exact in f32).
    let a: Vec<f32> = (0..256).map(|i| ((i * 7 + 3) % 5) as f32 - 2.0).collect();
    let b: Vec<f32> = (0..256).map(|i| ((i * 11 + 1) % 5) as f32 - 2.0).collect();
    let ab: Vec<half::f16> = a.iter().chain(&b).map(|&x| half::f16::from_f32(x)).collect();
    let ab_buf = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some("ab"),
        contents: bytemuck::cast_slice(&ab),
        usage: wgpu::BufferUsages::STORAGE,
    });
    let out_bytes = u64::from(groups) * 1024 * 4;
    let out = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("out"),
        size: out_bytes,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let read = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("read"),
        size: out_bytes,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let bg = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("coop"),
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry { binding: 0, resource: ab_buf.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 1, resource: out.as_entire_binding() },
        ],
    });
    let mut times = Vec::new();
    for rep in 0..6 {
        let mut enc = device.create_command_encoder(&Default::default());
        enc.clear_buffer(&out, 0, None);
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bg, &[]);
            pass.dispatch_workgroups(groups, 1, 1);
        }
        if rep == 5 {
            enc.copy_buffer_to_buffer(&out, 0, &read, 0, out_bytes);
        }
        device.poll(wgpu::PollType::wait_indefinitely())?;
        let t0 = std::time::Instant::now();
        queue.submit([enc.finish()]);
        device.poll(wgpu::PollType::wait_indefinitely())?;
        if rep > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    read.slice(..).map_async(wgpu::MapMode::Read, |_| {});
    device.poll(wgpu::PollType::wait_indefinitely())?;
    let got: Vec<f32> = bytemuck::cast_slice(&read.slice(..).get_mapped_range()?).to_vec();
    // naga's `coopLoad` / `coopStore` (without the T suffix) read and write column-major: the
    // kernel's 16 x 16 matrices are the transposes of the row-major buffers, so the row-major
    // result is B A.
    let product = |x: &[f32], y: &[f32]| -> Vec<f32> {
        (0..256).map(|e| (0..16).map(|k| x[(e / 16) * 16 + k] * y[k * 16 + e % 16]).sum::<f32>() * iters as f32).collect()
    };
    let want = product(&b, &a);
    for (n, chunk) in got.chunks(256).enumerate() {
        if let Some(i) = (0..256).find(|&i| chunk[i] != want[i]) {
            let ab = product(&a, &b);
            let hint = if chunk == ab.as_slice() { " (the row-major A B: the layout is not what naga's docs say)" } else { "" };
            bail!("{name}: accumulator {n}, element {i}: {} where the CPU has {}{hint}", chunk[i], want[i]);
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let flops = f64::from(groups) * 4.0 * f64::from(iters) * 2.0 * 16.0 * 16.0 * 16.0;
    println!(
        "{name}: {groups} workgroups x 4 accumulators x {iters} products of 16 x 16 x 16 f16 -> f32: {:.3} ms (median of 5, wall clock around the submission), {:.1} TFLOP/s; every accumulator equals the CPU's",
        median * 1e3,
        flops / median / 1e12
    );
    Ok(())
}
