//! Every WGSL kernel of expertkv, embedded as text.
//!
//! Files live under `wgsl/`, grouped by pipeline stage; shared definitions are in `wgsl/common/`
//! and are pulled in by `//!import <path>` lines, which [`resolve`] replaces by the file's text
//! (each file once). A line `//!define NAME default` becomes `const NAME = default;`, or the
//! value the runtime passes: used only where WGSL needs a true constant (the size of a
//! function-local array), everything else is a WGSL `override`. Nothing else in the workspace
//! names a shader path: code asks for a [`Kernel`] and gets its resolved source, entry point and
//! label.

/// One embedded WGSL file: its path under `wgsl/` and its text.
#[derive(Clone, Copy, Debug)]
pub struct Source {
    pub path: &'static str,
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
    COMMON_APPEND => "common/append.wgsl",
    COMMON_WINDOW => "common/window.wgsl",
    SHARD_APPLY_ROUTING => "shard/apply_routing.wgsl",
    SHARD_APPEND_PLAN => "shard/append_plan.wgsl",
    SHARD_APPEND_ALLOC => "shard/append_alloc.wgsl",
    SHARD_APPEND_WRITE => "shard/append_write.wgsl",
    SHARD_GATHER_PAGES => "shard/gather_pages.wgsl",
    SHARD_RELEASE => "shard/release.wgsl",
    ATTEND_COMMON => "attend/common.wgsl",
    ATTEND_SPLIT_TILED => "attend/split_tiled.wgsl",
    ATTEND_SPLIT_SUBGROUP => "attend/split_subgroup.wgsl",
    ATTEND_REDUCE => "attend/reduce.wgsl",
    ATTEND_MASS => "attend/mass.wgsl",
    BENCH_COPY => "bench/copy.wgsl",
    BENCH_FMA => "bench/fma.wgsl",
    BENCH_COOP => "bench/coop.wgsl",
    COMMON_ROUTE => "common/route.wgsl",
    ROUTE_BIAS => "route/bias.wgsl",
    ROUTE_TOPK => "route/topk.wgsl",
    ROUTE_COUNT => "route/count.wgsl",
    ROUTE_STATS => "route/stats.wgsl",
    ROUTE_MISS => "route/miss.wgsl",
    ROUTE_ADAPTIVE => "route/adaptive.wgsl",
    COMMON_EVICT => "common/evict.wgsl",
    EVICT_SCORE => "evict/score.wgsl",
    EVICT_BUDGET => "evict/budget.wgsl",
    EVICT_SELECT => "evict/select.wgsl",
    EVICT_COMPACT => "evict/compact.wgsl",
    EVICT_MOVE => "evict/move.wgsl",
    EVICT_FREE => "evict/free.wgsl",
    EVICT_EKVA => "evict/ekva.wgsl",
    COMMON_QUANT => "common/quant.wgsl",
    MODEL_MATVEC => "model/matvec.wgsl",
    MODEL_MOE => "model/moe.wgsl",
    MODEL_NORM_ROPE => "model/norm_rope.wgsl",
    COMMON_HALF => "common/half.wgsl",
    MODEL_KV_PACK => "model/kv_pack.wgsl",
    MODEL_ROUTER => "model/router.wgsl",
    QUEST_SUMMARIZE => "quest/summarize.wgsl",
    QUEST_SELECT => "quest/select.wgsl",
    COMMON_CODEC => "common/codec.wgsl",
    CODEC_PLAN => "codec/plan.wgsl",
    CODEC_ENCODE => "codec/encode.wgsl",
    CODEC_GRAM => "codec/gram.wgsl",
    CODEC_BASIS => "codec/basis.wgsl",
    ATTEND_SPLIT_LOWRANK => "attend/split_lowrank.wgsl",
    ATTEND_SPLIT_QUANT => "attend/split_quant.wgsl",
    ATTEND_SPLIT_QUANT_TILE => "attend/split_quant_tile.wgsl",
    ATTEND_SPLIT_QUANT_COOP => "attend/split_quant_coop.wgsl",
    ATTEND_SPLIT_CODEC => "attend/split_codec.wgsl",
}

/// Every dispatchable kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    ShardApplyRouting,
    ShardAppendPlan,
    ShardAppendAlloc,
    ShardAppendWrite,
    ShardGatherPages,
    ShardRelease,
    AttendSplitTiled,
    AttendSplitSubgroup,
    AttendReduce,
    AttendMass,
    BenchCopy,
    RouteBias,
    RouteTopk,
    RouteCount,
    RouteStats,
    RouteMissCount,
    RouteMissFinish,
    RouteAdaptiveGrad,
    RouteAdaptiveUpdate,
    EvictScore,
    EvictBudget,
    EvictSelect,
    EvictCompact,
    EvictMoveSame,
    EvictMoveCross,
    EvictFree,
    EvictEkvaExperts,
    EvictEkvaImportance,
    EvictEkvaSplit,
    ModelMatVec,
    ModelRmsNorm,
    ModelRope,
    ModelSwiglu,
    ModelEmbed,
    ModelResidual,
    ModelMoeGateUp,
    ModelMoeDown,
    ModelKvPack,
    ModelMoeTopk,
    ModelMoeWeights,
    QuestSummarize,
    QuestSelect,
    CodecPlanCount,
    CodecPlan,
    CodecPlanAssign,
    CodecEncode,
    AttendSplitCodec,
    CodecGram,
    CodecBasisInit,
    CodecBasisIterate,
    CodecBasisFinish,
    AttendSplitLowrank,
    AttendSplitQuant,
    AttendSplitQuantTile,
    AttendSplitQuantCoop,
    BenchFma,
    BenchCoop,
}

impl Kernel {
    pub const ALL: &'static [Kernel] = &[
        Kernel::ShardApplyRouting,
        Kernel::ShardAppendPlan,
        Kernel::ShardAppendAlloc,
        Kernel::ShardAppendWrite,
        Kernel::ShardGatherPages,
        Kernel::ShardRelease,
        Kernel::AttendSplitTiled,
        Kernel::AttendSplitSubgroup,
        Kernel::AttendReduce,
        Kernel::AttendMass,
        Kernel::BenchCopy,
        Kernel::RouteBias,
        Kernel::RouteTopk,
        Kernel::RouteCount,
        Kernel::RouteStats,
        Kernel::RouteMissCount,
        Kernel::RouteMissFinish,
        Kernel::RouteAdaptiveGrad,
        Kernel::RouteAdaptiveUpdate,
        Kernel::EvictScore,
        Kernel::EvictBudget,
        Kernel::EvictSelect,
        Kernel::EvictCompact,
        Kernel::EvictMoveSame,
        Kernel::EvictMoveCross,
        Kernel::EvictFree,
        Kernel::EvictEkvaExperts,
        Kernel::EvictEkvaImportance,
        Kernel::EvictEkvaSplit,
        Kernel::ModelMatVec,
        Kernel::ModelRmsNorm,
        Kernel::ModelRope,
        Kernel::ModelSwiglu,
        Kernel::ModelEmbed,
        Kernel::ModelResidual,
        Kernel::ModelMoeGateUp,
        Kernel::ModelMoeDown,
        Kernel::ModelKvPack,
        Kernel::ModelMoeTopk,
        Kernel::ModelMoeWeights,
        Kernel::QuestSummarize,
        Kernel::QuestSelect,
        Kernel::CodecPlanCount,
        Kernel::CodecPlan,
        Kernel::CodecPlanAssign,
        Kernel::CodecEncode,
        Kernel::AttendSplitCodec,
        Kernel::CodecGram,
        Kernel::CodecBasisInit,
        Kernel::CodecBasisIterate,
        Kernel::CodecBasisFinish,
        Kernel::AttendSplitLowrank,
        Kernel::AttendSplitQuant,
        Kernel::AttendSplitQuantTile,
        Kernel::AttendSplitQuantCoop,
        Kernel::BenchFma,
        Kernel::BenchCoop,
    ];

    pub fn source(self) -> Source {
        match self {
            Kernel::ShardApplyRouting => SHARD_APPLY_ROUTING,
            Kernel::ShardAppendPlan => SHARD_APPEND_PLAN,
            Kernel::ShardAppendAlloc => SHARD_APPEND_ALLOC,
            Kernel::ShardAppendWrite => SHARD_APPEND_WRITE,
            Kernel::ShardGatherPages => SHARD_GATHER_PAGES,
            Kernel::ShardRelease => SHARD_RELEASE,
            Kernel::AttendSplitTiled => ATTEND_SPLIT_TILED,
            Kernel::AttendSplitSubgroup => ATTEND_SPLIT_SUBGROUP,
            Kernel::AttendReduce => ATTEND_REDUCE,
            Kernel::AttendMass => ATTEND_MASS,
            Kernel::BenchCopy => BENCH_COPY,
            Kernel::RouteBias => ROUTE_BIAS,
            Kernel::RouteTopk => ROUTE_TOPK,
            Kernel::RouteCount => ROUTE_COUNT,
            Kernel::RouteStats => ROUTE_STATS,
            Kernel::RouteMissCount | Kernel::RouteMissFinish => ROUTE_MISS,
            Kernel::RouteAdaptiveGrad | Kernel::RouteAdaptiveUpdate => ROUTE_ADAPTIVE,
            Kernel::EvictScore => EVICT_SCORE,
            Kernel::EvictBudget => EVICT_BUDGET,
            Kernel::EvictSelect => EVICT_SELECT,
            Kernel::EvictCompact => EVICT_COMPACT,
            Kernel::EvictMoveSame | Kernel::EvictMoveCross => EVICT_MOVE,
            Kernel::EvictFree => EVICT_FREE,
            Kernel::EvictEkvaExperts | Kernel::EvictEkvaImportance | Kernel::EvictEkvaSplit => EVICT_EKVA,
            Kernel::ModelMatVec => MODEL_MATVEC,
            Kernel::ModelMoeGateUp | Kernel::ModelMoeDown => MODEL_MOE,
            Kernel::ModelKvPack => MODEL_KV_PACK,
            Kernel::ModelMoeTopk | Kernel::ModelMoeWeights => MODEL_ROUTER,
            Kernel::ModelRmsNorm | Kernel::ModelRope | Kernel::ModelSwiglu | Kernel::ModelEmbed | Kernel::ModelResidual => MODEL_NORM_ROPE,
            Kernel::QuestSummarize => QUEST_SUMMARIZE,
            Kernel::QuestSelect => QUEST_SELECT,
            Kernel::CodecPlanCount | Kernel::CodecPlan | Kernel::CodecPlanAssign => CODEC_PLAN,
            Kernel::CodecEncode => CODEC_ENCODE,
            Kernel::AttendSplitCodec => ATTEND_SPLIT_CODEC,
            Kernel::CodecGram => CODEC_GRAM,
            Kernel::CodecBasisInit | Kernel::CodecBasisIterate | Kernel::CodecBasisFinish => CODEC_BASIS,
            Kernel::AttendSplitLowrank => ATTEND_SPLIT_LOWRANK,
            Kernel::AttendSplitQuant => ATTEND_SPLIT_QUANT,
            Kernel::AttendSplitQuantTile => ATTEND_SPLIT_QUANT_TILE,
            Kernel::AttendSplitQuantCoop => ATTEND_SPLIT_QUANT_COOP,
            Kernel::BenchFma => BENCH_FMA,
            Kernel::BenchCoop => BENCH_COOP,
        }
    }

    /// Label of every pipeline, bind group and buffer of this kernel: its path, and its entry
    /// point where the file has several.
    pub fn label(self) -> &'static str {
        match self {
            Kernel::RouteMissCount => "route/miss.wgsl#count",
            Kernel::RouteMissFinish => "route/miss.wgsl#finish",
            Kernel::RouteAdaptiveGrad => "route/adaptive.wgsl#grad",
            Kernel::RouteAdaptiveUpdate => "route/adaptive.wgsl#update",
            Kernel::EvictMoveSame => "evict/move.wgsl#same",
            Kernel::EvictMoveCross => "evict/move.wgsl#cross",
            Kernel::CodecPlanCount => "codec/plan.wgsl#count",
            Kernel::CodecPlan => "codec/plan.wgsl#main",
            Kernel::CodecPlanAssign => "codec/plan.wgsl#assign",
            Kernel::CodecBasisInit => "codec/basis.wgsl#init",
            Kernel::CodecBasisIterate => "codec/basis.wgsl#iterate",
            Kernel::CodecBasisFinish => "codec/basis.wgsl#finish",
            Kernel::EvictEkvaExperts => "evict/ekva.wgsl#experts",
            Kernel::EvictEkvaImportance => "evict/ekva.wgsl#update_importance",
            Kernel::EvictEkvaSplit => "evict/ekva.wgsl#split",
            Kernel::ModelRmsNorm => "model/norm_rope.wgsl#rmsnorm",
            Kernel::ModelRope => "model/norm_rope.wgsl#rope",
            Kernel::ModelSwiglu => "model/norm_rope.wgsl#swiglu",
            Kernel::ModelEmbed => "model/norm_rope.wgsl#embed",
            Kernel::ModelResidual => "model/norm_rope.wgsl#residual",
            Kernel::ModelMoeGateUp => "model/moe.wgsl#moe_gate_up",
            Kernel::ModelMoeDown => "model/moe.wgsl#moe_down",
            Kernel::ModelMoeWeights => "model/router.wgsl#moe_weights",
            _ => self.source().path,
        }
    }

    pub fn entry_point(self) -> &'static str {
        match self {
            Kernel::RouteMissCount => "count",
            Kernel::RouteMissFinish => "finish",
            Kernel::RouteAdaptiveGrad => "grad",
            Kernel::RouteAdaptiveUpdate => "update",
            Kernel::EvictMoveSame => "same",
            Kernel::EvictMoveCross => "cross",
            Kernel::CodecPlanCount => "count",
            Kernel::CodecPlanAssign => "assign",
            Kernel::CodecBasisInit => "init",
            Kernel::CodecBasisIterate => "iterate",
            Kernel::CodecBasisFinish => "finish",
            Kernel::EvictEkvaExperts => "experts",
            Kernel::EvictEkvaImportance => "update_importance",
            Kernel::EvictEkvaSplit => "split",
            Kernel::ModelRmsNorm => "rmsnorm",
            Kernel::ModelRope => "rope",
            Kernel::ModelSwiglu => "swiglu",
            Kernel::ModelEmbed => "embed",
            Kernel::ModelResidual => "residual",
            Kernel::ModelMoeGateUp => "moe_gate_up",
            Kernel::ModelMoeDown => "moe_down",
            Kernel::ModelMoeWeights => "moe_weights",
            _ => "main",
        }
    }

    /// Needs the SUBGROUP feature (only on the capability tier that has it).
    pub fn needs_subgroups(self) -> bool {
        matches!(self, Kernel::AttendSplitSubgroup | Kernel::AttendSplitQuant | Kernel::AttendSplitQuantTile | Kernel::AttendSplitQuantCoop)
    }

    /// Needs the SHADER_F16 feature (its text starts with `enable f16;`).
    pub fn needs_f16(self) -> bool {
        matches!(self, Kernel::AttendSplitQuantTile | Kernel::AttendSplitQuantCoop)
    }

    /// Kernels whose every index the GPU-vs-CPU tests (`tests/tests/gpu`) exercise over random
    /// shapes, so the runtime may build them without wgpu's bounds checks (never in a browser).
    pub fn may_run_unchecked(self) -> bool {
        matches!(
            self,
            Kernel::AttendSplitTiled
                | Kernel::AttendSplitSubgroup
                | Kernel::AttendSplitQuant
                | Kernel::AttendSplitQuantTile
                | Kernel::AttendSplitQuantCoop
                | Kernel::AttendReduce
                | Kernel::BenchCopy
                | Kernel::RouteTopk
        )
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

/// An `//!import` that names no embedded file, or a define the file does not declare.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolveError {
    pub file: &'static str,
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
    Ok(out)
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
    fn imports_resolve_once() {
        let text = Kernel::ShardAppendWrite.resolved().unwrap();
        assert_eq!(text.matches("struct Geometry").count(), 1);
        assert!(!text.contains(IMPORT));
    }
}
