//! A model run's trace: per pass of the forward (a prefill chunk or a decode step), aligned, the
//! tokens fed, the experts each layer chose, the experts fetched into GPU slots (and whom they
//! replaced), the weight bytes moved, the K/V pages in use and the K/V pages moved between the
//! GPU, host memory and a spill tier. Two runs' traces compare pass by pass
//! ([`compare`], `expertkv compare A B`): where their routing, their residency or their K/V page
//! counts first part.
//!
//! # Format (version 1)
//!
//! JSON lines, UTF-8. The first line is a [`ModelTraceHeader`]:
//!
//! ```json
//! {"format":"expertkv-model-trace","version":1,"model":"m.gguf","model_hash":"1f3a...","layers":2,
//!  "experts":8,"top_k":2,"n_seqs":1,"options":"run --model m.gguf --expert-slots 4 ..."}
//! ```
//!
//! Every further line is one [`PassRecord`], written (and flushed) when its pass has finished,
//! so a run that stops leaves whole passes behind (a run killed mid-write leaves its last line
//! cut short, which the reader leaves out and reports):
//!
//! ```json
//! {"pass":7,"prefill":false,"seq":null,"tokens":1,"fed":[104],"positions":[12],"experts":[[3,5],[0,7]],
//!  "fetched":[{"layer":1,"expert":7,"slot":2,"evicted":4}],"expert_hits":3,"expert_misses":1,
//!  "expert_bytes":294912,"kv_pages_in_use":6,"kv_to_host":0,"kv_to_gpu":0,"kv_to_spill":0,
//!  "kv_from_spill":0}
//! ```
//!
//! - `fed`: the token each sequence was fed (decode passes; empty for a prefill chunk, whose
//!   `tokens` says how many it fed into sequence `seq`).
//! - `experts`: per layer, each sequence's chosen experts (`n_seqs x top_k`), for decode passes
//!   of a model whose FFN has experts (MoE files and MoEfied models); empty otherwise (the route
//!   stage's K/V labels under `--labels` are not recorded).
//! - `fetched`: the experts an expert cache wrote into GPU slots this pass, with the expert each
//!   replaced; `expert_hits`, `expert_misses`, `expert_bytes` count the cache's traffic.
//! - `kv_pages_in_use`: raw and compressed pages the pool holds after the pass.
//! - `kv_to_host`, `kv_to_gpu`: FlexGen's pages moved this pass; `kv_to_spill`,
//!   `kv_from_spill`: between host memory and the spill tier (the page store).
//!
//! Not passes: a prefix restored from a page store (positions jump past it) and the steps
//! `time_steps` times (refused with a trace).
//!
//! Readers refuse, with the line number, a missing or foreign header, another version, unknown
//! fields, passes out of order and lines over [`MAX_LINE_BYTES`] (bounded before they are
//! held).

use std::io::{BufRead, Write};

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The header's `format` value.
pub const MODEL_TRACE_FORMAT: &str = "expertkv-model-trace";
/// The version this crate writes and reads.
pub const MODEL_TRACE_VERSION: u32 = 1;
/// Longest line a reader accepts.
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// A model trace's first line.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelTraceHeader {
    /// [`MODEL_TRACE_FORMAT`].
    pub format: String,
    /// [`MODEL_TRACE_VERSION`].
    pub version: u32,
    /// The model file, as given.
    pub model: String,
    /// The model file's hash (hex), to tell traces of different files apart.
    pub model_hash: String,
    /// Layers.
    pub layers: u32,
    /// Experts per layer (0: a dense FFN).
    pub experts: u32,
    /// Experts each token chooses.
    pub top_k: u32,
    /// Sequences decoded together.
    pub n_seqs: u32,
    /// How the run was set up (the command line), for the reader.
    pub options: String,
}

impl ModelTraceHeader {
    /// A header for `model` (hash `model_hash`) with these shapes and options.
    pub fn new(model: &str, model_hash: u64, shape: [u32; 4], options: &str) -> Self {
        let [layers, experts, top_k, n_seqs] = shape;
        ModelTraceHeader {
            format: MODEL_TRACE_FORMAT.into(),
            version: MODEL_TRACE_VERSION,
            model: model.into(),
            model_hash: format!("{model_hash:016x}"),
            layers,
            experts,
            top_k,
            n_seqs,
            options: options.into(),
        }
    }
}

/// An expert written into a GPU slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpertFetch {
    /// The layer.
    pub layer: u32,
    /// The expert written.
    pub expert: u32,
    /// The GPU slot it went into.
    pub slot: u32,
    /// The expert the slot held before, if any.
    pub evicted: Option<u32>,
    /// Fetched ahead of the layer's router (prefetch), not on demand.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ahead: bool,
}

/// One pass of the forward (see the module docs for each field).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PassRecord {
    /// Passes before this one since recording began.
    pub pass: u64,
    /// A prefill chunk (else a decode step).
    pub prefill: bool,
    /// The sequence a prefill chunk fed (`None` for a decode step, which feeds every one).
    #[serde(default)]
    pub seq: Option<u32>,
    /// Tokens the pass fed (all sequences').
    pub tokens: u32,
    /// Each sequence's token (decode steps).
    pub fed: Vec<u32>,
    /// Each sequence's position after the pass.
    pub positions: Vec<u32>,
    /// Per layer, each sequence's chosen experts (decode steps with experts).
    pub experts: Vec<Vec<u32>>,
    /// Experts an expert cache wrote into GPU slots.
    pub fetched: Vec<ExpertFetch>,
    /// Chosen experts already resident.
    pub expert_hits: u64,
    /// Chosen experts fetched.
    pub expert_misses: u64,
    /// Weight bytes written host-to-GPU.
    pub expert_bytes: u64,
    /// Raw and compressed K/V pages in use after the pass.
    pub kv_pages_in_use: u32,
    /// K/V pages FlexGen moved to host memory.
    pub kv_to_host: u64,
    /// K/V pages FlexGen moved back to the GPU.
    pub kv_to_gpu: u64,
    /// Host pages whose K/V went to the spill tier.
    pub kv_to_spill: u64,
    /// Pages taken back from the spill tier.
    pub kv_from_spill: u64,
}

/// Where a model's passes go while it records ([`crate::forward::GpuLlama::record_trace`]).
pub struct TraceSink {
    out: Box<dyn Write + Send>,
    pub(crate) pass: u64,
    /// FlexGen's cumulative page moves at the last pass: to host, to GPU, to spill, from spill.
    pub(crate) tier: [u64; 4],
}

impl TraceSink {
    /// Write `header` to `out`; passes follow.
    pub fn new(mut out: Box<dyn Write + Send>, header: &ModelTraceHeader) -> Result<TraceSink> {
        let line = serde_json::to_string(header).map_err(|e| Error::Input(format!("trace header: {e}")))?;
        writeln!(out, "{line}").and_then(|()| out.flush()).map_err(|e| Error::Input(format!("writing the trace: {e}")))?;
        Ok(TraceSink { out, pass: 0, tier: [0; 4] })
    }

    /// Write one pass (numbered here) and flush it.
    pub(crate) fn write(&mut self, mut r: PassRecord) -> Result<()> {
        r.pass = self.pass;
        self.pass += 1;
        let line = serde_json::to_string(&r).map_err(|e| Error::Input(format!("trace record: {e}")))?;
        writeln!(self.out, "{line}").and_then(|()| self.out.flush()).map_err(|e| Error::Input(format!("writing the trace: {e}")))
    }
}

impl crate::forward::GpuLlama {
    /// Record every later pass (prefill chunk or decode step) into `sink`, one line each, written
    /// when the pass has finished. Reading the pool's page count back costs one wait per pass.
    pub fn record_trace(&mut self, mut sink: TraceSink) {
        if let Some((fg, _)) = &self.kv.flexgen {
            let t = &fg.stats;
            sink.tier = [t.offloaded_pages, t.fetched_pages, t.pages_to_spill, t.pages_from_spill];
        }
        self.trace = Some(sink);
    }

    /// The pass that just finished, into the trace: `fed` is the decode step's tokens (`None`
    /// for a prefill chunk of `tokens` tokens into sequence `seq`).
    pub(crate) async fn trace_pass(
        &mut self,
        rt: &expertkv_core::Runtime,
        tokens: u32,
        fed: Option<&[u32]>,
        seq: Option<u32>,
    ) -> Result<()> {
        let ctl = self.kv.pool.read_ctl(rt).await?;
        let c = &self.kv.pool.cfg;
        let kv_pages_in_use = c.pages_in_use(&ctl);
        let layers = self.cfg.block_count as usize;
        let mut r = PassRecord {
            prefill: fed.is_none(),
            seq,
            tokens,
            fed: fed.map(<[u32]>::to_vec).unwrap_or_default(),
            positions: self.positions.clone(),
            kv_pages_in_use,
            ..Default::default()
        };
        if let (Some(moe), Some(_)) = (&self.moe, fed) {
            let per_layer = moe.last_chosen.len() / layers.max(1);
            if per_layer > 0 {
                r.experts = moe.last_chosen.chunks(per_layer).map(<[u32]>::to_vec).collect();
            }
            if let Some(cache) = &moe.cache {
                r.fetched = cache.last_fetches.clone();
                (r.expert_hits, r.expert_misses, r.expert_bytes) = (cache.last.hits, cache.last.misses, cache.last.bytes);
            }
        }
        let Some(sink) = self.trace.as_mut() else { return Ok(()) };
        if let Some((fg, _)) = &self.kv.flexgen {
            let t = &fg.stats;
            let now = [t.offloaded_pages, t.fetched_pages, t.pages_to_spill, t.pages_from_spill];
            [r.kv_to_host, r.kv_to_gpu, r.kv_to_spill, r.kv_from_spill] = std::array::from_fn(|i| now[i].saturating_sub(sink.tier[i]));
            sink.tier = now;
        }
        sink.write(r)
    }
}

/// A model trace as read: its header, its passes, and whether its last line was torn.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelTrace {
    /// The first line.
    pub header: ModelTraceHeader,
    /// Every whole pass, in order.
    pub passes: Vec<PassRecord>,
    /// The file ended in the middle of a record (a killed run): that record is left out.
    pub torn: bool,
}

/// Read one line of at most [`MAX_LINE_BYTES`] (bounded before anything larger is held);
/// `None` at the end; with whether it ended in a newline.
fn next_line(r: &mut impl BufRead, n: usize, buf: &mut Vec<u8>) -> Result<Option<(String, bool)>> {
    buf.clear();
    let got = std::io::Read::take(&mut *r, MAX_LINE_BYTES as u64 + 1)
        .read_until(b'\n', buf)
        .map_err(|e| Error::Input(format!("model trace line {n}: {e}")))?;
    if got == 0 {
        return Ok(None);
    }
    if buf.len() > MAX_LINE_BYTES {
        return Err(Error::Input(format!("model trace line {n}: over {MAX_LINE_BYTES} bytes")));
    }
    let whole = buf.ends_with(b"\n");
    let s = std::str::from_utf8(buf).map_err(|e| Error::Input(format!("model trace line {n}: not UTF-8: {e}")))?;
    Ok(Some((s.trim_end_matches(['\n', '\r']).to_string(), whole)))
}

/// Read a model trace: its header and every pass, in order. A last line cut short (no newline,
/// not a record: the run was killed while writing it) is left out and reported in
/// [`ModelTrace::torn`]; any other bad line is refused with its number.
pub fn read_model_trace(mut r: impl BufRead) -> Result<ModelTrace> {
    let mut buf = Vec::new();
    let Some((first, _)) = next_line(&mut r, 1, &mut buf)? else {
        return Err(Error::Input("the model trace is empty (no header)".into()));
    };
    let header: ModelTraceHeader =
        serde_json::from_str(&first).map_err(|e| Error::Input(format!("model trace line 1: not an expertkv model trace header ({e})")))?;
    if header.format != MODEL_TRACE_FORMAT {
        return Err(Error::Input(format!("model trace line 1: format `{}`, not `{MODEL_TRACE_FORMAT}`", header.format)));
    }
    if header.version != MODEL_TRACE_VERSION {
        return Err(Error::Input(format!("model trace line 1: version {}, this expertkv reads {MODEL_TRACE_VERSION}", header.version)));
    }
    let mut passes: Vec<PassRecord> = Vec::new();
    let mut torn = false;
    let mut n = 1;
    while let Some((line, whole)) = next_line(&mut r, n + 1, &mut buf)? {
        n += 1;
        let p: PassRecord = match serde_json::from_str(&line) {
            Ok(p) => p,
            Err(_) if !whole => {
                torn = true;
                break;
            }
            Err(e) => return Err(Error::Input(format!("model trace line {n}: {e}"))),
        };
        if p.pass != passes.len() as u64 {
            return Err(Error::Input(format!("model trace line {n}: pass {} where {} comes next", p.pass, passes.len())));
        }
        passes.push(p);
    }
    Ok(ModelTrace { header, passes, torn })
}

/// Two traces side by side: the first pass where each aspect parts, and each one's totals.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TraceComparison {
    /// Passes in each.
    pub passes: [usize; 2],
    /// The first pass (index) whose fed tokens, positions or chosen experts differ (`None`:
    /// equal over the passes both hold).
    pub routing_parts_at: Option<usize>,
    /// The first pass whose expert fetches differ.
    pub residency_parts_at: Option<usize>,
    /// The first pass whose K/V page count or page moves differ.
    pub kv_parts_at: Option<usize>,
    /// Per trace: expert misses (sums saturate).
    pub expert_misses: [u64; 2],
    /// Per trace: weight bytes moved host-to-GPU.
    pub expert_bytes: [u64; 2],
    /// Per trace: K/V pages FlexGen moved (to host plus back to the GPU).
    pub kv_pages_moved: [u64; 2],
}

/// Compare two traces pass by pass.
pub fn compare(a: &[PassRecord], b: &[PassRecord]) -> TraceComparison {
    let first = |same: &dyn Fn(&PassRecord, &PassRecord) -> bool| a.iter().zip(b).position(|(x, y)| !same(x, y));
    let total = |t: &[PassRecord], f: &dyn Fn(&PassRecord) -> u64| t.iter().map(f).fold(0, u64::saturating_add);
    TraceComparison {
        passes: [a.len(), b.len()],
        routing_parts_at: first(&|x, y| {
            x.prefill == y.prefill
                && x.seq == y.seq
                && x.tokens == y.tokens
                && x.fed == y.fed
                && x.positions == y.positions
                && x.experts == y.experts
        }),
        residency_parts_at: first(&|x, y| x.fetched == y.fetched),
        kv_parts_at: first(&|x, y| {
            (x.kv_pages_in_use, x.kv_to_host, x.kv_to_gpu, x.kv_to_spill, x.kv_from_spill)
                == (y.kv_pages_in_use, y.kv_to_host, y.kv_to_gpu, y.kv_to_spill, y.kv_from_spill)
        }),
        expert_misses: [total(a, &|p| p.expert_misses), total(b, &|p| p.expert_misses)],
        expert_bytes: [total(a, &|p| p.expert_bytes), total(b, &|p| p.expert_bytes)],
        kv_pages_moved: [total(a, &|p| p.kv_to_host.saturating_add(p.kv_to_gpu)), total(b, &|p| p.kv_to_host.saturating_add(p.kv_to_gpu))],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pass(i: u64, experts: Vec<Vec<u32>>) -> PassRecord {
        PassRecord { pass: i, tokens: 1, fed: vec![7], positions: vec![i as u32 + 1], experts, ..Default::default() }
    }

    /// A written trace reads back whole, and a torn last line is left out and reported; foreign,
    /// versioned, out-of-order and damaged input is refused with its line; a comparison finds
    /// the first pass where routing parts, and its totals saturate.
    #[test]
    fn traces_round_trip_refuse_bad_lines_and_compare() {
        let h = ModelTraceHeader::new("m.gguf", 0xabc, [2, 8, 2, 1], "run");
        let buf = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl Write for Shared {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().map_err(|_| std::io::Error::other("poisoned"))?.extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut sink = TraceSink::new(Box::new(Shared(buf.clone())), &h).expect("header");
        let a: Vec<PassRecord> = (0..4).map(|i| pass(i, vec![vec![1, 2], vec![3, i as u32]])).collect();
        for p in &a {
            sink.write(p.clone()).expect("write");
        }
        let text = String::from_utf8(buf.lock().expect("lock").clone()).expect("utf-8");
        let t = read_model_trace(text.as_bytes()).expect("read");
        assert_eq!((&t.header, &t.passes, t.torn), (&h, &a, false));
        // A killed run's last line, cut short: the whole passes before it, the cut reported.
        let cut = read_model_trace(&text.as_bytes()[..text.len() - 10]).expect("a torn trace");
        assert_eq!((&cut.passes[..], cut.torn), (&a[..3], true));
        // Totals saturate instead of overflowing on crafted counts.
        let mut big = a.clone();
        for p in &mut big {
            (p.expert_misses, p.kv_to_host, p.kv_to_gpu) = (u64::MAX, u64::MAX, 1);
        }
        assert_eq!(compare(&big, &big).expert_misses, [u64::MAX; 2]);
        let mut b = a.clone();
        b[2].experts[1][1] = 6;
        let c = compare(&a, &b);
        assert_eq!((c.routing_parts_at, c.residency_parts_at, c.passes), (Some(2), None, [4, 4]));
        assert_eq!(compare(&a, &a).routing_parts_at, None);
        let lines: Vec<&str> = text.lines().collect();
        for (bad, why) in [
            (lines[1..].join("\n"), "header"),
            (text.replace("expertkv-model-trace", "other"), "format"),
            (text.replace("\"version\":1", "\"version\":2"), "version"),
            ([lines[0], lines[2]].join("\n"), "comes next"),
            (format!("{}\n{}\n{}", lines[0], &lines[1][..lines[1].len() / 2], lines[2]), "line 2"),
            (text.replace("\"prefill\"", "\"prefil\""), "line 2"),
        ] {
            let e = read_model_trace(bad.as_bytes()).expect_err(why).to_string();
            assert!(e.contains(why), "{why}: {e}");
        }
    }
}
