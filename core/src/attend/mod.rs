//! Decode attention on the GPU over the pool's pages (flash-decoding: a split pass per pool
//! buffer over chunks of pages, then a reduce pass; optionally an attention-mass pass).

pub mod prefill;

use expertkv_shaders::Kernel;

use crate::append::KvPool;
use crate::config::KvDtype;
use crate::error::{Error, Result};
use crate::gpu_data::AttendParams;
use crate::runtime::dispatch::CountedDispatch;
use crate::runtime::{Runtime, Tier};

/// Which split kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum SplitVariant {
    /// Workgroup-memory tiles; runs everywhere (WebGPU core).
    Tiled,
    /// `lanes` invocations of a subgroup per token, `vpl` 16-byte loads each per row.
    Subgroup {
        /// Subgroup invocations that share a token's row: 16 or 8, at most the device's
        /// smallest subgroup.
        lanes: u32,
        /// 16-byte words each lane loads per K or V row, 1..=4 (head_dim / (values per 16 bytes x
        /// lanes)).
        vpl: u32,
    },
}

impl SplitVariant {
    /// The variant as reports and error messages show it: `tiled` or `subgroup(lanes=16,vpl=1)`.
    pub fn name(self) -> String {
        match self {
            SplitVariant::Tiled => "tiled".into(),
            SplitVariant::Subgroup { lanes, vpl } => format!("subgroup(lanes={lanes},vpl={vpl})"),
        }
    }
}

/// How decode attention runs: query heads per KV head, sequences, chunking, the mass pass and the
/// kernels' knobs (defaults: [`AttendOptions::default`]).
#[derive(Clone, Debug)]
pub struct AttendOptions {
    /// Query heads per KV head.
    pub group: u32,
    /// Sequences attended per call (0..n_seqs).
    pub n_seqs: u32,
    /// Pages per split chunk.
    pub chunk_pages: u32,
    /// Also run the attention-mass pass (feeds H2O-style schedulers).
    pub mass: bool,
    /// `None`: the best variant the device's tier allows.
    pub variant: Option<SplitVariant>,
    /// Subgroup variant: tokens in flight per token group (1..=`MAX_TOKENS_IN_FLIGHT`).
    pub tokens_in_flight: u32,
    /// Subgroup variant: reduce-scatter scores over lanes when the group allows it.
    pub transpose: bool,
    /// Tile kernel: how far (in score units, natural log) a score may rise above its head's
    /// running reference maximum before the workgroup's sums are rescaled (lazy rescaling;
    /// probabilities stay below e^slack), within 0..=[`TILE_MAX_SLACK`]; 0 or below rescales
    /// whenever a maximum rises.
    pub rescale_slack: f32,
    /// Which kernel reads int4 pages (when the device and shape allow the tile kernel).
    pub quant_kernel: QuantKernel,
    /// Tile kernel: tiles of tokens between moves of its f16 value sums into f32 (1..=16).
    pub f16_flush_tiles: u32,
    /// Tile kernel: invocations per workgroup, so tokens per tile: 32, 64 or 128, at least the
    /// page size; 0 picks [`TILE_WG`] (or the page size where that is larger).
    pub tile_wg: u32,
    /// Tile kernel: where the device keeps f16 subnormals exactly ([`Runtime::f16_subnormals`]),
    /// the value codes become the f16 code x 2^-20, half of them by a mask alone (subnormal
    /// f16); false: 1024 + code or 64 + code through exponent bits, each minus its offset.
    pub tile_subnormal_codes: bool,
    /// Tile kernel: the key codes' high nibbles read in place as signed bytes, 16 (code - 8)
    /// (one logic instruction per code word instead of a shift and one), summed apart from the
    /// low nibbles' products and joined once per token; false: shifted down like the low ones.
    pub tile_signed_high_nibbles: bool,
    /// Tile kernel: each tile's probabilities go to workgroup memory before the rescale's flag
    /// is read, so the flag's barrier publishes them (one barrier per tile fewer; written again
    /// after a rescale); false: written after the rescale, behind a barrier of their own.
    pub tile_early_probs: bool,
    /// One more partial buffer after the pool's, which the recall pass writes between the split
    /// and the reduce passes ([`crate::evict::recall::RecallTier::encode_recall`]; the reduce
    /// merges what it holds, empty records until it runs).
    pub recall: bool,
}

impl Default for AttendOptions {
    fn default() -> Self {
        AttendOptions {
            group: 4,
            n_seqs: 1,
            chunk_pages: 32,
            mass: true,
            variant: None,
            tokens_in_flight: 4,
            transpose: true,
            rescale_slack: RESCALE_SLACK,
            quant_kernel: QuantKernel::Auto,
            f16_flush_tiles: F16_FLUSH_TILES,
            tile_wg: 0,
            tile_subnormal_codes: true,
            tile_signed_high_nibbles: true,
            tile_early_probs: true,
            recall: false,
        }
    }
}

/// The kernel that reads KIVI int4 pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub enum QuantKernel {
    /// The tile kernel where the device (subgroups, shader-f16) and the shape allow it, else
    /// the slot-block kernel (subgroups), else the portable one.
    #[default]
    Auto,
    /// `attend/split_quant.wgsl`: LANES invocations per token, f32 sums.
    SlotBlock,
    /// `attend/split_quant_tile.wgsl` (or an error where it cannot run).
    Tile,
    /// `attend/split_quant_coop.wgsl`, on the tensor cores through wgpu's experimental
    /// cooperative matrices (or an error where it cannot run).
    Coop,
}

impl QuantKernel {
    /// `auto`, `slot` (or `slot-block`), `tile` or `coop`; anything else is an [`Error::Config`].
    pub fn parse(s: &str) -> Result<QuantKernel> {
        match s {
            "auto" => Ok(QuantKernel::Auto),
            "slot" | "slot-block" => Ok(QuantKernel::SlotBlock),
            "tile" => Ok(QuantKernel::Tile),
            "coop" => Ok(QuantKernel::Coop),
            _ => Err(Error::config("quant_kernel", s, "one of auto, slot, tile, coop")),
        }
    }
}

/// The default [`AttendOptions::f16_flush_tiles`]: every tile (on the H200, b8 x 32768 int4
/// pages of 64: 0.202 ms against 0.216 at 2 and 4; BENCHMARKS.md).
pub const F16_FLUSH_TILES: u32 = 1;

/// The tile kernel's workgroup size where [`AttendOptions::tile_wg`] is 0.
pub const TILE_WG: u32 = 128;

/// The most [`AttendOptions::f16_flush_tiles`].
pub const MAX_F16_FLUSH_TILES: u32 = 16;

/// The tile kernel's lazy-rescale slack is the option's, within 0..=this (its f16 value sums
/// hold terms up to e^slack; a negative option means 0, rescale whenever a maximum rises).
pub const TILE_MAX_SLACK: f32 = 2.0;

/// The default [`AttendOptions::rescale_slack`].
pub const RESCALE_SLACK: f32 = TILE_MAX_SLACK;

/// The largest [`AttendOptions::rescale_slack`] accepted (the tile kernel takes at most
/// [`TILE_MAX_SLACK`] of it).
pub const MAX_RESCALE_SLACK: f32 = 40.0;

/// An f32 as a WGSL literal (finite: checked by [`Attention::new`]).
fn wgsl_f32(x: f32) -> String {
    let s = format!("{x:?}");
    if s.contains(['.', 'e']) { s } else { format!("{s}.0") }
}

/// The most query heads per KV head ([`AttendOptions::group`]).
pub const MAX_GROUP: u32 = 8;
/// The most pages per split chunk ([`AttendOptions::chunk_pages`]); the split kernels size
/// their per-chunk workgroup arrays by it.
pub const MAX_CHUNK_PAGES: u32 = 64;

/// Refuse pages per split chunk outside 1 to [`MAX_CHUNK_PAGES`] (the decode split's and the
/// prefill's).
pub(crate) fn check_chunk_pages(chunk_pages: u32) -> Result<()> {
    if chunk_pages == 0 || chunk_pages > MAX_CHUNK_PAGES {
        return Err(Error::config("chunk_pages", chunk_pages, format!("must be in 1..={MAX_CHUNK_PAGES}")));
    }
    Ok(())
}
/// The most [`AttendOptions::tokens_in_flight`] accepted.
pub const MAX_TOKENS_IN_FLIGHT: u32 = 8;

/// The best subgroup layout for this shape and device, if any: 16 lanes when subgroups are that
/// wide (NVIDIA, AMD, Apple), else 8; each lane loads at most 4 16-byte words per row.
pub fn subgroup_layout(rt: &Runtime, head_dim: u32, dtype: KvDtype) -> Option<SplitVariant> {
    subgroup_layout_with(rt, head_dim, dtype, &[16, 8])
}

/// The first of `lanes_choices` that this device and shape allow.
pub fn subgroup_layout_with(rt: &Runtime, head_dim: u32, dtype: KvDtype, lanes_choices: &[u32]) -> Option<SplitVariant> {
    if rt.tier != Tier::Subgroups {
        return None;
    }
    let vals_per_vec4 = match dtype {
        KvDtype::F16 => 8,
        KvDtype::F32 => 4,
    };
    if !head_dim.is_multiple_of(vals_per_vec4) {
        return None;
    }
    let vec4s = head_dim / vals_per_vec4;
    for &lanes in lanes_choices {
        if rt.caps.subgroup_min_size >= lanes && vec4s.is_multiple_of(lanes) && (1..=4).contains(&(vec4s / lanes)) {
            return Some(SplitVariant::Subgroup { lanes, vpl: vec4s / lanes });
        }
    }
    None
}

const QUANT_MAX_IN_FLIGHT: u32 = 2;

/// Code and parameter words per lane the quantised kernel loads together before using any (its
/// `PF` slots times the words per slot: two code words and one parameter word per lane at int4
/// with 16 lanes, four and two at int8), at most [`QUANT_PREFETCH_SLOTS`] slots. On an H200,
/// b8 x 32K, the kernel alone: int8 0.476 ms at 2 slots, 0.411 at 4, 0.418 at 8; int4 with f32
/// key scores 0.457 / 0.394 / 0.382, 0.695 at 16 (registers spill).
const QUANT_PREFETCH_WORDS: u32 = 24;

/// The most slots per prefetch block, measured on int4 with the int8 query (H200, b8 x 32K, the
/// kernel alone: 0.377 ms at 2 slots, 0.344 at 4, 0.381 at 8); int8 at d = 128 takes 4 slots
/// either way, other shapes are capped unmeasured.
const QUANT_PREFETCH_SLOTS: u32 = 4;

/// The fast quantised kernel (`attend/split_quant.wgsl`) for KIVI pages, when the raw pages run
/// the subgroup kernel and the shape fits it.
#[derive(Clone, Copy, Debug)]
struct QuantFast {
    lanes: u32,
    bits: u32,
    /// Slots in flight through the softmax (`U`).
    u: u32,
    /// Slots loaded together (`PF`, a multiple of `u` dividing the page size).
    prefetch: u32,
    /// Whether one value-parameter word serves a whole code word (`VP_PER_WORD`).
    vp_per_word: bool,
}

fn quant_fast_path(cfg: &crate::config::PoolConfig, variant: SplitVariant, opts: &AttendOptions) -> Option<QuantFast> {
    let SplitVariant::Subgroup { lanes, .. } = variant else { return None };
    let (bits, group) = match cfg.codec {
        crate::config::Codec::Int8 { group } => (8, group),
        crate::config::Codec::Int4 { group } => (4, group),
        _ => return None,
    };
    let dims_per_lane_word = 32 / bits * lanes;
    // Slots in flight: the largest divisor of the page size within the option, at most 2 (on an
    // H200, b8 x 32K int4: 0.47 ms at 2, 0.50 at 8, 0.61 at 1, 0.69 at 4; more registers per
    // slot than the f16 kernel).
    let u = (1..=opts.tokens_in_flight.min(cfg.page_size).min(QUANT_MAX_IN_FLIGHT)).rev().find(|u| cfg.page_size.is_multiple_of(*u))?;
    let vp_per_word = group.is_multiple_of(32 / bits);
    let words = cfg.head_dim / dims_per_lane_word;
    let words_per_slot = 2 * words + if vp_per_word { words } else { words * (32 / bits / 4) };
    let cap = (QUANT_PREFETCH_WORDS / words_per_slot.max(1)).min(QUANT_PREFETCH_SLOTS);
    let prefetch = (u..=cap.max(u).min(cfg.page_size)).rev().find(|p| p.is_multiple_of(u) && cfg.page_size.is_multiple_of(*p)).unwrap_or(u);
    (cfg.head_dim.is_multiple_of(dims_per_lane_word) && group.is_multiple_of(4) && opts.group * cfg.head_dim <= 2048 && opts.group <= 16)
        .then_some(QuantFast { lanes, bits, u, prefetch, vp_per_word })
}

/// The tile kernel (`attend/split_quant_tile.wgsl`) for int4 pages, when the device has subgroups
/// and shader-f16 and the shape fits it.
#[derive(Clone, Copy, Debug)]
struct QuantTile {
    /// Value groups per row.
    ng: u32,
    /// The kernel also reads the raw pages (the pool has one buffer, of f16 rows), so no other
    /// split pass runs.
    raw: bool,
    slack: f32,
    flush: u32,
    /// log2 of the f16 terms' scale.
    k: i32,
    /// Invocations per workgroup (`WG`): a tile is this many tokens.
    wg: u32,
    /// Channels per fold item (`FC`): 8 where the subgroups span the d / 8 lanes of a page's
    /// fold reduction, else 16.
    fold_ch: u32,
    /// The value codes as the f16 code x 2^-20, half of them subnormal f16 by a mask alone
    /// (`DENORM`).
    denorm: bool,
    /// The key rows' high nibbles read in place as signed bytes (`KSIGNED`).
    ksigned: bool,
    /// The probabilities written before the rescale's flag is read, one barrier per tile fewer
    /// (`PS_EARLY`).
    ps_early: bool,
}

/// Workgroup memory of the tile kernel at this shape (mirrors its declarations).
fn quant_tile_shared_bytes(group: u32, d: u32, p: u32, ng: u32, wg: u32) -> u32 {
    let (ppt, rw, gp, gq) = (wg / p, d / 8, group.div_ceil(2), group.div_ceil(4));
    let chunk = 2 * 64 * 4 + 3 * 72 * 4;
    let q = group * d * 4;
    let q8 = ppt * (rw * gp + 1) * 16;
    let ab = ppt * group * 8;
    let ps = wg * ng * gq * 16;
    let red = 16 * (group + group * ng) * 4;
    chunk + q + q8 + ab + ps + red + 24
}

fn quant_tile_path(rt: &Runtime, pool: &KvPool, opts: &AttendOptions, denorm: bool) -> Result<Option<QuantTile>> {
    let cfg = &pool.cfg;
    let wg = if opts.tile_wg == 0 { TILE_WG.max(cfg.page_size) } else { opts.tile_wg };
    let why_not = || -> Option<String> {
        let crate::config::Codec::Int4 { group: vg } = cfg.codec else { return Some("the pool's codec is not int4".into()) };
        if rt.tier != Tier::Subgroups {
            return Some("the device has no subgroups".into());
        }
        if !rt.caps.f16 {
            return Some("the device has no shader-f16".into());
        }
        let d = cfg.head_dim;
        if ![32, 64, 128].contains(&d) {
            return Some(format!("head_dim {d} is not 32, 64 or 128"));
        }
        if ![16, 32, 64, 128].contains(&cfg.page_size) {
            return Some(format!("page_size {} is not 16, 32, 64 or 128", cfg.page_size));
        }
        if cfg.page_size > wg {
            return Some(format!("page_size {} is larger than the tile kernel's {wg} invocations (tile_wg)", cfg.page_size));
        }
        if !vg.is_multiple_of(8) || !d.is_multiple_of(vg) || (d / vg) * opts.group.div_ceil(4) > 8 {
            return Some(format!("value group {vg}: needs a multiple of 8 with (d / group) x ceil(heads / 4) <= 8"));
        }
        if opts.group > MAX_GROUP || !cfg.codec.page_words(cfg.page_size, d).is_multiple_of(4) {
            return Some("the page is not a whole number of 16-byte words".into());
        }
        let shared = quant_tile_shared_bytes(opts.group, d, cfg.page_size, d / vg, wg);
        if shared > rt.caps.max_workgroup_storage_bytes {
            return Some(format!("it needs {shared} bytes of workgroup memory, the device allows {}", rt.caps.max_workgroup_storage_bytes));
        }
        None
    };
    let reason = why_not();
    match (opts.quant_kernel, reason) {
        (QuantKernel::SlotBlock | QuantKernel::Coop, _) => Ok(None),
        (QuantKernel::Tile, Some(why)) => Err(Error::config("quant_kernel", "tile", format!("the tile kernel cannot run: {why}"))),
        (QuantKernel::Auto, Some(_)) => Ok(None),
        // Pages of 16 fold their key parameters into the queries for every 16 tokens: there the
        // slot-block kernel is faster (H200, b8 x 32768: 0.394 ms against 0.60).
        (QuantKernel::Auto, None) if cfg.page_size < 32 => Ok(None),
        (_, None) => {
            let crate::config::Codec::Int4 { group: vg } = cfg.codec else { unreachable!("checked by why_not") };
            let slack = opts.rescale_slack.clamp(0.0, TILE_MAX_SLACK);
            let flush = opts.f16_flush_tiles;
            // Each invocation sums at most flush x d / 8 terms, each below e^slack x 2^k x 15,
            // between moves into f32: the largest k that keeps that below 60000 (f16 max 65504).
            let terms = f64::from(flush * cfg.head_dim / 8) * 15.0 * f64::from(slack).exp();
            // With the codes as code x 2^-20 (`DENORM`) each term is that times 2^-20, so the
            // bound is the f16 weights themselves, each below e^slack x 2^k.
            let k = if denorm {
                (60000.0 / f64::from(slack).exp()).log2().min((60000.0 / terms).log2() + 20.0)
            } else {
                (60000.0 / terms).log2()
            };
            let k = k.floor().clamp(-14.0, 14.0) as i32;
            // The raw pages too when the pool is one buffer of f16 rows (no raw pass then).
            let raw = pool.n_buffers() == 1 && cfg.dtype == KvDtype::F16;
            // The key row's high nibbles read as signed codes, and the probabilities written
            // before the rescale's flag is read, unless the options say otherwise.
            let ksigned = opts.tile_signed_high_nibbles;
            let ps_early = opts.tile_early_probs;
            // Eight channels per fold item where a subgroup holds a row's d / 8 lanes.
            let fold_ch = if rt.caps.subgroup_min_size >= cfg.head_dim / 8 { 8 } else { 16 };
            Ok(Some(QuantTile { ng: cfg.head_dim / vg, raw, slack, flush, k, wg, fold_ch, denorm, ksigned, ps_early }))
        }
    }
}

/// The tensor-core kernel (`attend/split_quant_coop.wgsl`) for int4 pages: value groups per
/// row, subgroups per workgroup, and the lazy rescale's slack.
#[derive(Clone, Copy, Debug)]
struct QuantCoop {
    ng: u32,
    nw: u32,
    slack: f32,
}

/// Workgroup memory of the tensor-core kernel at this shape (mirrors its declarations).
fn quant_coop_shared_bytes(group: u32, d: u32, ng: u32, nw: u32) -> u32 {
    let row = (d / 4 + 2) * 8;
    let fixed = 5 * 64 * 4 + 3 * 4 + 2 * group * d * 4 + 16 * row + group * 16 + 64 * 8;
    let per_subgroup = 16 * row + 256 * 4 + ng * 64 * 8 + group * (2 + ng) * 4;
    fixed + nw * per_subgroup
}

/// The most subgroups per workgroup of the tensor-core kernel.
const COOP_MAX_SUBGROUPS: u32 = 4;

fn quant_coop_path(rt: &Runtime, pool: &KvPool, opts: &AttendOptions) -> Result<Option<QuantCoop>> {
    let cfg = &pool.cfg;
    let why_not = || -> std::result::Result<(u32, u32), String> {
        let crate::config::Codec::Int4 { group: vg } = cfg.codec else { return Err("the pool's codec is not int4".into()) };
        if !rt.caps.coop_f16 {
            return Err("the device offers no 16 x 16 x 16 f16 -> f32 cooperative matrices through wgpu".into());
        }
        if rt.tier != Tier::Subgroups || rt.caps.subgroup_min_size != 32 || rt.caps.subgroup_max_size != 32 {
            return Err(format!(
                "it needs subgroups of exactly 32 invocations (the device's hold {}..{})",
                rt.caps.subgroup_min_size, rt.caps.subgroup_max_size
            ));
        }
        let d = cfg.head_dim;
        if ![32, 64, 128].contains(&d) {
            return Err(format!("head_dim {d} is not 32, 64 or 128"));
        }
        if !cfg.page_size.is_multiple_of(16) || cfg.page_size > 128 {
            return Err(format!("page_size {} is not a multiple of 16 up to 128", cfg.page_size));
        }
        if !vg.is_multiple_of(16) || !d.is_multiple_of(vg) {
            return Err(format!("value group {vg} is not a multiple of 16 dividing head_dim {d}"));
        }
        if opts.group > 8 {
            return Err(format!("{} query heads per KV head, more than 8", opts.group));
        }
        if !cfg.codec.page_words(cfg.page_size, d).is_multiple_of(4) {
            return Err("the page is not a whole number of 16-byte words".into());
        }
        let ng = d / vg;
        let tiles = cfg.page_size / 16;
        // The most subgroups that divide the page's 16-token tiles and fit the workgroup memory.
        let limit = rt.caps.max_workgroup_storage_bytes;
        let nw = [4u32, 2, 1]
            .into_iter()
            .find(|&nw| nw <= COOP_MAX_SUBGROUPS && tiles.is_multiple_of(nw) && quant_coop_shared_bytes(opts.group, d, ng, nw) <= limit);
        let Some(nw) = nw else {
            return Err(format!(
                "it needs {} bytes of workgroup memory, the device allows {limit}",
                quant_coop_shared_bytes(opts.group, d, ng, 1)
            ));
        };
        Ok((ng, nw))
    };
    match (opts.quant_kernel, why_not()) {
        (QuantKernel::Coop, Err(why)) => Err(Error::config("quant_kernel", "coop", format!("the tensor-core kernel cannot run: {why}"))),
        (QuantKernel::Coop, Ok((ng, nw))) => Ok(Some(QuantCoop { ng, nw, slack: opts.rescale_slack.clamp(0.0, TILE_MAX_SLACK) })),
        _ => Ok(None),
    }
}

/// Split-K decode attention over a pool's page lists, one layer per call: the kernels chosen for
/// the device and pool, and their buffers.
pub struct Attention {
    /// The options it was built with.
    pub opts: AttendOptions,
    /// The runtime it was made with (calls with another are refused).
    owner: crate::runtime::RuntimeId,
    /// The split kernel that reads the raw pages.
    pub variant: SplitVariant,
    /// Chunks per page list: `max_pages_per_seq / chunk_pages`, rounded up.
    pub n_chunks: u32,
    /// Tokens of the longest page list, `max_pages_per_seq * page_size`: the row length of
    /// `scores`.
    pub max_tokens: u32,
    q_heads: u32,
    head_dim: u32,
    split: wgpu::ComputePipeline,
    reduce: wgpu::ComputePipeline,
    mass: Option<wgpu::ComputePipeline>,
    params: wgpu::Buffer,
    /// Queries, f32 `[seq][q_head][head_dim]` ([`Attention::set_queries`], or written on the GPU).
    pub queries: wgpu::Buffer,
    /// The split pass's partial results, per (seq, q_head, buffer, chunk) a record of
    /// `head_dim + 4` f32: running max, sum of exponentials, two zeros, the unnormalised
    /// output. Buffers are the pool's K/V buffers, plus one for compressed pages.
    pub partials: wgpu::Buffer,
    /// Scaled scores q.k, f32 `[seq][q_head][max_tokens]` by slot of the page list, for the
    /// mass pass (4 bytes when `opts.mass` is off).
    pub scores: wgpu::Buffer,
    /// Attention output, f32 `[seq][q_head][head_dim]` ([`Attention::output`]).
    pub out: wgpu::Buffer,
    /// The reduce pass's final (max, sum of exponentials) per (seq, q_head), two f32 each, for
    /// the mass pass.
    pub stats: wgpu::Buffer,
    split_bgs: Vec<wgpu::BindGroup>,
    codec_split: Option<(wgpu::ComputePipeline, wgpu::BindGroup)>,
    /// Which kernel reads the compressed pages (for `describe`).
    codec_kernel: Option<String>,
    reduce_bg: wgpu::BindGroup,
    mass_bg: Option<wgpu::BindGroup>,
    n_buffers: u32,
    kv_heads: u32,
    scale: f32,
    /// Every layer's parameters and queries for one submission ([`Attention::stage_layers`]).
    stage: Option<(wgpu::Buffer, wgpu::Buffer, u32)>,
    /// Layers the last staging call staged (the buffers may hold more from an earlier one).
    staged: u32,
    /// Layers whose queries the last [`Attention::stage_queries`] staged.
    staged_queries: u32,
    /// See [`Attention::int8_query_scores`].
    int8_query: bool,
    /// The tile kernel reads the raw pages too: the raw split pass does not run.
    raw_fused: bool,
}

impl Attention {
    /// Attention over the pool's own page lists: checks `opts` against the pool and device and
    /// builds the fastest kernels they allow ([`Attention::with_lists`] for other lists).
    pub async fn new(rt: &Runtime, pool: &KvPool, opts: AttendOptions) -> Result<Attention> {
        Self::with_lists(rt, pool, opts, None).await
    }

    /// Attention over other page lists than the pool's own (QUEST's selected pages): a buffer of
    /// lists in the pool's layout and their lengths.
    pub async fn with_lists(
        rt: &Runtime,
        pool: &KvPool,
        opts: AttendOptions,
        lists: Option<(&wgpu::Buffer, &wgpu::Buffer)>,
    ) -> Result<Attention> {
        rt.check_owner(pool.owner(), "the pool")?;
        let (page_list, page_counts) = lists.unwrap_or((&pool.page_list, &pool.page_counts));
        let cfg = &pool.cfg;
        if opts.group == 0 || opts.group > MAX_GROUP {
            return Err(Error::config("group", opts.group, format!("query heads per KV head must be in 1..={MAX_GROUP}")));
        }
        if opts.n_seqs == 0 || opts.n_seqs > cfg.max_seqs {
            return Err(Error::config("n_seqs", opts.n_seqs, format!("must be in 1..={} (the pool's max_seqs)", cfg.max_seqs)));
        }
        if !(1..=MAX_TOKENS_IN_FLIGHT).contains(&opts.tokens_in_flight) {
            return Err(Error::config("tokens_in_flight", opts.tokens_in_flight, format!("must be in 1..={MAX_TOKENS_IN_FLIGHT}")));
        }
        check_chunk_pages(opts.chunk_pages)?;
        if !opts.rescale_slack.is_finite() || opts.rescale_slack > MAX_RESCALE_SLACK {
            return Err(Error::config("rescale_slack", opts.rescale_slack, format!("must be finite and at most {MAX_RESCALE_SLACK}")));
        }
        if ![0, 32, 64, 128].contains(&opts.tile_wg) {
            return Err(Error::config("tile_wg", opts.tile_wg, "must be 0 (the default), 32, 64 or 128"));
        }
        if !(1..=MAX_F16_FLUSH_TILES).contains(&opts.f16_flush_tiles) {
            return Err(Error::config("f16_flush_tiles", opts.f16_flush_tiles, format!("must be in 1..={MAX_F16_FLUSH_TILES}")));
        }
        let variant = match opts.variant {
            Some(v @ SplitVariant::Subgroup { lanes, .. }) => {
                if subgroup_layout_with(rt, cfg.head_dim, cfg.dtype, &[lanes]) != Some(v) {
                    return Err(Error::config("variant", v.name(), "this device or shape cannot run the subgroup kernel; use tiled"));
                }
                v
            }
            Some(SplitVariant::Tiled) => SplitVariant::Tiled,
            None => subgroup_layout(rt, cfg.head_dim, cfg.dtype).unwrap_or(SplitVariant::Tiled),
        };
        let q_heads = cfg.kv_heads * opts.group;
        let d = cfg.head_dim;
        let n_chunks = cfg.max_pages_per_seq().div_ceil(opts.chunk_pages);
        // Compressed pages get one more partial slot, after the raw pool buffers' (none when the
        // tile kernel reads the raw pages too).
        let has_codec = cfg.codec != crate::config::Codec::None;
        let quant_coop = if has_codec { quant_coop_path(rt, pool, &opts)? } else { None };
        let quant_tile = if has_codec && quant_coop.is_none() {
            let subnormals =
                opts.tile_subnormal_codes && matches!(cfg.codec, crate::config::Codec::Int4 { .. }) && rt.f16_subnormals().await?;
            quant_tile_path(rt, pool, &opts, subnormals)?
        } else {
            None
        };
        let raw_fused = quant_tile.is_some_and(|t| t.raw);
        let n_buffers = if raw_fused { 1 } else { pool.n_buffers() as u32 + u32::from(has_codec) } + u32::from(opts.recall);
        let max_tokens = cfg.max_pages_per_seq() * cfg.page_size;
        let split = match variant {
            SplitVariant::Tiled => rt.pipeline(Kernel::AttendSplitTiled, &[]).await?,
            SplitVariant::Subgroup { lanes, vpl } => {
                let transpose = opts.transpose && opts.group.is_power_of_two() && opts.group <= lanes;
                rt.pipeline_with(
                    Kernel::AttendSplitSubgroup,
                    &[
                        ("GROUP", format!("{}u", opts.group)),
                        ("LANES", format!("{lanes}u")),
                        ("VPL", format!("{vpl}u")),
                        ("F16", (cfg.dtype == KvDtype::F16).to_string()),
                        ("PAGE_SIZE", format!("{}u", cfg.page_size)),
                        ("U", format!("{}u", opts.tokens_in_flight)),
                        ("TRANSPOSE", transpose.to_string()),
                    ],
                    &[],
                )
                .await?
            }
        };
        let reduce = rt.pipeline(Kernel::AttendReduce, &[]).await?;
        let mass = if opts.mass { Some(rt.pipeline(Kernel::AttendMass, &[]).await?) } else { None };

        let seqs = u64::from(opts.n_seqs);
        let qh = u64::from(q_heads);
        let partial_floats = seqs * qh * u64::from(n_buffers) * u64::from(n_chunks) * u64::from(d + 4);
        let score_floats = if opts.mass { seqs * qh * u64::from(max_tokens) } else { 1 };
        for (what, bytes) in [("attention partials", partial_floats * 4), ("attention scores", score_floats * 4)] {
            rt.fits_binding(what, bytes)?;
        }
        let params = rt.uniform("attend params", &AttendParams::default());
        let queries = rt.storage("attend queries", seqs * qh * u64::from(d) * 4);
        let partials = rt.storage("attend partials", partial_floats * 4);
        let scores = rt.storage("attend scores", score_floats * 4);
        let out = rt.storage("attend out", seqs * qh * u64::from(d) * 4);
        let stats = rt.storage("attend stats", seqs * qh * 8);
        let dims = rt.uniform("attend dims", &[d, 0u32, 0, 0]);
        let split_label = match variant {
            SplitVariant::Tiled => Kernel::AttendSplitTiled.label(),
            SplitVariant::Subgroup { .. } => Kernel::AttendSplitSubgroup.label(),
        };
        let split_bgs = pool
            .kv_buffers
            .iter()
            .zip(&pool.window_bufs)
            .map(|(kv, w)| {
                rt.bind(
                    split_label,
                    &split,
                    &[&pool.geometry, &params, w, page_list, page_counts, &pool.page_meta, kv, &queries, &partials, &scores],
                )
            })
            .collect();
        let quant_fast = if cfg.codec.rank().is_none() && quant_tile.is_none() && quant_coop.is_none() {
            quant_fast_path(cfg, variant, &opts)
        } else {
            None
        };
        let codec_split = if let Some(rank) = cfg.codec.rank() {
            if opts.group > 8 || opts.group * rank > 1024 {
                return Err(Error::config(
                    "codec.rank",
                    rank,
                    format!("the low-rank attention holds group x rank <= 1024 and group <= 8 (group {})", opts.group),
                ));
            }
            let p = rt.pipeline(Kernel::AttendSplitLowrank, &[]).await?;
            let bg = rt.bind(
                Kernel::AttendSplitLowrank.label(),
                &p,
                &[
                    &pool.geometry,
                    &params,
                    page_list,
                    page_counts,
                    &pool.page_meta,
                    &pool.codec_kv,
                    &queries,
                    &partials,
                    &scores,
                    &pool.codec_basis,
                ],
            );
            Some((p, bg))
        } else if let Some(QuantCoop { ng, nw, slack }) = quant_coop {
            let p = rt
                .pipeline_with(
                    Kernel::AttendSplitQuantCoop,
                    &[
                        ("GROUP", format!("{}u", opts.group)),
                        ("HEAD_DIM", format!("{}u", cfg.head_dim)),
                        ("PAGE_SIZE", format!("{}u", cfg.page_size)),
                        ("NG", format!("{ng}u")),
                        ("NW", format!("{nw}u")),
                        ("SLACK", wgsl_f32(slack)),
                    ],
                    &[],
                )
                .await?;
            let bg = rt.bind(
                Kernel::AttendSplitQuantCoop.label(),
                &p,
                &[&pool.geometry, &params, page_list, page_counts, &pool.page_meta, &pool.codec_kv, &queries, &partials, &scores],
            );
            Some((p, bg))
        } else if let Some(QuantTile { ng, raw, slack, flush, k, wg, fold_ch, denorm, ksigned, ps_early }) = quant_tile {
            let p = rt
                .pipeline_with(
                    Kernel::AttendSplitQuantTile,
                    &[
                        ("GROUP", format!("{}u", opts.group)),
                        ("HEAD_DIM", format!("{}u", cfg.head_dim)),
                        ("PAGE_SIZE", format!("{}u", cfg.page_size)),
                        ("NG", format!("{ng}u")),
                        ("FLUSH", format!("{flush}u")),
                        ("RAW", raw.to_string()),
                        ("SLACK", wgsl_f32(slack)),
                        ("KSCALE", wgsl_f32(2f32.powi(k))),
                        ("WG", format!("{wg}u")),
                        ("FC", format!("{fold_ch}u")),
                        ("DENORM", denorm.to_string()),
                        ("KSIGNED", ksigned.to_string()),
                        ("PS_EARLY", ps_early.to_string()),
                    ],
                    &[],
                )
                .await?;
            let bg = rt.bind(
                Kernel::AttendSplitQuantTile.label(),
                &p,
                &[
                    &pool.geometry,
                    &params,
                    &pool.window_bufs[0],
                    page_list,
                    page_counts,
                    &pool.page_meta,
                    &pool.codec_kv,
                    &pool.kv_buffers[0],
                    &queries,
                    &partials,
                    &scores,
                ],
            );
            Some((p, bg))
        } else if let Some(QuantFast { lanes, bits, u, prefetch, vp_per_word }) = quant_fast {
            let transpose = opts.transpose && opts.group.is_power_of_two() && opts.group <= lanes;
            let p = rt
                .pipeline_with(
                    Kernel::AttendSplitQuant,
                    &[
                        ("GROUP", format!("{}u", opts.group)),
                        ("LANES", format!("{lanes}u")),
                        ("BITS", format!("{bits}u")),
                        ("HEAD_DIM", format!("{}u", cfg.head_dim)),
                        ("PAGE_SIZE", format!("{}u", cfg.page_size)),
                        ("U", format!("{u}u")),
                        ("PF", format!("{prefetch}u")),
                        ("VP_PER_WORD", vp_per_word.to_string()),
                        ("TRANSPOSE", transpose.to_string()),
                    ],
                    &[],
                )
                .await?;
            let bg = rt.bind(
                Kernel::AttendSplitQuant.label(),
                &p,
                &[&pool.geometry, &params, page_list, page_counts, &pool.page_meta, &pool.codec_kv, &queries, &partials, &scores],
            );
            Some((p, bg))
        } else if has_codec {
            let p = rt.pipeline(Kernel::AttendSplitCodec, &[]).await?;
            let bg = rt.bind(
                Kernel::AttendSplitCodec.label(),
                &p,
                &[&pool.geometry, &params, page_list, page_counts, &pool.page_meta, &pool.codec_kv, &queries, &partials, &scores],
            );
            Some((p, bg))
        } else {
            None
        };
        let codec_kernel = if cfg.codec.is_low_rank() {
            Some("lowrank".to_string())
        } else if let Some(c) = quant_coop {
            Some(format!("quant-coop subgroups={} slack={}", c.nw, c.slack))
        } else if let Some(t) = quant_tile {
            Some(format!(
                "quant-tile wg={} fold={} flush={} slack={} k={}{}{}{}{}",
                t.wg,
                t.fold_ch,
                t.flush,
                t.slack,
                t.k,
                if t.denorm { " subnormal-codes" } else { "" },
                if t.ksigned { " signed-high-nibbles" } else { "" },
                if t.ps_early { " early-probs" } else { "" },
                if t.raw { ", raw pages too" } else { "" },
            ))
        } else if let Some(f) = quant_fast {
            Some(format!("quant-subgroup u={} pf={}", f.u, f.prefetch))
        } else if has_codec {
            Some("codec-portable".to_string())
        } else {
            None
        };
        let reduce_bg = rt.bind(Kernel::AttendReduce.label(), &reduce, &[&params, &dims, &partials, &out, &stats]);
        let mass_bg = mass.as_ref().map(|m| {
            rt.bind(
                Kernel::AttendMass.label(),
                m,
                &[&pool.geometry, &params, page_list, page_counts, &pool.page_meta, &scores, &stats, &pool.slot_meta],
            )
        });
        rt.check("attention setup")?;
        Ok(Attention {
            owner: rt.id(),
            variant,
            n_chunks,
            max_tokens,
            q_heads,
            head_dim: d,
            split,
            reduce,
            mass,
            params,
            queries,
            partials,
            scores,
            out,
            stats,
            split_bgs,
            codec_split,
            codec_kernel,
            reduce_bg,
            mass_bg,
            n_buffers,
            kv_heads: cfg.kv_heads,
            scale: 1.0 / (d as f32).sqrt(),
            stage: None,
            staged: 0,
            staged_queries: 0,
            int8_query: quant_fast.is_some_and(|f| f.bits == 4) || quant_tile.is_some() || quant_coop.is_some(),
            raw_fused,
            opts,
        })
    }

    /// Query heads per sequence: the pool's `kv_heads` x `opts.group`.
    pub fn q_heads(&self) -> u32 {
        self.q_heads
    }

    /// Whether compressed pages are scored with the page-folded query quantised to int8 (the
    /// fast quantised kernel over int4 pages): the CPU reference of that arithmetic is
    /// [`crate::reference::attend_decode_int8_query`].
    pub fn int8_query_scores(&self) -> bool {
        self.int8_query
    }

    /// Whether the compressed pages' values are summed in f16 over a few tiles (the tile
    /// kernel) or weighted by f16 weights (the tensor-core kernel), which the tests allow a
    /// tolerance of f16's precision.
    pub fn f16_value_sums(&self) -> bool {
        self.codec_kernel.as_deref().is_some_and(|k| k.starts_with("quant-tile") || k.starts_with("quant-coop"))
    }

    /// The f64 reference of what this attention computes for `layer` of `model` (the pool's
    /// CPU model) with `queries`: over each list's pages, or over `pages(seq, head)` (QUEST's
    /// selection); int4 pages scored with the int8 query when the kernel does.
    pub fn cpu_reference(
        &self,
        model: &crate::reference::PoolModel,
        layer: u32,
        queries: &[f32],
        pages: Option<&dyn Fn(u32, u32) -> Vec<u32>>,
    ) -> crate::reference::AttentionOutput {
        use crate::reference::attend::{attend_decode_int8_query_over, attend_decode_over};
        let list = |seq, head| model.page_list(layer, seq, head);
        let pages = pages.unwrap_or(&list);
        let (n, group) = (self.opts.n_seqs, self.opts.group);
        if self.int8_query {
            attend_decode_int8_query_over(model, n, queries, group, self.scale, pages)
        } else {
            attend_decode_over(model, layer, n, queries, group, f64::from(self.scale), pages)
        }
    }

    /// Every output element's tolerance against [`Attention::cpu_reference`]'s `out` (same
    /// arguments): [`crate::reference::attend::ATTENTION_ATOL`] and `_RTOL` of the reference,
    /// plus, where this kernel sums values in f16, [`crate::reference::attend::F16_SUMS_TOL`] of
    /// what those sums hold; and then what those sums hold, element by element, for the
    /// per-vector check ([`crate::reference::attend::f16_sums_vector_excess`]).
    pub fn output_tolerance(
        &self,
        model: &crate::reference::PoolModel,
        layer: u32,
        queries: &[f32],
        pages: Option<&dyn Fn(u32, u32) -> Vec<u32>>,
        reference: &[f64],
    ) -> (Vec<f64>, Option<Vec<f64>>) {
        use crate::reference::attend::{ATTENTION_ATOL, ATTENTION_RTOL, F16_SUMS_TOL, attend_decode_int8_query_code_part_over};
        let mut tol: Vec<f64> = reference.iter().map(|w| ATTENTION_ATOL + ATTENTION_RTOL * w.abs()).collect();
        if !self.f16_value_sums() {
            return (tol, None);
        }
        let list = |seq, head| model.page_list(layer, seq, head);
        let pages = pages.unwrap_or(&list);
        let part = attend_decode_int8_query_code_part_over(model, self.opts.n_seqs, queries, self.opts.group, self.scale, pages);
        for (t, c) in tol.iter_mut().zip(&part) {
            *t += F16_SUMS_TOL * c.abs();
        }
        (tol, Some(part))
    }

    /// Scale applied to q.k (1/sqrt(head_dim)).
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Upload queries, `[seq][q_head][head_dim]` f32; NaN or infinity is refused.
    pub fn set_queries(&self, rt: &Runtime, q: &[f32]) -> Result<()> {
        rt.check_owner(self.owner, "this attention")?;
        let want = (self.opts.n_seqs * self.q_heads * self.head_dim) as usize;
        if q.len() != want {
            return Err(Error::Input(format!("queries: {} values, expected n_seqs x q_heads x head_dim = {want}", q.len())));
        }
        if let Some(i) = q.iter().position(|v| !v.is_finite()) {
            return Err(Error::Input(format!("queries: value {i} is {} (not finite)", q[i])));
        }
        rt.queue.write_buffer(&self.queries, 0, bytemuck::cast_slice(q));
        Ok(())
    }

    /// Set layer and step for the next encoded call (staged: one call per submission).
    pub fn prepare(&self, rt: &Runtime, layer: u32, step: u32) {
        rt.queue.write_buffer(&self.params, 0, bytemuck::bytes_of(&self.params_for(layer, step)));
    }

    /// Stage every layer's queries (`queries[layer]`) and parameters for one submission: then
    /// [`Attention::encode_layer_inputs`] copies layer i's parameters and queries in place
    /// inside the command stream, before that layer's pass.
    pub fn stage_layers(&mut self, rt: &Runtime, step: u32, queries: &[Vec<f32>]) -> Result<()> {
        self.stage_queries(rt, queries)?;
        self.stage_params(rt, step, queries.len() as u32);
        Ok(())
    }

    /// Stage every layer's queries (`queries[layer]`, each `[seq][q_head][head_dim]`; NaN or
    /// infinity refused) for [`Attention::encode_layer_queries`].
    pub fn stage_queries(&mut self, rt: &Runtime, queries: &[Vec<f32>]) -> Result<()> {
        let qn = (self.opts.n_seqs * self.q_heads * self.head_dim) as usize;
        let layers = queries.len() as u32;
        for (l, q) in queries.iter().enumerate() {
            if q.len() != qn {
                return Err(Error::Input(format!("layer {l} queries: {} values, expected {qn}", q.len())));
            }
            if let Some(i) = q.iter().position(|v| !v.is_finite()) {
                return Err(Error::Input(format!("layer {l} queries: value {i} is {} (not finite)", q[i])));
            }
        }
        let (_, qb) = self.ensure_stage(rt, layers);
        self.staged_queries = layers;
        let Some((_, sq, _)) = &self.stage else { unreachable!("stage allocated above") };
        for (l, q) in queries.iter().enumerate() {
            rt.queue.write_buffer(sq, qb * l as u64, bytemuck::cast_slice(q));
        }
        Ok(())
    }

    /// Staging buffers for `layers` layers' parameters and queries (grown when too small);
    /// returns the bytes of one layer's parameters and of its queries.
    fn ensure_stage(&mut self, rt: &Runtime, layers: u32) -> (u64, u64) {
        let pb = std::mem::size_of::<AttendParams>() as u64;
        let qb = u64::from(self.opts.n_seqs * self.q_heads * self.head_dim) * 4;
        if self.stage.as_ref().is_none_or(|s| s.2 < layers) {
            self.stage = Some((
                rt.storage("attend staged params", pb * u64::from(layers)),
                rt.storage("attend staged queries", qb * u64::from(layers)),
                layers,
            ));
        }
        (pb, qb)
    }

    /// Copy layer `layer`'s staged parameters and queries into place (before its pass).
    pub fn encode_layer_inputs(&self, enc: &mut wgpu::CommandEncoder, layer: u32) -> Result<()> {
        self.encode_layer_params(enc, layer)?;
        self.encode_layer_queries(enc, layer)
    }

    /// Copy layer `layer`'s staged queries ([`Attention::stage_queries`]) into
    /// [`Attention::queries`].
    pub fn encode_layer_queries(&self, enc: &mut wgpu::CommandEncoder, layer: u32) -> Result<()> {
        let Some((_, sq, _)) = self.stage.as_ref().filter(|_| layer < self.staged_queries) else {
            return Err(Error::Input(format!("layer {layer}'s queries were not staged (stage_queries)")));
        };
        let qb = u64::from(self.opts.n_seqs * self.q_heads * self.head_dim) * 4;
        enc.copy_buffer_to_buffer(sq, qb * u64::from(layer), &self.queries, 0, qb);
        Ok(())
    }

    /// Stage every layer's parameters for one submission whose queries are written on the GPU
    /// (into [`Attention::queries`] by whatever runs before each layer's pass);
    /// [`Attention::encode_layer_params`] copies layer i's in place before its pass.
    pub fn stage_params(&mut self, rt: &Runtime, step: u32, layers: u32) {
        self.ensure_stage(rt, layers);
        self.staged = layers;
        let Some((sp, _, _)) = &self.stage else { unreachable!("stage allocated above") };
        let all: Vec<AttendParams> = (0..layers).map(|l| self.params_for(l, step)).collect();
        rt.queue.write_buffer(sp, 0, bytemuck::cast_slice(&all));
    }

    /// Copy layer `layer`'s staged parameters into place (before its pass).
    pub fn encode_layer_params(&self, enc: &mut wgpu::CommandEncoder, layer: u32) -> Result<()> {
        let Some((sp, _, _)) = &self.stage else {
            return Err(Error::Input("no staged layers: call stage_layers or stage_params first".into()));
        };
        if layer >= self.staged {
            return Err(Error::Input(format!("layer {layer} was not staged (the last staging had {} layers)", self.staged)));
        }
        let pb = std::mem::size_of::<AttendParams>() as u64;
        enc.copy_buffer_to_buffer(sp, pb * u64::from(layer), &self.params, 0, pb);
        Ok(())
    }

    /// The partial buffer index the recall pass writes ([`AttendOptions::recall`]): after the raw
    /// pool buffers', before the compressed pages' (whose kernels write the last).
    pub fn recall_slot(&self) -> Option<u32> {
        let codec = self.codec_kernel.is_some() || self.codec_split.is_some();
        self.opts.recall.then(|| self.n_buffers - 1 - u32::from(codec))
    }

    /// The uniform every pass of the next call reads its layer, step and shape from (the recall
    /// pass binds it too).
    pub fn params_buffer(&self) -> &wgpu::Buffer {
        &self.params
    }

    /// The output buffer, `[seq][q_head][head_dim]` f32, which later kernels may read directly.
    pub fn output(&self) -> &wgpu::Buffer {
        &self.out
    }

    fn params_for(&self, layer: u32, step: u32) -> AttendParams {
        AttendParams {
            n_seqs: self.opts.n_seqs,
            layer,
            group: self.opts.group,
            q_heads: self.q_heads,
            n_chunks: self.n_chunks,
            chunk_pages: self.opts.chunk_pages,
            n_buffers: self.n_buffers,
            write_scores: u32::from(self.opts.mass),
            max_tokens: self.max_tokens,
            step,
            scale: self.scale,
            _pad0: 0,
        }
    }

    /// The kernel and its knobs, as benchmarks report them.
    pub fn describe(&self) -> String {
        let raw = self.describe_raw();
        match &self.codec_kernel {
            Some(k) => format!("{raw}, compressed pages: {k}"),
            None => raw,
        }
    }

    fn describe_raw(&self) -> String {
        match self.variant {
            SplitVariant::Tiled => format!("tiled chunk={}", self.opts.chunk_pages),
            SplitVariant::Subgroup { lanes, vpl } => {
                let transpose = self.opts.transpose && self.opts.group.is_power_of_two() && self.opts.group <= lanes;
                format!(
                    "subgroup lanes={lanes} vpl={vpl} u={} {} chunk={}",
                    self.opts.tokens_in_flight,
                    if transpose { "transpose" } else { "butterfly" },
                    self.opts.chunk_pages
                )
            }
        }
    }

    /// Encode the split pass alone (one dispatch per pool buffer).
    pub fn encode_split(&self, pass: &mut wgpu::ComputePass<'_>) {
        if !self.raw_fused {
            pass.set_pipeline(&self.split);
            for bg in &self.split_bgs {
                pass.set_bind_group(0, bg, &[]);
                pass.dispatch_counted(self.n_chunks, self.kv_heads, self.opts.n_seqs);
            }
        }
        if let Some((p, bg)) = &self.codec_split {
            pass.set_pipeline(p);
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_counted(self.n_chunks, self.kv_heads, self.opts.n_seqs);
        }
    }

    /// Encode the compressed pages' split pass alone (nothing without a codec).
    pub fn encode_codec_split(&self, pass: &mut wgpu::ComputePass<'_>) {
        if let Some((p, bg)) = &self.codec_split {
            pass.set_pipeline(p);
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_counted(self.n_chunks, self.kv_heads, self.opts.n_seqs);
        }
    }

    /// Encode split (one dispatch per pool buffer), reduce and, if enabled, mass into one pass.
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>) {
        self.encode_split(pass);
        self.encode_merge(pass);
    }

    /// [`Attention::encode`] with `between` recorded after the split passes and before the
    /// reduce: the recall pass, which writes the partial records of [`Attention::recall_slot`].
    pub fn encode_with(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        between: impl FnOnce(&mut wgpu::ComputePass<'_>) -> Result<()>,
    ) -> Result<()> {
        self.encode_split(pass);
        between(pass)?;
        self.encode_merge(pass);
        Ok(())
    }

    /// Encode what follows the split pass (and a recall pass): the reduce, then the mass.
    pub fn encode_merge(&self, pass: &mut wgpu::ComputePass<'_>) {
        self.encode_reduce(pass);
        self.encode_mass(pass);
    }

    /// Encode the reduce pass alone: the split pass's partials merged into `out` and the final
    /// (max, sum) per (seq, q_head) into `stats`.
    pub fn encode_reduce(&self, pass: &mut wgpu::ComputePass<'_>) {
        pass.set_pipeline(&self.reduce);
        pass.set_bind_group(0, &self.reduce_bg, &[]);
        pass.dispatch_counted(self.q_heads, self.opts.n_seqs, 1);
    }

    /// Encode the attention-mass pass alone (nothing without `opts.mass`): it reads the split
    /// pass's scores and the final (max, sum) in `stats`, which the reduce pass writes, or
    /// another device's merge ([`crate::devices`]).
    pub fn encode_mass(&self, pass: &mut wgpu::ComputePass<'_>) {
        if let (Some(m), Some(bg)) = (&self.mass, &self.mass_bg) {
            pass.set_pipeline(m);
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_counted(self.max_tokens.div_ceil(64), self.opts.n_seqs * self.kv_heads, 1);
        }
    }

    /// Encode and submit one call on `layer` (it does not wait; [`Runtime::check`] reports errors).
    pub fn run(&self, rt: &Runtime, layer: u32, step: u32) -> Result<()> {
        rt.check_owner(self.owner, "this attention")?;
        self.prepare(rt, layer, step);
        let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("attend") });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("attend"), timestamp_writes: None });
            self.encode(&mut pass);
        }
        rt.queue.submit([enc.finish()]);
        rt.check("attend_decode")
    }

    /// Output, `[seq][q_head][head_dim]`.
    pub async fn read_output(&self, rt: &Runtime) -> Result<Vec<f32>> {
        rt.check_owner(self.owner, "this attention")?;
        rt.read(&self.out, 0, u64::from(self.opts.n_seqs * self.q_heads * self.head_dim)).await
    }

    /// Bytes of K and V one call reads for `tokens` cached tokens per sequence (all sequences).
    pub fn kv_bytes_read(&self, token_kv_bytes: u64, tokens_total: u64) -> u64 {
        token_kv_bytes * tokens_total
    }
}
