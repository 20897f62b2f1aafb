#![warn(missing_docs)]
//! Every WGSL kernel of expertkv, embedded as text.
//!
//! Files live under `wgsl/`, grouped by pipeline stage; shared definitions are in `wgsl/common/`
//! and are pulled in by `//!import <path>` lines, which [`resolve`] replaces by the file's text
//! (each file once). A line `//!define NAME default` becomes `const NAME = default;`, or the
//! value the runtime passes: used only where WGSL needs a true constant (the size of a
//! function-local array), everything else is a WGSL `override`. A line `//!unroll` before a
//! `for (var i = A; i < B; i++) {` loop whose bounds are constant expressions (integer literals,
//! module constants, + - * / % and parentheses) replaces the loop by one block per iteration
//! (`{ let i = 3u; ... }`), so every function-local array indexed by `i` is indexed by
//! constants: drivers keep such arrays in registers, where a loop they chose not to unroll
//! sends them to local memory (see [`unroll`]). Nothing else in the workspace
//! names a shader path: code asks for a [`Kernel`] and gets its resolved source, entry point and
//! label. A shared piece that uses a name its importers declare (a binding, a constant) says so in
//! an `//!expects <declaration>` line, a comment to the compiler, which the validation test puts
//! in front of the piece.

/// One embedded WGSL file: its path under `wgsl/` and its text.
#[derive(Clone, Copy, Debug)]
pub struct Source {
    /// Path under `wgsl/`, e.g. `common/pool.wgsl`; how `//!import` lines name the file.
    pub path: &'static str,
    /// The file's WGSL text as written, imports and defines unresolved.
    pub text: &'static str,
}

macro_rules! sources {
    ($($name:ident => $path:literal),* $(,)?) => {
        $(
            #[doc = concat!("`wgsl/", $path, "`")]
            pub const $name: Source = Source { path: $path, text: include_str!(concat!("../wgsl/", $path)) };
        )*
        /// Every WGSL file of the crate, kernels and shared pieces alike.
        pub const ALL_SOURCES: &[Source] = &[$($name),*];
    };
}

sources! {
    COMMON_POOL => "common/pool.wgsl",
    COMMON_WINDOW => "common/window.wgsl",
    COMMON_HALF => "common/half.wgsl",
    COMMON_QUANT => "common/quant.wgsl",
    COMMON_SCAN => "common/scan.wgsl",
    COMMON_RECALL => "common/recall.wgsl",
    COMMON_RADIX => "common/radix.wgsl",
    COMMON_REDUCE => "common/reduce.wgsl",
    COMMON_ROUTE => "common/route.wgsl",
    COMMON_APPEND => "common/append.wgsl",
    COMMON_COMPRESS => "common/compress.wgsl",
    COMMON_EVICT => "common/evict.wgsl",
    ROUTE_BIAS => "route/bias.wgsl",
    ROUTE_TOPK => "route/topk.wgsl",
    ROUTE_COUNT => "route/count.wgsl",
    ROUTE_STATS => "route/stats.wgsl",
    ROUTE_MISS => "route/miss.wgsl",
    ROUTE_ADAPTIVE => "route/adaptive.wgsl",
    APPEND_APPLY_ROUTING => "append/apply_routing.wgsl",
    APPEND_PLAN => "append/plan.wgsl",
    APPEND_ALLOC => "append/alloc.wgsl",
    APPEND_WRITE => "append/write.wgsl",
    APPEND_GATHER_PAGES => "append/gather_pages.wgsl",
    APPEND_RELEASE => "append/release.wgsl",
    COMPRESS_PLAN => "compress/plan.wgsl",
    COMPRESS_ENCODE => "compress/encode.wgsl",
    COMPRESS_THAW_PLAN => "compress/thaw_plan.wgsl",
    COMPRESS_THAW => "compress/thaw.wgsl",
    COMPRESS_GRAM => "compress/gram.wgsl",
    COMPRESS_BASIS => "compress/basis.wgsl",
    ATTEND_COMMON => "attend/common.wgsl",
    ATTEND_SOFTMAX => "attend/softmax.wgsl",
    ATTEND_CHUNK => "attend/chunk.wgsl",
    ATTEND_MERGE => "attend/merge.wgsl",
    ATTEND_ONLINE_SOFTMAX => "attend/online_softmax.wgsl",
    ATTEND_RAW_PAIRS => "attend/raw_pairs.wgsl",
    ATTEND_LANES => "attend/lanes.wgsl",
    ATTEND_SPLIT_TILED => "attend/split_tiled.wgsl",
    ATTEND_SPLIT_SUBGROUP => "attend/split_subgroup.wgsl",
    ATTEND_SPLIT_CODEC => "attend/split_codec.wgsl",
    ATTEND_SPLIT_LOWRANK => "attend/split_lowrank.wgsl",
    ATTEND_SPLIT_QUANT => "attend/split_quant.wgsl",
    ATTEND_SPLIT_QUANT_TILE => "attend/split_quant_tile.wgsl",
    ATTEND_SPLIT_QUANT_COOP => "attend/split_quant_coop.wgsl",
    ATTEND_REDUCE => "attend/reduce.wgsl",
    ATTEND_PREFILL => "attend/prefill.wgsl",
    ATTEND_MASS => "attend/mass.wgsl",
    ATTEND_RECALL => "attend/recall.wgsl",
    EVICT_SCORE => "evict/score.wgsl",
    EVICT_BUDGET => "evict/budget.wgsl",
    EVICT_SELECT => "evict/select.wgsl",
    EVICT_COMPACT => "evict/compact.wgsl",
    EVICT_MOVE => "evict/move.wgsl",
    EVICT_FREE => "evict/free.wgsl",
    EVICT_CAPTURE => "evict/capture.wgsl",
    EVICT_CAPTURE_COPY => "evict/capture_copy.wgsl",
    EVICT_DIGEST => "evict/digest.wgsl",
    EVICT_EKVA => "evict/ekva.wgsl",
    EVICT_QUEST_SUMMARIZE => "evict/quest_summarize.wgsl",
    EVICT_QUEST_SELECT => "evict/quest_select.wgsl",
    MODEL_PRODUCTS => "model/products.wgsl",
    MODEL_MATVEC => "model/matvec.wgsl",
    MODEL_MATMUL => "model/matmul.wgsl",
    MODEL_MOE_TILED => "model/moe_tiled.wgsl",
    MODEL_MOE => "model/moe.wgsl",
    MODEL_NORM_ROPE => "model/norm_rope.wgsl",
    MODEL_KV_PACK => "model/kv_pack.wgsl",
    MODEL_ROUTER => "model/router.wgsl",
    BENCH_COPY => "bench/copy.wgsl",
    BENCH_FMA => "bench/fma.wgsl",
    BENCH_COOP => "bench/coop.wgsl",
    PROBE_F16_SUBNORMAL => "probe/f16_subnormal.wgsl",
}

/// What a kernel needs from the device, or allows the runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Need {
    /// The SUBGROUP feature (only on the capability tier that has it).
    Subgroups,
    /// The SHADER_F16 feature (its text starts with `enable f16;`).
    F16,
    /// Every index is exercised by the GPU-vs-CPU tests over random shapes, so the runtime may
    /// build it without wgpu's bounds checks (never in a browser).
    Unchecked,
}

/// The embedded file at `path`, found at compile time (a kernel row naming no file does not build).
const fn source_at(path: &str) -> Source {
    let mut i = 0;
    while i < ALL_SOURCES.len() {
        let p = ALL_SOURCES[i].path.as_bytes();
        let q = path.as_bytes();
        if p.len() == q.len() {
            let mut j = 0;
            while j < p.len() && p[j] == q[j] {
                j += 1;
            }
            if j == p.len() {
                return ALL_SOURCES[i];
            }
        }
        i += 1;
    }
    panic!("a kernel names a file that is not in `sources!`")
}

macro_rules! entry_of {
    () => {
        "main"
    };
    ($entry:literal) => {
        $entry
    };
}

macro_rules! label_of {
    ($path:literal) => {
        $path
    };
    ($path:literal, $entry:literal) => {
        concat!($path, "#", $entry)
    };
}

/// One row per kernel: `Variant => "file" [# "entry point" where the file has several] [needs]`.
macro_rules! kernels {
    ($($(#[$doc:meta])* $name:ident => $path:literal $(# $entry:literal)? [$($need:ident),*]),* $(,)?) => {
        /// Every dispatchable kernel.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Kernel {
            $($(#[$doc])* $name),*
        }

        impl Kernel {
            /// Every kernel, in the order of the table.
            pub const ALL: &'static [Kernel] = &[$(Kernel::$name),*];

            /// The embedded file holding the kernel (imports unresolved; see [`Kernel::resolved`]).
            pub fn source(self) -> Source {
                match self {
                    $(Kernel::$name => const { source_at($path) }),*
                }
            }

            /// Label of every pipeline, bind group and buffer of this kernel: its path, and its
            /// entry point where the file has several.
            pub fn label(self) -> &'static str {
                match self {
                    $(Kernel::$name => label_of!($path $(, $entry)?)),*
                }
            }

            /// The kernel's entry point in its file (`main` where the file has only one).
            pub fn entry_point(self) -> &'static str {
                match self {
                    $(Kernel::$name => entry_of!($($entry)?)),*
                }
            }

            fn needs(self) -> &'static [Need] {
                match self {
                    $(Kernel::$name => &[$(Need::$need),*]),*
                }
            }
        }
    };
}

kernels! {
    /// Route, pass 1: each expert's score bias under the configured router, from the statistics.
    RouteBias => "route/bias.wgsl" [],
    /// Route, pass 2: each token's top-k experts by logit plus bias, and their renormalised gates.
    RouteTopk => "route/topk.wgsl" [Unchecked],
    /// Route, pass 3: routing slots each expert received this step.
    RouteCount => "route/count.wgsl" [],
    /// Route, pass 4: fold the step's counts into the per-(layer, expert) statistics and the
    /// layer's summary; resets the counts.
    RouteStats => "route/stats.wgsl" [],
    /// Route miss recount, pass 1: K/V vectors of each (layer, expert) still cached, one workgroup
    /// per shard ring.
    RouteMissCount => "route/miss.wgsl" # "count" [],
    /// Route miss recount, pass 2: each (layer, expert)'s resident count and miss rate.
    RouteMissFinish => "route/miss.wgsl" # "finish" [],
    /// Adaptive router, pass 1: partial gradients of its cost, one workgroup per 64 tokens.
    RouteAdaptiveGrad => "route/adaptive.wgsl" # "grad" [],
    /// Adaptive router, pass 2: sum the partial gradients in order and step the score bias.
    RouteAdaptiveUpdate => "route/adaptive.wgsl" # "update" [],
    /// Append, pass 0: copy each new token's experts and gates from the router's output into its
    /// token record.
    AppendApplyRouting => "append/apply_routing.wgsl" [],
    /// Append, pass 1: each (token, KV head)'s shard ring, page and slot.
    AppendPlan => "append/plan.wgsl" [],
    /// Append, pass 2: take pages from the free stack and advance the rings, or refuse the whole
    /// batch.
    AppendAlloc => "append/alloc.wgsl" [],
    /// Append, pass 3: write each token's K, V and slot metadata into its pages, once per pool buffer.
    AppendWrite => "append/write.wgsl" [],
    /// Build each (layer, sequence, KV head)'s page list from its shard rings, oldest page first.
    AppendGatherPages => "append/gather_pages.wgsl" [],
    /// Pop the oldest pages of shard rings back onto the raw and compressed free stacks.
    AppendRelease => "append/release.wgsl" [],
    /// Compression plan, pass 1: full raw pages per ring that are no longer its newest.
    CompressPlanCount => "compress/plan.wgsl" # "count" [],
    /// Compression plan, pass 2: each ring's first job, compressed pages taken, `CompressEncode`'s
    /// dispatch size.
    CompressPlan => "compress/plan.wgsl" # "main" [],
    /// Compression plan, pass 3: move ring entries and page metadata to compressed ids, free the raw
    /// pages and write the jobs.
    CompressPlanAssign => "compress/plan.wgsl" # "assign" [],
    /// Encode each job's raw page into its compressed page, once per raw pool buffer.
    CompressEncode => "compress/encode.wgsl" [],
    /// Low-rank fit, pass 1: the Gram matrix of the cached keys and values of every (layer, KV head),
    /// or every layer under LoRA.
    CompressGram => "compress/gram.wgsl" [],
    /// Low-rank fit, pass 2: the subspace iteration's fixed pseudo-random start.
    CompressBasisInit => "compress/basis.wgsl" # "init" [],
    /// Low-rank fit, pass 2: one subspace iteration, `Q <- orth(G Q)`.
    CompressBasisIterate => "compress/basis.wgsl" # "iterate" [],
    /// Low-rank fit, pass 2: write the basis, rounded to f16 values.
    CompressBasisFinish => "compress/basis.wgsl" # "finish" [],
    /// Thaw plan, pass 1: compressed pages of each ring that the coming compaction touches.
    CompressThawCount => "compress/thaw_plan.wgsl" # "count" [],
    /// Thaw plan, pass 2: each ring's first job, the rings that fit in the free raw pages, and
    /// `CompressThaw`'s dispatch size.
    CompressThawPlan => "compress/thaw_plan.wgsl" # "main" [],
    /// Thaw plan, pass 3: move the fitting rings' pages to raw pages; clear the victim marks of the
    /// rings deferred.
    CompressThawAssign => "compress/thaw_plan.wgsl" # "assign" [],
    /// Decode each job's compressed page into its raw page, with its slot metadata and victim marks.
    CompressThaw => "compress/thaw.wgsl" [],
    /// Decode attention, split pass, portable: one workgroup per (chunk of pages, KV head, sequence).
    AttendSplitTiled => "attend/split_tiled.wgsl" [Unchecked],
    /// Decode attention, split pass, fast variant: token groups sharing a subgroup.
    AttendSplitSubgroup => "attend/split_subgroup.wgsl" [Subgroups, Unchecked],
    /// Decode attention, split pass over compressed pages (KIVI int8 / int4, FastV dims), decoded in
    /// the kernel.
    AttendSplitCodec => "attend/split_codec.wgsl" [],
    /// Decode attention, split pass over low-rank or LoRA pages, in the reduced space.
    AttendSplitLowrank => "attend/split_lowrank.wgsl" [],
    /// Decode attention, split pass over KIVI int8 / int4 pages, subgroup variant.
    AttendSplitQuant => "attend/split_quant.wgsl" [Subgroups, Unchecked],
    /// Decode attention, split pass over KIVI int4 pages, tile kernel (subgroups and shader-f16).
    AttendSplitQuantTile => "attend/split_quant_tile.wgsl" [Subgroups, F16, Unchecked],
    /// Decode attention, split pass over KIVI int4 pages on cooperative matrices (native only).
    AttendSplitQuantCoop => "attend/split_quant_coop.wgsl" [Subgroups, F16, Unchecked],
    /// Decode attention, reduce pass: merge every chunk's partials into each query head's output.
    AttendReduce => "attend/reduce.wgsl" [Unchecked],
    /// Prefill attention, split pass: a chunk of one sequence's queries over its pages, causally
    /// masked by each slot's position (merged by the reduce pass).
    AttendPrefill => "attend/prefill.wgsl" [],
    /// Decode attention, mass pass: add each attended slot's attention to its metadata and record
    /// the access.
    AttendMass => "attend/mass.wgsl" [],
    /// Decode attention, recall pass: each page list's best pages of its recall tier attended, one
    /// more partial record per query head for the reduce pass.
    AttendRecall => "attend/recall.wgsl" [],
    /// Evict, pass 1: every cached slot's utility key under the configured policy.
    EvictScore => "evict/score.wgsl" [],
    /// Evict, pass 2: each page list's token budget (AdaKV and Duo share it out over the heads).
    EvictBudget => "evict/budget.wgsl" [],
    /// Evict, pass 3: each page list's victims, exactly, by radix select.
    EvictSelect => "evict/select.wgsl" [],
    /// Evict, pass 4: plan each ring's compaction: movers into holes, emptied pages listed.
    EvictCompact => "evict/compact.wgsl" [],
    /// Evict, pass 5: copy movers into holes within one pool buffer.
    EvictMoveSame => "evict/move.wgsl" # "same" [],
    /// Evict, pass 5: copy movers into holes from one pool buffer to another.
    EvictMoveCross => "evict/move.wgsl" # "cross" [],
    /// Evict, pass 6: push the pages compaction emptied onto the free stack.
    EvictFree => "evict/free.wgsl" [],
    /// Evict, capture into the recall tier (before compaction): each victim's tier slot, list by list.
    EvictCapture => "evict/capture.wgsl" # "plan" [],
    /// Evict, capture into the recall tier: copy the planned victims' K, V and positions, once per
    /// pool buffer.
    EvictCaptureCopy => "evict/capture_copy.wgsl" # "copy" [],
    /// Evict, capture into the recall tier: the newly captured slots' key digests (a list's
    /// centre and spread calibrated once).
    EvictDigest => "evict/digest.wgsl" # "digest" [],
    /// EKVA allocator: tokens and attention-mass share of each expert group of each page list.
    EvictEkvaExperts => "evict/ekva.wgsl" # "experts" [],
    /// EKVA allocator: update each expert's importance, a moving average of routing and mass shares.
    EvictEkvaImportance => "evict/ekva.wgsl" # "update_importance" [],
    /// EKVA allocator: split each page list's budget over its expert groups.
    EvictEkvaSplit => "evict/ekva.wgsl" # "split" [],
    /// QUEST, pass 1: per-page minimum and maximum of every key dimension, for pages that changed.
    EvictQuestSummarize => "evict/quest_summarize.wgsl" [],
    /// QUEST, pass 2: keep each page list's `keep_pages` pages with the highest bound on q.k.
    EvictQuestSelect => "evict/quest_select.wgsl" [],
    /// Model: matrix-vector products with block-format weights dequantised as read.
    ModelMatVec => "model/matvec.wgsl" [],
    /// Model: the same products tiled for a prefill chunk (each weight dequantised once a tile).
    ModelMatMul => "model/matmul.wgsl" [],
    /// Model: RMS normalisation of each token, times the gain.
    ModelRmsNorm => "model/norm_rope.wgsl" # "rmsnorm" [],
    /// Model: rotary position embedding of the queries and the keys in one dispatch, in place.
    ModelRopeQk => "model/norm_rope.wgsl" # "rope_qk" [],
    /// Model: `silu(gate) * up * sigmoid(g[token])`, a shared expert's activations scaled by its gate.
    ModelSwigluGated => "model/norm_rope.wgsl" # "swiglu_gated" [],
    /// Model: each token's row of the block-format embedding matrix, dequantised.
    ModelEmbed => "model/norm_rope.wgsl" # "embed" [],
    /// Model: add a residual, elementwise.
    ModelResidual => "model/norm_rope.wgsl" # "residual" [],
    /// Model, a MoE file's experts in a prefill chunk: the (token, choice) pairs listed per expert.
    ModelMoeGroup => "model/moe_tiled.wgsl" # "moe_group" [],
    /// Model, a MoE file's experts in a prefill chunk: gate and up products tiled per expert.
    ModelMoeGateUpTiled => "model/moe_tiled.wgsl" # "moe_gate_up_tiled" [],
    /// Model, a MoE file's experts in a prefill chunk: down products tiled per expert.
    ModelMoeDownTiled => "model/moe_tiled.wgsl" # "moe_down_tiled" [],
    /// Model, a MoE file's experts in a prefill chunk: each token's choices summed in order.
    ModelMoeCombine => "model/moe_tiled.wgsl" # "moe_combine" [],
    /// Model, MoE FFN: gate and up products of the chosen experts' neurons, activated and weighted.
    ModelMoeGateUp => "model/moe.wgsl" # "moe_gate_up" [],
    /// Model, MoE FFN: down projection of the chosen experts' activations, in a fixed order.
    ModelMoeDown => "model/moe.wgsl" # "moe_down" [],
    /// Model, MoE FFN: down projection of a MoE file's own experts from Wdown as stored (in-kernel dequantisation).
    ModelMoeDownQ => "model/moe.wgsl" # "moe_down_q" [],
    /// Model: pack a step's K and V into the pool's append layout (f32 or f16 words).
    ModelKvPack => "model/kv_pack.wgsl" [],
    /// Model: each token's top-k experts by router score, highest first.
    ModelMoeTopk => "model/router.wgsl" [],
    /// Model: softmax of the chosen experts' scores, the weights of a MoE file's own experts.
    ModelMoeWeights => "model/router.wgsl" # "moe_weights" [],
    /// Benchmark: the bandwidth roofline, a device-to-device copy in 16-byte words.
    BenchCopy => "bench/copy.wgsl" [Unchecked],
    /// Benchmark: the compute roofline, eight independent vec4 FMA chains per invocation.
    BenchFma => "bench/fma.wgsl" [],
    /// Tensor-core probe on cooperative matrices (native only): exact f16 products into f32.
    BenchCoop => "bench/coop.wgsl" [],
    /// Probe: whether the device's f16 arithmetic keeps subnormals exactly (the int4 tile kernel's
    /// `DENORM` mode relies on it).
    ProbeF16Subnormal => "probe/f16_subnormal.wgsl" [F16],
}

impl Kernel {
    /// Needs the SUBGROUP feature (only on the capability tier that has it).
    pub fn needs_subgroups(self) -> bool {
        self.needs().contains(&Need::Subgroups)
    }

    /// Needs the SHADER_F16 feature (its text starts with `enable f16;`).
    pub fn needs_f16(self) -> bool {
        self.needs().contains(&Need::F16)
    }

    /// Kernels whose every index the GPU-vs-CPU tests (`tests/tests/gpu`) exercise over random
    /// shapes, so the runtime may build them without wgpu's bounds checks (never in a browser).
    pub fn may_run_unchecked(self) -> bool {
        self.needs().contains(&Need::Unchecked)
    }

    /// The source with its imports resolved and every define at its default.
    pub fn resolved(self) -> Result<String, ResolveError> {
        resolve(self.source())
    }

    /// The source with its imports resolved and `defines` (name, WGSL value) applied.
    pub fn resolved_with(self, defines: &[(&str, String)]) -> Result<String, ResolveError> {
        resolve_with(self.source(), defines)
    }
}

/// What a shared piece needs its importer to declare: the text of its `//!expects` lines (a
/// binding, a constant), so the piece can be validated on its own with them in front.
pub fn expects(source: Source) -> Vec<&'static str> {
    source.text.lines().filter_map(|l| l.trim_start().strip_prefix(EXPECTS)).collect()
}

/// An `//!import` that names no embedded file, or a define the file does not declare.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolveError {
    /// Path under `wgsl/` of the file at fault.
    pub file: &'static str,
    /// What failed: the path an `//!import` names; `define NAME` for a define the file does not
    /// declare (or a malformed `//!define` line); `unroll: why` for an `//!unroll` not expanded.
    pub import: String,
}

impl std::fmt::Display for ResolveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(name) = self.import.strip_prefix("define ") {
            write!(f, "{}: no `//!define {name}` in the file", self.file)
        } else {
            write!(f, "{}: `//!import {}` names no file under shaders/wgsl", self.file, self.import)
        }
    }
}

impl std::error::Error for ResolveError {}

const IMPORT: &str = "//!import ";
const DEFINE: &str = "//!define ";
const EXPECTS: &str = "//!expects ";

fn find(path: &str) -> Option<Source> {
    ALL_SOURCES.iter().copied().find(|s| s.path == path)
}

/// Replace every `//!import path` line by that file's (recursively resolved) text, once per file,
/// and every `//!define` by a constant with its default value.
pub fn resolve(source: Source) -> Result<String, ResolveError> {
    resolve_with(source, &[])
}

/// [`resolve`], with `defines` overriding the defaults of `//!define` lines.
pub fn resolve_with(source: Source, defines: &[(&str, String)]) -> Result<String, ResolveError> {
    let mut out = String::with_capacity(source.text.len() * 2);
    let mut seen = vec![source.path];
    let mut used = vec![false; defines.len()];
    resolve_into(source, &mut seen, defines, &mut used, &mut out)?;
    if let Some(i) = used.iter().position(|u| !u) {
        return Err(ResolveError { file: source.path, import: format!("define {}", defines[i].0) });
    }
    unroll(&out).map_err(|why| ResolveError { file: source.path, import: format!("unroll: {why}") })
}

const UNROLL: &str = "//!unroll";

/// Expand every `//!unroll` loop of resolved WGSL text (innermost last: a copy's own directives
/// are expanded in later passes); `//!unroll NAME` only where the constant NAME is true. The loop must read `for (var i = A; i < B; i++) {` on the line
/// after the directive, with A and B constant expressions over integer literals and module
/// constants (`const N = ...;` lines, defines included), and its body may not `break` or
/// `continue` (a copy has no loop to leave). Each iteration becomes `{ let i = Ku; body }`.
pub fn unroll(text: &str) -> Result<String, String> {
    let mut text = text.to_owned();
    // Each pass expands one directive; the bound keeps a broken file from looping forever.
    for _ in 0..10_000 {
        // A directive is a line of its own (the name may appear in comments).
        let mut line_at = 0;
        let mut found = None;
        for line in text.split_inclusive('\n') {
            let lead = line.len() - line.trim_start().len();
            if line.trim_start().starts_with(UNROLL) {
                found = Some(line_at + lead);
                break;
            }
            line_at += line.len();
        }
        let Some(at) = found else { return Ok(text) };
        let consts = module_consts(&text);
        let line_end = text[at..].find('\n').map_or(text.len(), |e| at + e);
        // `//!unroll NAME`: only where the constant NAME is true (or nonzero).
        let cond = text[at + UNROLL.len()..line_end].trim();
        if !cond.is_empty() && eval(cond, &consts).map_err(|e| format!("`{UNROLL} {cond}`: {e}"))? == 0 {
            let line_start = text[..at].rfind('\n').map_or(0, |s| s + 1);
            text.replace_range(line_start..(line_end + 1).min(text.len()), "");
            continue;
        }
        let header_start = line_end + 1;
        let header_end = text[header_start..].find('\n').map_or(text.len(), |e| header_start + e);
        let header = text[header_start.min(text.len())..header_end].trim();
        let (var, lo, hi) = parse_for(header, &consts).map_err(|e| format!("`{header}`: {e}"))?;
        let open = header_start + text[header_start..header_end].rfind('{').ok_or("no `{` ending the for line")?;
        let close = matching_brace(&text, open).ok_or_else(|| format!("`{header}`: no closing brace"))?;
        let body = &text[open + 1..close];
        for word in ["break", "continue"] {
            if body.split(|c: char| !c.is_ascii_alphanumeric() && c != '_').any(|w| w == word) {
                return Err(format!("`{header}`: the body uses `{word}`"));
            }
        }
        let indent: String = text[header_start..].chars().take_while(|c| c.is_whitespace() && *c != '\n').collect();
        let mut expanded = String::new();
        for i in lo..hi {
            expanded.push_str(&format!("{indent}{{\n{indent}    let {var} = {i}u;{body}}}\n"));
        }
        let line_start = text[..at].rfind('\n').map_or(0, |s| s + 1);
        let after = text[close + 1..].strip_prefix('\n').unwrap_or(&text[close + 1..]).to_owned();
        text = format!("{}{}{}", &text[..line_start], expanded, after);
    }
    Err("too many nested unrolled loops".into())
}

/// Module constants whose values are constant integer expressions, in order of declaration.
fn module_consts(text: &str) -> Vec<(String, i64)> {
    let mut consts: Vec<(String, i64)> = Vec::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("").trim_end();
        let Some(rest) = code.strip_prefix("const ") else { continue };
        let Some((lhs, rhs)) = rest.split_once('=') else { continue };
        let name = lhs.split(':').next().unwrap_or("").trim();
        let Some(expr) = rhs.trim().strip_suffix(';') else { continue };
        if let Ok(v) = eval(expr, &consts) {
            consts.push((name.to_owned(), v));
        }
    }
    consts
}

/// `for (var i = A; i < B; i++) {`: the variable and the evaluated bounds.
fn parse_for(header: &str, consts: &[(String, i64)]) -> Result<(String, i64, i64), String> {
    let inner = header
        .strip_prefix("for (var ")
        .and_then(|r| r.strip_suffix('{'))
        .map(str::trim)
        .and_then(|r| r.strip_suffix(')'))
        .ok_or("not of the form `for (var i = A; i < B; i++) {`")?;
    let parts: Vec<&str> = inner.split(';').map(str::trim).collect();
    let [init, cond, step] = parts[..] else { return Err("expected three clauses".into()) };
    let (var, lo) = init.split_once('=').ok_or("no initial value")?;
    let var = var.split(':').next().unwrap_or("").trim().to_owned();
    let (cv, hi) = cond.split_once('<').ok_or("the condition is not `i < B`")?;
    if cv.trim() != var || hi.starts_with('=') || step != format!("{var}++") {
        return Err("the loop must read `i = A; i < B; i++`".into());
    }
    Ok((var, eval(lo, consts)?, eval(hi, consts)?))
}

/// The index of the `}` closing the `{` at `open`, skipping `//` comments.
fn matching_brace(text: &str, open: usize) -> Option<usize> {
    let bytes = text.as_bytes();
    let (mut depth, mut i, mut comment) = (0i32, open, false);
    while i < bytes.len() {
        match bytes[i] {
            b'\n' => comment = false,
            b'/' if !comment && bytes.get(i + 1) == Some(&b'/') => comment = true,
            b'{' if !comment => depth += 1,
            b'}' if !comment => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// A constant integer expression: literals (`u`/`i` suffixes allowed), names of `consts`, + - *
/// / %, parentheses.
fn eval(expr: &str, consts: &[(String, i64)]) -> Result<i64, String> {
    let tokens: Vec<String> = {
        let mut out = Vec::new();
        let mut cur = String::new();
        for c in expr.chars() {
            if c.is_ascii_alphanumeric() || c == '_' {
                cur.push(c);
            } else {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
                if !c.is_whitespace() {
                    out.push(c.to_string());
                }
            }
        }
        if !cur.is_empty() {
            out.push(cur);
        }
        out
    };
    let mut pos = 0;
    let v = eval_sum(&tokens, &mut pos, consts)?;
    if pos != tokens.len() {
        return Err(format!("cannot evaluate `{expr}`"));
    }
    Ok(v)
}

fn eval_sum(t: &[String], pos: &mut usize, consts: &[(String, i64)]) -> Result<i64, String> {
    let mut v = eval_product(t, pos, consts)?;
    while let Some(op) = t.get(*pos).filter(|o| *o == "+" || *o == "-").cloned() {
        *pos += 1;
        let r = eval_product(t, pos, consts)?;
        v = if op == "+" { v + r } else { v - r };
    }
    Ok(v)
}

fn eval_product(t: &[String], pos: &mut usize, consts: &[(String, i64)]) -> Result<i64, String> {
    let mut v = eval_atom(t, pos, consts)?;
    while let Some(op) = t.get(*pos).filter(|o| *o == "*" || *o == "/" || *o == "%").cloned() {
        *pos += 1;
        let r = eval_atom(t, pos, consts)?;
        if op != "*" && r == 0 {
            return Err("division by zero".into());
        }
        v = match op.as_str() {
            "*" => v * r,
            "/" => v / r,
            _ => v % r,
        };
    }
    Ok(v)
}

fn eval_atom(t: &[String], pos: &mut usize, consts: &[(String, i64)]) -> Result<i64, String> {
    let tok = t.get(*pos).ok_or("expression ends early")?.clone();
    *pos += 1;
    if tok == "(" {
        let v = eval_sum(t, pos, consts)?;
        if t.get(*pos).map(String::as_str) != Some(")") {
            return Err("unbalanced parentheses".into());
        }
        *pos += 1;
        return Ok(v);
    }
    if tok == "true" || tok == "false" {
        return Ok(i64::from(tok == "true"));
    }
    if tok.starts_with(|c: char| c.is_ascii_digit()) {
        return tok.trim_end_matches(['u', 'i']).parse().map_err(|_| format!("not an integer: `{tok}`"));
    }
    consts.iter().rev().find(|(n, _)| *n == tok).map(|(_, v)| *v).ok_or_else(|| format!("`{tok}` is not a constant integer"))
}

fn resolve_into(
    source: Source,
    seen: &mut Vec<&'static str>,
    defines: &[(&str, String)],
    used: &mut [bool],
    out: &mut String,
) -> Result<(), ResolveError> {
    for line in source.text.lines() {
        if let Some(rest) = line.trim_start().strip_prefix(DEFINE) {
            let mut parts = rest.split_whitespace();
            let (Some(name), Some(default)) = (parts.next(), parts.next()) else {
                return Err(ResolveError { file: source.path, import: format!("define {rest} (needs a name and a default)") });
            };
            let value = match defines.iter().position(|(n, _)| *n == name) {
                Some(i) => {
                    used[i] = true;
                    defines[i].1.as_str()
                }
                None => default,
            };
            out.push_str(&format!("const {name} = {value};\n"));
        } else if let Some(rest) = line.trim_start().strip_prefix(IMPORT) {
            let path = rest.trim();
            let import = find(path).ok_or_else(|| ResolveError { file: source.path, import: path.to_owned() })?;
            if !seen.contains(&import.path) {
                seen.push(import.path);
                out.push_str("// ---- begin ");
                out.push_str(import.path);
                out.push('\n');
                resolve_into(import, seen, defines, used, out)?;
                out.push_str("// ---- end ");
                out.push_str(import.path);
                out.push('\n');
            }
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_is_listed_once() {
        let mut paths: Vec<_> = Kernel::ALL.iter().map(|k| k.label()).collect();
        paths.sort_unstable();
        paths.dedup();
        assert_eq!(paths.len(), Kernel::ALL.len());
    }

    #[test]
    fn unknown_import_is_an_error() {
        let bad = Source { path: "test/bad.wgsl", text: "//!import common/nope.wgsl\n" };
        let err = resolve(bad).unwrap_err();
        assert_eq!(err.import, "common/nope.wgsl");
    }

    #[test]
    fn defines_take_defaults_or_given_values() {
        let src = Source { path: "test/d.wgsl", text: "//!define GROUP 4u\nfn f() -> u32 { return GROUP; }\n" };
        assert!(resolve(src).unwrap().contains("const GROUP = 4u;"));
        assert!(resolve_with(src, &[("GROUP", "2u".into())]).unwrap().contains("const GROUP = 2u;"));
        assert!(resolve_with(src, &[("NOPE", "1u".into())]).is_err());
    }

    #[test]
    fn unroll_expands_constant_loops_and_refuses_the_rest() {
        let src = Source {
            path: "test/u.wgsl",
            text: "//!define P 8u\nconst J: u32 = P / 4u + 1u;  // three\nfn f() -> u32 {\n    var s = 0u;\n    //!unroll\n    for (var j = 0u; j < J; j++) {\n        //!unroll\n        for (var k = 1u; k < 3u; k++) {\n            s += j * k; // {\n        }\n    }\n    return s;\n}\n",
        };
        let text = resolve(src).unwrap();
        assert!(!text.contains("for (") && !text.contains(UNROLL), "{text}");
        for j in 0..3 {
            assert!(text.contains(&format!("let j = {j}u;")), "{text}");
        }
        assert!(!text.contains("let j = 3u;"), "{text}");
        assert_eq!(text.matches("let k = 1u;").count(), 3, "{text}");
        assert_eq!(text.matches("let k = 2u;").count(), 3, "{text}");
        assert_eq!(text.matches("s += j * k;").count(), 6, "{text}");
        let cond = "//!define U false\n//!unroll U\nfor (var j = 0u; j < 2u; j++) {\n}\n";
        let text = resolve(Source { path: "test/c.wgsl", text: cond }).unwrap();
        assert!(text.contains("for (var j") && !text.contains(UNROLL), "{text}");
        let text = resolve_with(Source { path: "test/c.wgsl", text: cond }, &[("U", "true".into())]).unwrap();
        assert!(!text.contains("for (var j") && text.contains("let j = 1u;"), "{text}");
        for bad in [
            "//!unroll\nfor (var j = 0u; j < n; j++) {\n}\n",
            "//!unroll\nfor (var j = 0u; j < 4u; j++) {\n    break;\n}\n",
            "//!unroll\nfor (var j = 0u; j <= 4u; j++) {\n}\n",
            "//!unroll\nwhile (true) {\n}\n",
        ] {
            assert!(resolve(Source { path: "test/bad.wgsl", text: bad }).is_err(), "{bad}");
        }
    }

    #[test]
    fn imports_resolve_once() {
        let text = Kernel::AppendWrite.resolved().unwrap();
        assert_eq!(text.matches("struct Geometry").count(), 1);
        assert!(!text.contains(IMPORT));
    }
}
