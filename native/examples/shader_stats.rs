//! What the Vulkan driver says it compiled a kernel to (VK_KHR_pipeline_executable_properties):
//! registers per invocation, spills, shared memory, as the driver names them. For the H200
//! probes: a kernel that keeps its arrays in registers needs fewer warps' worth of registers than
//! the multiprocessor has, or fewer workgroups fit.
//!
//! `cargo run --release -p expertkv --example shader_stats -- attend/split_quant_tile.wgsl GROUP=4u PAGE_SIZE=64u`
//! (the kernel's label, then its defines). The SPIR-V is naga's, as wgpu makes it for kernels
//! created without runtime checks (no bounds checks, no loop bounding).
//! `shader_stats --cooperative-matrix` lists the matrix shapes and types the device's
//! VK_KHR_cooperative_matrix offers (what tensor cores a Vulkan kernel could reach).

use anyhow::{Context, Result, anyhow, bail};
use ash::vk;
use expertkv_shaders::Kernel;

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let label = args.next().context("usage: shader_stats KERNEL_LABEL [NAME=VALUE ...] | --cooperative-matrix")?;
    if label == "--cooperative-matrix" {
        wgpu_cooperative_matrix();
        // SAFETY: plain Vulkan queries on an instance created there.
        return unsafe { cooperative_matrix() };
    }
    let kernel = Kernel::ALL.iter().copied().find(|k| k.label() == label).ok_or_else(|| anyhow!("no kernel labelled {label}"))?;
    let defines: Vec<(String, String)> = args
        .map(|a| a.split_once('=').map(|(n, v)| (n.to_owned(), v.to_owned())).ok_or_else(|| anyhow!("define {a}: NAME=VALUE")))
        .collect::<Result<_>>()?;
    let defs: Vec<(&str, String)> = defines.iter().map(|(n, v)| (n.as_str(), v.clone())).collect();
    let text = kernel.resolved_with(&defs).map_err(|e| anyhow!("{e}"))?;
    let module = naga::front::wgsl::parse_str(&text).map_err(|e| anyhow!("{}", e.emit_to_string(&text)))?;
    let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all())
        .subgroup_stages(naga::valid::ShaderStages::COMPUTE)
        .subgroup_operations(naga::valid::SubgroupOperationSet::all())
        .validate(&module)
        .map_err(|e| anyhow!("{}", e.emit_to_string(&text)))?;
    let options = naga::back::spv::Options {
        lang_version: (1, 3),
        bounds_check_policies: naga::proc::BoundsCheckPolicies::default(),
        force_loop_bounding: false,
        // As the runtime's pipelines (`zero_initialize_workgroup_memory: false`).
        zero_initialize_workgroup_memory: naga::back::spv::ZeroInitializeWorkgroupMemoryMode::None,
        ..Default::default()
    };
    let pipeline_options =
        naga::back::spv::PipelineOptions { shader_stage: naga::ShaderStage::Compute, entry_point: kernel.entry_point().into() };
    let spv = naga::back::spv::write_vec(&module, &info, &options, Some(&pipeline_options))?;
    let mut bindings: Vec<(u32, vk::DescriptorType)> = Vec::new();
    for (_, var) in module.global_variables.iter() {
        if let Some(rb) = &var.binding {
            let ty = match var.space {
                naga::AddressSpace::Uniform => vk::DescriptorType::UNIFORM_BUFFER,
                naga::AddressSpace::Storage { .. } => vk::DescriptorType::STORAGE_BUFFER,
                other => bail!("binding {} in {other:?}: not a buffer", rb.binding),
            };
            if rb.group != 0 {
                bail!("bind group {} (only group 0 is handled)", rb.group);
            }
            bindings.push((rb.binding, ty));
        }
    }
    // SAFETY: plain Vulkan calls on objects created here, each checked, destroyed by process exit.
    let coop = text.contains("enable wgpu_cooperative_matrix;");
    unsafe { stats(&spv, &bindings, &label, kernel.entry_point(), coop) }
}

/// A physical device's name.
///
/// # Safety
/// `pd` is a physical device of `instance`.
unsafe fn device_name(instance: &ash::Instance, pd: vk::PhysicalDevice) -> String {
    // SAFETY: the caller's contract.
    let props = unsafe { instance.get_physical_device_properties(pd) };
    props.device_name_as_c_str().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default()
}

/// What wgpu makes of it: the adapter's experimental cooperative-matrix feature and shapes.
fn wgpu_cooperative_matrix() {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::VULKAN,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    for adapter in pollster::block_on(instance.enumerate_adapters(wgpu::Backends::VULKAN)) {
        let info = adapter.get_info();
        let on = adapter.features().contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX);
        println!("wgpu, {}: EXPERIMENTAL_COOPERATIVE_MATRIX {}", info.name, if on { "offered" } else { "not offered" });
        for p in adapter.cooperative_matrix_properties() {
            println!("  {} x {} x {}: {:?} -> {:?}", p.m_size, p.n_size, p.k_size, p.ab_type, p.cr_type);
        }
    }
}

unsafe fn cooperative_matrix() -> Result<()> {
    // SAFETY: the caller's contract; the instance is created and queried here.
    unsafe {
        let entry = ash::Entry::load()?;
        let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_3);
        let instance = entry.create_instance(&vk::InstanceCreateInfo::default().application_info(&app), None)?;
        let ext = ash::khr::cooperative_matrix::NAME;
        let coop = ash::khr::cooperative_matrix::Instance::new(&entry, &instance);
        for pd in instance.enumerate_physical_devices()? {
            let name = device_name(&instance, pd);
            let exts = instance.enumerate_device_extension_properties(pd)?;
            if !exts.iter().any(|e| e.extension_name_as_c_str().is_ok_and(|n| n == ext)) {
                println!("{name}: no VK_KHR_cooperative_matrix");
                continue;
            }
            let shapes = coop.get_physical_device_cooperative_matrix_properties(pd)?;
            println!("{name}: VK_KHR_cooperative_matrix, {} configurations (M x N x K: A, B -> C, result; scope)", shapes.len());
            for c in shapes {
                println!(
                    "  {} x {} x {}: {:?}, {:?} -> {:?}, {:?}; {:?}",
                    c.m_size, c.n_size, c.k_size, c.a_type, c.b_type, c.c_type, c.result_type, c.scope
                );
            }
        }
        Ok(())
    }
}

unsafe fn stats(spv: &[u32], bindings: &[(u32, vk::DescriptorType)], label: &str, entry_point: &str, coop: bool) -> Result<()> {
    // SAFETY: the caller's contract; every handle below is created and used in this function.
    unsafe {
        let entry = ash::Entry::load()?;
        let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_3);
        let instance = entry.create_instance(&vk::InstanceCreateInfo::default().application_info(&app), None)?;
        let ext = ash::khr::pipeline_executable_properties::NAME;
        let mut chosen = None;
        for pd in instance.enumerate_physical_devices()? {
            let exts = instance.enumerate_device_extension_properties(pd)?;
            if exts.iter().any(|e| e.extension_name_as_c_str().is_ok_and(|n| n == ext)) {
                chosen = Some(pd);
                break;
            }
        }
        let pd = chosen.context("no Vulkan device offers VK_KHR_pipeline_executable_properties")?;
        let name = device_name(&instance, pd);
        let qf = instance
            .get_physical_device_queue_family_properties(pd)
            .iter()
            .position(|q| q.queue_flags.contains(vk::QueueFlags::COMPUTE))
            .context("no compute queue")? as u32;
        let prio = [1.0f32];
        let queue = [vk::DeviceQueueCreateInfo::default().queue_family_index(qf).queue_priorities(&prio)];
        let mut exec = vk::PhysicalDevicePipelineExecutablePropertiesFeaturesKHR::default().pipeline_executable_info(true);
        let mut v11 = vk::PhysicalDeviceVulkan11Features::default().storage_buffer16_bit_access(true);
        let mut v12 = vk::PhysicalDeviceVulkan12Features::default().shader_float16(true).shader_int8(true).vulkan_memory_model(true);
        let mut v13 = vk::PhysicalDeviceVulkan13Features::default().shader_integer_dot_product(true).subgroup_size_control(true);
        let features = vk::PhysicalDeviceFeatures::default().shader_int64(true);
        // Kernels on cooperative matrices (`enable wgpu_cooperative_matrix;`) need the extension.
        let mut exts = vec![ext.as_ptr()];
        let mut coop_features = vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default().cooperative_matrix(true);
        if coop {
            exts.push(ash::khr::cooperative_matrix::NAME.as_ptr());
        }
        let mut info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queue)
            .enabled_extension_names(&exts)
            .enabled_features(&features)
            .push_next(&mut exec)
            .push_next(&mut v11)
            .push_next(&mut v12)
            .push_next(&mut v13);
        if coop {
            info = info.push_next(&mut coop_features);
        }
        let device = instance.create_device(pd, &info, None)?;
        let dsl_bindings: Vec<vk::DescriptorSetLayoutBinding> = bindings
            .iter()
            .map(|(b, ty)| {
                vk::DescriptorSetLayoutBinding::default()
                    .binding(*b)
                    .descriptor_type(*ty)
                    .descriptor_count(1)
                    .stage_flags(vk::ShaderStageFlags::COMPUTE)
            })
            .collect();
        let dsl = device.create_descriptor_set_layout(&vk::DescriptorSetLayoutCreateInfo::default().bindings(&dsl_bindings), None)?;
        let layouts = [dsl];
        let layout = device.create_pipeline_layout(&vk::PipelineLayoutCreateInfo::default().set_layouts(&layouts), None)?;
        let module = device.create_shader_module(&vk::ShaderModuleCreateInfo::default().code(spv), None)?;
        let ep = std::ffi::CString::new(entry_point)?;
        let stage = vk::PipelineShaderStageCreateInfo::default().stage(vk::ShaderStageFlags::COMPUTE).module(module).name(&ep);
        let flags = vk::PipelineCreateFlags::CAPTURE_STATISTICS_KHR | vk::PipelineCreateFlags::CAPTURE_INTERNAL_REPRESENTATIONS_KHR;
        let create = [vk::ComputePipelineCreateInfo::default().stage(stage).layout(layout).flags(flags)];
        let cache = device.create_pipeline_cache(&vk::PipelineCacheCreateInfo::default(), None)?;
        let pipeline = device.create_compute_pipelines(cache, &create, None).map_err(|(_, e)| anyhow!("create_compute_pipelines: {e}"))?[0];
        // SHADER_STATS_DUMP=DIR: the SPIR-V and the driver's pipeline-cache blob (which holds the
        // compiled machine code on some drivers) written there, for disassembly elsewhere.
        let dump = std::env::var_os("SHADER_STATS_DUMP").map(std::path::PathBuf::from);
        let stem: String = label.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
        if let Some(dir) = &dump {
            std::fs::create_dir_all(dir)?;
            std::fs::write(dir.join(format!("{stem}.spv")), bytemuck::cast_slice::<u32, u8>(spv))?;
            let blob = device.get_pipeline_cache_data(cache)?;
            std::fs::write(dir.join(format!("{stem}.vkcache")), &blob)?;
            println!("  wrote {stem}.spv and {stem}.vkcache ({} bytes) to {}", blob.len(), dir.display());
        }
        let pep = ash::khr::pipeline_executable_properties::Device::new(&instance, &device);
        let executables = pep.get_pipeline_executable_properties(&vk::PipelineInfoKHR::default().pipeline(pipeline))?;
        println!("{label} on {name}: {} SPIR-V words", spv.len());
        for (i, e) in executables.iter().enumerate() {
            let ename = e.name_as_c_str().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
            println!("  executable {i}: {ename} (subgroup size {})", e.subgroup_size);
            let info = vk::PipelineExecutableInfoKHR::default().pipeline(pipeline).executable_index(i as u32);
            for s in pep.get_pipeline_executable_statistics(&info)? {
                let sname = s.name_as_c_str().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
                let v = match s.format {
                    vk::PipelineExecutableStatisticFormatKHR::BOOL32 => format!("{}", s.value.b32),
                    vk::PipelineExecutableStatisticFormatKHR::INT64 => format!("{}", s.value.i64),
                    vk::PipelineExecutableStatisticFormatKHR::UINT64 => format!("{}", s.value.u64),
                    vk::PipelineExecutableStatisticFormatKHR::FLOAT64 => format!("{}", s.value.f64),
                    _ => "?".into(),
                };
                println!("    {sname}: {v}");
            }
            // The driver's internal representations, where it gives any (sizes first, then data).
            let get = pep.fp().get_pipeline_executable_internal_representations_khr;
            let mut n = 0u32;
            if get(device.handle(), &info, &mut n, std::ptr::null_mut()) != vk::Result::SUCCESS || n == 0 {
                println!("    (no internal representations)");
                continue;
            }
            let mut reps = vec![vk::PipelineExecutableInternalRepresentationKHR::default(); n as usize];
            let _ = get(device.handle(), &info, &mut n, reps.as_mut_ptr());
            let mut bufs: Vec<Vec<u8>> = reps.iter().map(|r| vec![0u8; r.data_size]).collect();
            for (r, b) in reps.iter_mut().zip(bufs.iter_mut()) {
                r.p_data = b.as_mut_ptr().cast();
            }
            let res = get(device.handle(), &info, &mut n, reps.as_mut_ptr());
            for (k, (r, b)) in reps.iter().zip(&bufs).enumerate() {
                let rname = r.name_as_c_str().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
                println!("    representation {k}: {rname} ({} bytes, text {}, {res:?})", b.len(), r.is_text != 0);
                if let Some(dir) = &dump {
                    std::fs::write(dir.join(format!("{stem}.rep{i}_{k}")), b)?;
                }
            }
        }
        Ok(())
    }
}
