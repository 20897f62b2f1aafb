//! The GPU runtime: adapter choice, device with the adapter's own limits, a capability tier,
//! pipelines built inside error scopes, device loss as an explicit state, readbacks.

pub mod dispatch;
pub mod probe;
pub mod timer;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use expertkv_shaders::Kernel;

use crate::error::{Error, Result};
use dispatch::CountedDispatch;

/// Which shader modules skip wgpu's runtime bounds checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShaderChecks {
    /// Every kernel keeps wgpu's bounds checks (always so in the browser).
    Checked,
    /// Kernels whose indexing the GPU-vs-CPU tests cover ([`Kernel::may_run_unchecked`]) run
    /// without bounds checks; all others stay checked.
    TrustedTested,
}

impl ShaderChecks {
    /// The mode's name in reports: `checked` or `unchecked-where-tested`.
    pub fn name(self) -> &'static str {
        match self {
            ShaderChecks::Checked => "checked",
            ShaderChecks::TrustedTested => "unchecked-where-tested",
        }
    }
}

/// How to choose and open the adapter.
#[derive(Clone, Debug)]
pub struct RuntimeOptions {
    /// Backends to consider (default: all compiled in).
    pub backends: wgpu::Backends,
    /// Keep only adapters whose name contains this (case-insensitive).
    pub adapter: Option<String>,
    /// Which kernels skip bounds checks (default: [`ShaderChecks::TrustedTested`] natively,
    /// [`ShaderChecks::Checked`] in the browser, which always checks).
    pub checks: ShaderChecks,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        RuntimeOptions {
            backends: wgpu::Backends::all(),
            adapter: None,
            checks: if cfg!(target_arch = "wasm32") { ShaderChecks::Checked } else { ShaderChecks::TrustedTested },
        }
    }
}

/// Environment variable naming the backends to consider, comma-separated ([`parse_backends`]).
pub const ENV_BACKEND: &str = "EXPERTKV_BACKEND";
/// Environment variable holding part of the wanted adapter's name (case-insensitive).
pub const ENV_ADAPTER: &str = "EXPERTKV_ADAPTER";
/// Environment variable choosing the shader bounds-check mode ([`parse_checks`]).
pub const ENV_SHADER_CHECKS: &str = "EXPERTKV_SHADER_CHECKS";

impl RuntimeOptions {
    /// Defaults overridden by `EXPERTKV_BACKEND` (vulkan, metal, dx12, gl), `EXPERTKV_ADAPTER`
    /// (part of an adapter's name) and `EXPERTKV_SHADER_CHECKS` (checked, unchecked).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn from_env() -> Result<Self> {
        let mut o = RuntimeOptions::default();
        if let Ok(b) = std::env::var(ENV_BACKEND) {
            o.backends = parse_backends(&b)?;
        }
        if let Ok(a) = std::env::var(ENV_ADAPTER)
            && !a.is_empty()
        {
            o.adapter = Some(a);
        }
        if let Ok(c) = std::env::var(ENV_SHADER_CHECKS) {
            o.checks = parse_checks(&c)?;
        }
        Ok(o)
    }
}

/// Backends from a comma-separated list of names (case-insensitive): vulkan (vk), metal, dx12
/// (d3d12), gl (gles, opengl), webgpu (browser), all. An unknown or empty list is an
/// [`Error::Config`].
pub fn parse_backends(s: &str) -> Result<wgpu::Backends> {
    let mut out = wgpu::Backends::empty();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        out |= match part.to_ascii_lowercase().as_str() {
            "vulkan" | "vk" => wgpu::Backends::VULKAN,
            "metal" => wgpu::Backends::METAL,
            "dx12" | "d3d12" => wgpu::Backends::DX12,
            "gl" | "gles" | "opengl" => wgpu::Backends::GL,
            "webgpu" | "browser" => wgpu::Backends::BROWSER_WEBGPU,
            "all" => wgpu::Backends::all(),
            other => {
                return Err(Error::config("backend", other, "allowed values: vulkan, metal, dx12, gl, webgpu, all"));
            }
        };
    }
    if out.is_empty() {
        return Err(Error::config("backend", s, "names no backend"));
    }
    Ok(out)
}

/// `checked` gives [`ShaderChecks::Checked`]; `unchecked` (or `trusted`) gives
/// [`ShaderChecks::TrustedTested`].
pub fn parse_checks(s: &str) -> Result<ShaderChecks> {
    match s {
        "checked" => Ok(ShaderChecks::Checked),
        "unchecked" | "trusted" => Ok(ShaderChecks::TrustedTested),
        other => Err(Error::config("shader_checks", other, "allowed values: checked, unchecked")),
    }
}

/// What the opened device can do.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Capabilities {
    /// The device has shader-f16 (f16 arithmetic in WGSL).
    pub f16: bool,
    /// The device has subgroups of at least 8 invocations: [`Tier::Subgroups`].
    pub subgroups: bool,
    /// Smallest subgroup size the adapter reports, in invocations.
    pub subgroup_min_size: u32,
    /// Largest subgroup size the adapter reports, in invocations.
    pub subgroup_max_size: u32,
    /// The device has timestamp queries ([`timer::GpuTimer`]).
    pub timestamps: bool,
    /// Nanoseconds per timestamp tick.
    pub timestamp_period_ns: f32,
    /// The device's `max_storage_buffer_binding_size`, in bytes.
    pub max_storage_binding_bytes: u64,
    /// The device's `max_buffer_size`, in bytes.
    pub max_buffer_bytes: u64,
    /// The device's `max_storage_buffers_per_shader_stage`.
    pub max_storage_buffers_per_stage: u32,
    /// The device's `max_compute_workgroup_storage_size`, in bytes.
    pub max_workgroup_storage_bytes: u32,
    /// The device's `max_compute_invocations_per_workgroup`.
    pub max_invocations_per_workgroup: u32,
    /// wgpu's experimental cooperative matrices with the 16 x 16 x 16 f16 -> f32 shape (the
    /// tensor cores), with 16-bit integers in shaders; native only, and off with
    /// `EXPERTKV_COOP=0`.
    pub coop_f16: bool,
}

/// The one capability switch that chooses kernel variants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Tier {
    /// WebGPU core: no subgroups. Portable kernels only.
    Baseline,
    /// Subgroups of at least 8 invocations: the subgroup attention kernel.
    Subgroups,
}

impl Tier {
    /// The tier's name in reports: `baseline` or `subgroups`.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Baseline => "baseline",
            Tier::Subgroups => "subgroups",
        }
    }
}

#[derive(Default)]
struct Health {
    lost: Option<(String, String)>,
    uncaptured: Vec<String>,
}

/// Identifies a [`Runtime`] within the process ([`Runtime::id`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RuntimeId(u64);

/// An opened GPU device with everything the kernels need to know about it.
pub struct Runtime {
    /// This runtime among the process's runtimes: what the objects made with it remember.
    id: RuntimeId,
    /// The wgpu instance the adapter came from.
    pub instance: wgpu::Instance,
    /// The adapter the device was opened on.
    pub adapter: wgpu::Adapter,
    /// The device every pool, router and kernel of this runtime lives on.
    pub device: wgpu::Device,
    /// The device's queue (shared with the application under [`Runtime::from_device`]).
    pub queue: wgpu::Queue,
    /// The adapter's name, backend and device type; an unnamed adapter is given a descriptive name.
    pub info: wgpu::AdapterInfo,
    /// The limits the device was created with (the adapter's own under [`Runtime::new`]).
    pub limits: wgpu::Limits,
    /// What the device can do, from its features and limits.
    pub caps: Capabilities,
    /// The capability tier that chooses kernel variants.
    pub tier: Tier,
    /// Which kernels run without bounds checks (always [`ShaderChecks::Checked`] in the browser).
    pub checks: ShaderChecks,
    health: Arc<Mutex<Health>>,
    /// What `probe/f16_subnormal.wgsl` found, once asked ([`Runtime::f16_subnormals`]).
    f16_subnormals: std::sync::OnceLock<bool>,
    /// Every pipeline built so far, by what built it: a kernel asked for again (another pool,
    /// router or model on this device) is not compiled again.
    pipelines: Mutex<HashMap<PipelineKey, wgpu::ComputePipeline>>,
}

/// What makes two pipelines the same: the kernel's resolved text (its defines included), entry
/// point, `override` constants and whether it runs without bounds checks.
#[derive(Clone, PartialEq, Eq, Hash)]
struct PipelineKey {
    entry: &'static str,
    text: String,
    constants: Vec<(String, u64)>,
    unchecked: bool,
}

fn rank(t: wgpu::DeviceType) -> u32 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    }
}

/// Every adapter the instance sees for these backends.
pub async fn list_adapters(backends: wgpu::Backends) -> Vec<wgpu::Adapter> {
    let instance = new_instance(backends);
    enumerate(&instance, backends).await
}

/// Whether wgpu offers its experimental cooperative matrices here with the 16 x 16 x 16
/// f16 -> f32 shape (and shader-f16 and 16-bit integers, which the kernel on them uses to
/// build f16 bit patterns), unless `EXPERTKV_COOP=0`. Never in a browser.
#[cfg(not(target_arch = "wasm32"))]
fn coop_f16_offered(adapter: &wgpu::Adapter) -> bool {
    let want = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX | wgpu::Features::SHADER_F16 | wgpu::Features::SHADER_I16;
    std::env::var("EXPERTKV_COOP").as_deref() != Ok("0")
        && adapter.features().contains(want)
        && adapter.cooperative_matrix_properties().iter().any(|p| {
            (p.m_size, p.n_size, p.k_size) == (16, 16, 16)
                && p.ab_type == wgpu::CooperativeScalarType::F16
                && p.cr_type == wgpu::CooperativeScalarType::F32
        })
}

#[cfg(target_arch = "wasm32")]
fn coop_f16_offered(_adapter: &wgpu::Adapter) -> bool {
    false
}

fn new_instance(backends: wgpu::Backends) -> wgpu::Instance {
    wgpu::Instance::new(wgpu::InstanceDescriptor { backends, ..wgpu::InstanceDescriptor::new_without_display_handle() })
}

async fn enumerate(instance: &wgpu::Instance, backends: wgpu::Backends) -> Vec<wgpu::Adapter> {
    #[cfg(not(target_arch = "wasm32"))]
    {
        instance.enumerate_adapters(backends).await
    }
    #[cfg(target_arch = "wasm32")]
    {
        let _ = backends;
        match instance.request_adapter(&wgpu::RequestAdapterOptions::default()).await {
            Ok(a) => vec![a],
            Err(_) => Vec::new(),
        }
    }
}

impl Runtime {
    /// Open the best adapter allowed by `opts` (discrete > integrated > virtual > CPU).
    pub async fn new(opts: RuntimeOptions) -> Result<Runtime> {
        let instance = new_instance(opts.backends);
        let mut adapters = enumerate(&instance, opts.backends).await;
        let seen: Vec<String> = adapters
            .iter()
            .map(|a| {
                let i = a.get_info();
                format!("{} ({:?}, {:?})", i.name, i.backend, i.device_type)
            })
            .collect();
        if let Some(want) = &opts.adapter {
            let want_l = want.to_ascii_lowercase();
            adapters.retain(|a| a.get_info().name.to_ascii_lowercase().contains(&want_l));
        }
        adapters.sort_by_key(|a| rank(a.get_info().device_type));
        let adapter = adapters.into_iter().next().ok_or_else(|| Error::NoAdapter {
            wanted: match &opts.adapter {
                Some(a) => format!("name containing `{a}` on backends {:?}", opts.backends),
                None => format!("backends {:?}", opts.backends),
            },
            seen: if seen.is_empty() {
                "none (no Vulkan/Metal/DX12 driver found; on Linux without a GPU install Mesa lavapipe: \
                 `apt-get install mesa-vulkan-drivers libvulkan1`)"
                    .into()
            } else {
                seen.join(", ")
            },
        })?;
        Self::open(instance, adapter, opts.checks).await
    }

    /// `n` devices for one process ([`crate::devices`]): the adapters `opts` allows of the best
    /// kind on the first one's backend, one device on each; with fewer adapters than `n` they
    /// are opened again in turn, so two devices opened from one adapter stand in for two GPUs.
    /// `opts.adapter` may list one name per device, comma-separated (device `i` takes the
    /// `i`-th, the list repeating): each name keeps the best kind and backend among the adapters
    /// it matches, and devices that give the same name take its adapters in turn (two different
    /// names that match one adapter both take it). Each device has its own instance, as
    /// [`Runtime::new`] makes.
    #[cfg(not(target_arch = "wasm32"))]
    pub async fn open_many(opts: RuntimeOptions, n: u32) -> Result<Vec<Runtime>> {
        if n == 0 {
            return Err(Error::Input("open_many: zero devices".into()));
        }
        let names: Vec<String> =
            opts.adapter.as_deref().map_or(Vec::new(), |a| a.split(',').map(|x| x.trim().to_ascii_lowercase()).collect());
        if names.iter().any(String::is_empty) {
            return Err(Error::config("adapter", opts.adapter.clone().unwrap_or_default(), "an empty name in the list"));
        }
        let mut out = Vec::new();
        for i in 0..n {
            let instance = new_instance(opts.backends);
            let mut adapters = enumerate(&instance, opts.backends).await;
            // The name this device asks for, and how many devices before it asked for it too.
            let mut turn = i as usize;
            if !names.is_empty() {
                let want_l = &names[i as usize % names.len()];
                turn = (0..i as usize).filter(|&j| &names[j % names.len()] == want_l).count();
                adapters.retain(|a| a.get_info().name.to_ascii_lowercase().contains(want_l.as_str()));
                if adapters.is_empty() {
                    let one = RuntimeOptions { adapter: Some(want_l.clone()), ..opts.clone() };
                    return Err(Runtime::new(one).await.err().unwrap_or(Error::Input("open_many: no adapter".into())));
                }
            }
            adapters.sort_by_key(|a| rank(a.get_info().device_type));
            // Only the best kind on one backend: a discrete GPU does not pair with a CPU
            // adapter, nor Vulkan with GL.
            if let Some((best, backend)) = adapters.first().map(|a| (rank(a.get_info().device_type), a.get_info().backend)) {
                adapters.retain(|a| rank(a.get_info().device_type) == best && a.get_info().backend == backend);
            }
            if adapters.is_empty() {
                // The same refusal, with the adapters seen, as one device gets.
                return Err(Runtime::new(opts).await.err().unwrap_or(Error::Input("open_many: no adapter".into())));
            }
            let k = turn % adapters.len();
            out.push(Self::open(instance, adapters.swap_remove(k), opts.checks).await?);
        }
        Ok(out)
    }

    async fn open(instance: wgpu::Instance, adapter: wgpu::Adapter, checks: ShaderChecks) -> Result<Runtime> {
        let mut info = adapter.get_info();
        if info.name.is_empty() {
            // Browsers do not name their WebGPU adapter.
            info.name = match info.backend {
                wgpu::Backend::BrowserWebGpu => "browser WebGPU adapter".into(),
                b => format!("unnamed {b:?} adapter"),
            };
        }
        let mut features = Self::device_descriptor(&adapter).required_features;
        let coop_f16 = coop_f16_offered(&adapter);
        let mut experimental = wgpu::ExperimentalFeatures::disabled();
        if coop_f16 {
            features |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX | wgpu::Features::SHADER_I16;
            // SAFETY: wgpu's cooperative matrices are experimental (wgpu may hold bugs there);
            // only the kernel that uses them depends on them, and its GPU-vs-CPU test checks
            // its outputs on every device that offers them.
            experimental = unsafe { wgpu::ExperimentalFeatures::enabled() };
        }
        let limits = adapter.limits();
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("expertkv"),
                required_features: features,
                required_limits: limits.clone(),
                experimental_features: experimental,
                ..Default::default()
            })
            .await
            .map_err(|e| Error::RequestDevice { adapter: info.name.clone(), message: e.to_string() })?;
        Ok(Self::assemble(instance, adapter, device, queue, info, coop_f16, checks))
    }

    /// What to ask `adapter` for when an application creates the device it will share with
    /// expertkv ([`Runtime::from_device`]): the optional features the kernels use where the
    /// adapter has them (shader-f16, subgroups, timestamps) and the adapter's own limits (the
    /// pool's buffers grow to them). A device made without them still works, on slower kernels.
    pub fn device_descriptor(adapter: &wgpu::Adapter) -> wgpu::DeviceDescriptor<'static> {
        let wanted = wgpu::Features::SHADER_F16
            | wgpu::Features::SUBGROUP
            | wgpu::Features::TIMESTAMP_QUERY
            | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS
            | wgpu::Features::MAPPABLE_PRIMARY_BUFFERS;
        wgpu::DeviceDescriptor {
            label: Some("expertkv"),
            required_features: adapter.features() & wanted,
            required_limits: adapter.limits(),
            ..Default::default()
        }
    }

    /// Which runtime this is: pools, attentions and schedulers remember the runtime they were
    /// made with and refuse any other (wgpu would reject their buffers mid-encode).
    pub fn id(&self) -> RuntimeId {
        self.id
    }

    /// Refuse an object (`what`: "this pool", "this attention") made with another runtime.
    /// (Two runtimes on the same wgpu device are two runtimes here: wgpu's device handles of
    /// separate instances can compare equal, so the runtime, not the device, is the owner.)
    pub fn check_owner(&self, owner: RuntimeId, what: &str) -> Result<()> {
        if owner == self.id {
            Ok(())
        } else {
            Err(Error::Input(format!(
                "{what} was made with another runtime (another device) than this one ({}): use the runtime it was made with",
                self.info.name
            )))
        }
    }

    /// A runtime on a device the application already has (one it renders with, say): the
    /// capability tier and limits come from what that device was created with (its features
    /// and limits, not the adapter's), so kernels needing a feature the application did not
    /// enable (subgroups, shader-f16, timestamps) are not chosen. The queue is shared: expertkv
    /// submits its own command buffers on it.
    ///
    /// expertkv installs its device-lost and uncaptured-error callbacks on `device` (they back
    /// [`Runtime::check`]); an application that installs its own afterwards replaces them, and
    /// errors then reach the application instead of `check`.
    pub fn from_device(
        instance: wgpu::Instance,
        adapter: wgpu::Adapter,
        device: wgpu::Device,
        queue: wgpu::Queue,
        checks: ShaderChecks,
    ) -> Result<Runtime> {
        let mut info = adapter.get_info();
        if info.name.is_empty() {
            info.name = format!("unnamed {:?} adapter", info.backend);
        }
        // The kernels are written for WebGPU's default limits; a device made with less (the
        // downlevel limits, say) would fail inside wgpu's pipeline validation, kernel by kernel.
        let (l, d) = (device.limits(), wgpu::Limits::default());
        for (limit_name, has, needed) in [
            (
                "max_storage_buffers_per_shader_stage",
                u64::from(l.max_storage_buffers_per_shader_stage),
                u64::from(d.max_storage_buffers_per_shader_stage),
            ),
            (
                "max_compute_invocations_per_workgroup",
                u64::from(l.max_compute_invocations_per_workgroup),
                u64::from(d.max_compute_invocations_per_workgroup),
            ),
            (
                "max_compute_workgroup_storage_size",
                u64::from(l.max_compute_workgroup_storage_size),
                u64::from(d.max_compute_workgroup_storage_size),
            ),
            ("max_compute_workgroup_size_x", u64::from(l.max_compute_workgroup_size_x), u64::from(d.max_compute_workgroup_size_x)),
            ("max_storage_buffer_binding_size", l.max_storage_buffer_binding_size, d.max_storage_buffer_binding_size),
        ] {
            if has < needed {
                return Err(Error::DeviceLimit { limit_name, has, needed });
            }
        }
        let coop = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX | wgpu::Features::SHADER_F16 | wgpu::Features::SHADER_I16;
        let coop_f16 = device.features().contains(coop) && coop_f16_offered(&adapter);
        Ok(Self::assemble(instance, adapter, device, queue, info, coop_f16, checks))
    }

    /// The runtime's state around an opened device: health callbacks, capabilities, tier.
    fn assemble(
        instance: wgpu::Instance,
        adapter: wgpu::Adapter,
        device: wgpu::Device,
        queue: wgpu::Queue,
        info: wgpu::AdapterInfo,
        coop_f16: bool,
        checks: ShaderChecks,
    ) -> Runtime {
        let features = device.features();
        let health = Arc::new(Mutex::new(Health::default()));
        {
            let h = health.clone();
            device.set_device_lost_callback(move |reason, message| {
                if let Ok(mut h) = h.lock() {
                    let message = if message.is_empty() { "the driver gave no message".into() } else { message };
                    h.lost = Some((format!("{reason:?}"), message));
                }
            });
            let h = health.clone();
            device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
                if let Ok(mut h) = h.lock() {
                    h.uncaptured.push(e.to_string());
                }
            }));
        }
        let limits = device.limits();
        let subgroups = features.contains(wgpu::Features::SUBGROUP) && info.subgroup_min_size >= 8;
        let caps = Capabilities {
            f16: features.contains(wgpu::Features::SHADER_F16),
            subgroups,
            subgroup_min_size: info.subgroup_min_size,
            subgroup_max_size: info.subgroup_max_size,
            timestamps: features.contains(wgpu::Features::TIMESTAMP_QUERY),
            timestamp_period_ns: queue.get_timestamp_period(),
            max_storage_binding_bytes: limits.max_storage_buffer_binding_size,
            max_buffer_bytes: limits.max_buffer_size,
            max_storage_buffers_per_stage: limits.max_storage_buffers_per_shader_stage,
            max_workgroup_storage_bytes: limits.max_compute_workgroup_storage_size,
            max_invocations_per_workgroup: limits.max_compute_invocations_per_workgroup,
            coop_f16,
        };
        let tier = if subgroups { Tier::Subgroups } else { Tier::Baseline };
        let checks = if cfg!(target_arch = "wasm32") { ShaderChecks::Checked } else { checks };
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Runtime {
            id: RuntimeId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)),
            instance,
            adapter,
            device,
            queue,
            info,
            limits,
            caps,
            tier,
            checks,
            health,
            f16_subnormals: Default::default(),
            pipelines: Default::default(),
        }
    }

    /// Err if the device was lost or an error escaped every error scope since the last check.
    pub fn check(&self, during: &str) -> Result<()> {
        let poisoned = || Error::Gpu { during: during.into(), message: "health state poisoned".into() };
        // Errors on a destroyed or removed device come before its lost callback: let the device
        // deliver its callbacks (outside the lock they take) so a lost device is named as such.
        #[cfg(not(target_arch = "wasm32"))]
        if !self.health.lock().map_err(|_| poisoned())?.uncaptured.is_empty() {
            let _ = self.device.poll(wgpu::PollType::Poll);
        }
        let mut h = self.health.lock().map_err(|_| poisoned())?;
        if let Some((reason, message)) = &h.lost {
            return Err(Error::DeviceLost { reason: reason.clone(), message: message.clone() });
        }
        if !h.uncaptured.is_empty() {
            let message = h.uncaptured.join("; ");
            h.uncaptured.clear();
            return Err(Error::Gpu { during: during.into(), message });
        }
        Ok(())
    }

    /// Whether this device was lost.
    pub fn is_lost(&self) -> bool {
        self.health.lock().map(|h| h.lost.is_some()).unwrap_or(true)
    }

    /// Whether this device's f16 arithmetic keeps subnormal inputs and results exactly (false
    /// without shader-f16): `probe/f16_subnormal.wgsl` against its CPU reference
    /// ([`crate::runtime::probe`]), run on the first call and remembered.
    pub async fn f16_subnormals(&self) -> Result<bool> {
        if let Some(v) = self.f16_subnormals.get() {
            return Ok(*v);
        }
        let v = self.caps.f16 && self.probe_f16_subnormals().await? == 0;
        Ok(*self.f16_subnormals.get_or_init(|| v))
    }

    /// Run the subnormal probe: the number of its cases that missed the exact results.
    pub async fn probe_f16_subnormals(&self) -> Result<usize> {
        let cases = crate::runtime::probe::f16_subnormal_cases();
        let pipeline = self.pipeline(Kernel::ProbeF16Subnormal, &[]).await?;
        let input = self.storage_init("probe/f16_subnormal cases", &cases);
        let out = self.storage("probe/f16_subnormal out", (cases.len() * 16) as u64);
        self.fill_u32(&out, 0xffff_ffff);
        let bind = self.bind(Kernel::ProbeF16Subnormal.label(), &pipeline, &[&input, &out]);
        let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("probe/f16_subnormal") });
        {
            let mut pass =
                enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("probe/f16_subnormal"), timestamp_writes: None });
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bind, &[]);
            pass.dispatch_counted((cases.len() as u32).div_ceil(64), 1, 1);
        }
        self.queue.submit([enc.finish()]);
        self.check("probe/f16_subnormal")?;
        let got: Vec<[f32; 4]> = self.read(&out, 0, cases.len() as u64).await?;
        Ok(crate::runtime::probe::f16_subnormal_misses(&cases, &got))
    }

    /// Largest single storage binding (and buffer) this device allows.
    pub fn max_binding_bytes(&self) -> u64 {
        self.caps.max_storage_binding_bytes.min(self.caps.max_buffer_bytes)
    }

    /// `Ok` if `bytes` of `what` fit one storage binding ([`Runtime::max_binding_bytes`]), else
    /// the [`Error::Limit`] that names them.
    pub fn fits_binding(&self, what: impl Into<String>, bytes: u64) -> Result<()> {
        let limit = self.max_binding_bytes();
        if bytes > limit {
            return Err(Error::Limit { what: what.into(), needed: bytes, limit_name: "max_storage_buffer_binding_size", limit });
        }
        Ok(())
    }

    /// Build a kernel's pipeline inside an error scope; a failure names the kernel.
    /// `constants` set the kernel's `override` values.
    pub async fn pipeline(&self, kernel: Kernel, constants: &[(&str, f64)]) -> Result<wgpu::ComputePipeline> {
        self.pipeline_with(kernel, &[], constants).await
    }

    /// [`Runtime::pipeline`] with `//!define` values (name, WGSL literal) for the kernel's text.
    pub async fn pipeline_with(
        &self,
        kernel: Kernel,
        defines: &[(&str, String)],
        constants: &[(&str, f64)],
    ) -> Result<wgpu::ComputePipeline> {
        self.check("pipeline creation")?;
        let mut text = kernel.resolved_with(defines).map_err(|e| Error::Pipeline { kernel: kernel.label(), message: e.to_string() })?;
        if kernel.needs_subgroups() {
            if !self.caps.subgroups {
                return Err(Error::Pipeline {
                    kernel: kernel.label(),
                    message: "needs subgroups, which this device lacks; use the baseline variant".into(),
                });
            }
            if cfg!(target_arch = "wasm32") {
                text.insert_str(0, "enable subgroups;\n");
            }
        }
        if kernel.needs_f16() && !self.caps.f16 {
            return Err(Error::Pipeline { kernel: kernel.label(), message: "needs shader-f16, which this device lacks".into() });
        }
        let unchecked = self.checks == ShaderChecks::TrustedTested && kernel.may_run_unchecked();
        let key = PipelineKey {
            entry: kernel.entry_point(),
            text,
            constants: constants.iter().map(|(n, v)| ((*n).to_string(), v.to_bits())).collect(),
            unchecked,
        };
        if let Some(p) = self.pipelines.lock().ok().and_then(|m| m.get(&key).cloned()) {
            return Ok(p);
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let desc = wgpu::ShaderModuleDescriptor { label: Some(kernel.label()), source: wgpu::ShaderSource::Wgsl(key.text.as_str().into()) };
        let module = if unchecked {
            // SAFETY: `may_run_unchecked` lists only kernels whose every index the GPU-vs-CPU
            // tests exercise (tests/tests/gpu) over random shapes, in both check modes.
            unsafe { self.device.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked()) }
        } else {
            self.device.create_shader_module(desc)
        };
        let pipeline = self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(kernel.label()),
            layout: None,
            module: &module,
            entry_point: Some(kernel.entry_point()),
            compilation_options: wgpu::PipelineCompilationOptions { constants, zero_initialize_workgroup_memory: false },
            cache: None,
        });
        if let Some(e) = scope.pop().await {
            return Err(Error::Pipeline { kernel: kernel.label(), message: e.to_string() });
        }
        if let Ok(mut m) = self.pipelines.lock() {
            m.insert(key, pipeline.clone());
        }
        Ok(pipeline)
    }

    /// A storage buffer of `size` bytes (at least 4).
    pub fn storage(&self, label: &str, size: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: storage_size(size),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
    }

    /// A storage buffer of `size` bytes that kernels read and write in place in host memory,
    /// where the device allows it (`MAPPABLE_PRIMARY_BUFFERS`, native: a read-mappable buffer,
    /// which Vulkan places in host memory), else in device memory; the flag says which. For data
    /// the GPU touches a small part of each step (the recall tier), so it costs no device memory.
    pub fn host_storage(&self, label: &str, size: u64) -> (wgpu::Buffer, bool) {
        let host = self.device.features().contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS);
        let map = if host { wgpu::BufferUsages::MAP_READ } else { wgpu::BufferUsages::empty() };
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: storage_size(size),
            usage: map | wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        (buf, host)
    }

    /// The arguments of an indirect dispatch (x, y, z), written by a kernel as storage.
    pub fn indirect_args(&self, label: &str) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: 16,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::INDIRECT | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
    }

    /// A storage buffer holding `data`.
    pub fn storage_init<T: bytemuck::Pod>(&self, label: &str, data: &[T]) -> wgpu::Buffer {
        let buf = self.storage(label, std::mem::size_of_val(data) as u64);
        if !data.is_empty() {
            self.queue.write_buffer(&buf, 0, bytemuck::cast_slice(data));
        }
        buf
    }

    /// A uniform buffer holding `value`.
    pub fn uniform<T: bytemuck::Pod>(&self, label: &str, value: &T) -> wgpu::Buffer {
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: std::mem::size_of::<T>() as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.queue.write_buffer(&buf, 0, bytemuck::bytes_of(value));
        buf
    }

    /// Bind group 0 of `pipeline` from buffers in binding order.
    pub fn bind(&self, label: &str, pipeline: &wgpu::ComputePipeline, buffers: &[&wgpu::Buffer]) -> wgpu::BindGroup {
        let layout = pipeline.get_bind_group_layout(0);
        let entries: Vec<wgpu::BindGroupEntry> =
            buffers.iter().enumerate().map(|(i, b)| wgpu::BindGroupEntry { binding: i as u32, resource: b.as_entire_binding() }).collect();
        self.device.create_bind_group(&wgpu::BindGroupDescriptor { label: Some(label), layout: &layout, entries: &entries })
    }

    /// Bind group 0 of `pipeline` from (binding, buffer) pairs: for entry points of a file with
    /// several, whose automatic layout holds only the bindings that entry point uses.
    pub fn bind_at(&self, label: &str, pipeline: &wgpu::ComputePipeline, buffers: &[(u32, &wgpu::Buffer)]) -> wgpu::BindGroup {
        let layout = pipeline.get_bind_group_layout(0);
        let entries: Vec<wgpu::BindGroupEntry> =
            buffers.iter().map(|(i, b)| wgpu::BindGroupEntry { binding: *i, resource: b.as_entire_binding() }).collect();
        self.device.create_bind_group(&wgpu::BindGroupDescriptor { label: Some(label), layout: &layout, entries: &entries })
    }

    /// Fill a buffer with a repeated 32-bit pattern (used to poison outputs before a run).
    pub fn fill_u32(&self, buffer: &wgpu::Buffer, value: u32) {
        let n = (buffer.size() / 4) as usize;
        const CHUNK: usize = 1 << 20;
        let chunk = vec![value; n.min(CHUNK)];
        let mut off = 0;
        while off < n {
            let len = (n - off).min(CHUNK);
            self.queue.write_buffer(buffer, (off * 4) as u64, bytemuck::cast_slice(&chunk[..len]));
            off += len;
        }
    }

    /// Wait for all submitted work (native); a no-op on the web, where the browser drives it.
    pub fn wait(&self) -> Result<()> {
        #[cfg(not(target_arch = "wasm32"))]
        self.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| Error::Gpu { during: "wait".into(), message: e.to_string() })?;
        self.check("wait")
    }

    /// A buffer in host memory holding `data` that copies read from
    /// (`CommandEncoder::copy_buffer_to_buffer` as the source): the host tier of data the GPU
    /// fetches by DMA, with no staging copy by the CPU at fetch time. With
    /// `MAPPABLE_PRIMARY_BUFFERS` (native) it is a read-mappable buffer, which Vulkan places in
    /// host memory (cached); elsewhere a write-mappable one (WebGPU's only copy source the host
    /// fills directly), which some drivers place in the device's host-visible memory instead.
    pub fn host_copy_source(&self, label: &str, data: &[u32]) -> wgpu::Buffer {
        let mappable = self.device.features().contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS);
        let map = if mappable { wgpu::BufferUsages::MAP_READ } else { wgpu::BufferUsages::MAP_WRITE };
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: (std::mem::size_of_val(data) as u64).max(4),
            usage: map | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: true,
        });
        if !data.is_empty() {
            // A buffer mapped at creation is mapped whole; this cannot fail.
            if let Ok(mut view) = buf.slice(..).get_mapped_range_mut() {
                view.copy_from_slice(bytemuck::cast_slice(data));
            }
        }
        buf.unmap();
        buf
    }

    /// Copy `count` elements of `T` from `buffer` (starting at element `first`) back to the host.
    pub async fn read<T: bytemuck::Pod>(&self, buffer: &wgpu::Buffer, first: u64, count: u64) -> Result<Vec<T>> {
        let mut out = self.read_many::<T>(&[(buffer, first, count)]).await?;
        Ok(out.pop().unwrap_or_default())
    }

    /// Several ranges (`(buffer, first element, count)`) read back with one copy each into one
    /// staging buffer and one map: one wait for the GPU instead of one per range.
    pub async fn read_many<T: bytemuck::Pod>(&self, ranges: &[(&wgpu::Buffer, u64, u64)]) -> Result<Vec<Vec<T>>> {
        let size = std::mem::size_of::<T>() as u64;
        let spans: Vec<(u64, u64)> = ranges
            .iter()
            .scan(0u64, |at, &(_, _, count)| {
                let start = *at;
                *at += (count * size).next_multiple_of(4);
                Some((start, count * size))
            })
            .collect();
        let bytes = spans.last().map_or(0, |&(start, len)| start + len.next_multiple_of(4));
        if bytes == 0 {
            return Ok(ranges.iter().map(|_| Vec::new()).collect());
        }
        let staging = self.staging("readback", bytes);
        let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("readback") });
        for (&(buffer, first, _), &(start, len)) in ranges.iter().zip(&spans) {
            if len > 0 {
                enc.copy_buffer_to_buffer(buffer, first * size, &staging, start, len.next_multiple_of(4));
            }
        }
        self.queue.submit([enc.finish()]);
        self.with_mapped(&staging, |view| {
            spans.iter().map(|&(start, len)| bytemuck::pod_collect_to_vec::<u8, T>(&view[start as usize..(start + len) as usize])).collect()
        })
        .await
    }

    /// A readable staging buffer (`MAP_READ | COPY_DST`) of `bytes`, for copies a caller encodes
    /// into its own command buffers and reads with [`Runtime::read_staging`], over and over.
    pub fn staging(&self, label: &str, bytes: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes.next_multiple_of(4).max(4),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// Wait for the work submitted so far, then read the whole of `staging` (a buffer from
    /// [`Runtime::staging`] the submitted work copied into) and unmap it for its next use.
    pub async fn read_staging<T: bytemuck::Pod>(&self, staging: &wgpu::Buffer) -> Result<Vec<T>> {
        self.with_mapped(staging, |view| {
            let usable = view.len() / std::mem::size_of::<T>() * std::mem::size_of::<T>();
            bytemuck::pod_collect_to_vec::<u8, T>(&view[..usable])
        })
        .await
    }

    /// Wait for the work submitted so far, map the whole of `staging` for reading, hand its
    /// bytes to `read` (one copy out, by `read`), and unmap it for its next use.
    async fn with_mapped<R>(&self, staging: &wgpu::Buffer, read: impl FnOnce(&[u8]) -> R) -> Result<R> {
        let label = "readback".to_owned();
        let slot = Arc::new(Mutex::new(MapSlot::default()));
        {
            let slot = slot.clone();
            staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
                if let Ok(mut s) = slot.lock() {
                    s.result = Some(r.map_err(|e| e.to_string()));
                    if let Some(w) = s.waker.take() {
                        w.wake();
                    }
                }
            });
        }
        self.wait()?;
        MapFuture { slot }.await.map_err(|message| Error::Readback { label: label.clone(), message })?;
        let view = staging.slice(..).get_mapped_range().map_err(|e| Error::Readback { label: label.clone(), message: e.to_string() })?;
        let out = read(&view);
        drop(view);
        staging.unmap();
        Ok(out)
    }

    /// The whole buffer as `T`s.
    pub async fn read_all<T: bytemuck::Pod>(&self, buffer: &wgpu::Buffer) -> Result<Vec<T>> {
        self.read(buffer, 0, buffer.size() / std::mem::size_of::<T>() as u64).await
    }
}

#[derive(Default)]
struct MapSlot {
    result: Option<std::result::Result<(), String>>,
    waker: Option<Waker>,
}

struct MapFuture {
    slot: Arc<Mutex<MapSlot>>,
}

impl Future for MapFuture {
    type Output = std::result::Result<(), String>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Ok(mut s) = self.slot.lock() else {
            return Poll::Ready(Err("map state poisoned".into()));
        };
        match s.result.take() {
            Some(r) => Poll::Ready(r),
            None => {
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// `n` workgroups as (x, y) within the per-dimension limit: (n, 1) up to 65,535, else rows of
/// 65,535 (the kernel skips indices past `n`).
pub fn split_workgroups(n: u32) -> [u32; 2] {
    [n.min(65_535), n.div_ceil(65_535)]
}

/// Workgroups (x, y) covering `n` invocations in groups of 64 within the per-dimension limit.
pub fn grid(n: u32) -> (u32, u32) {
    let groups = n.div_ceil(64).max(1);
    if groups <= 65_535 { (groups, 1) } else { (65_535, groups.div_ceil(65_535)) }
}

/// The bytes [`Runtime::storage`] allocates for a buffer of `size` bytes (at least 4, a whole
/// number of words): what a prediction of allocated bytes must count.
pub fn storage_size(size: u64) -> u64 {
    size.max(4).next_multiple_of(4)
}
