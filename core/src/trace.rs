//! Decode traces: what every step did at every layer, aligned, in a documented text format that
//! `expertkv record` writes and `expertkv replay` reads back (and re-runs to check).
//!
//! # Format (version 1)
//!
//! JSON lines, UTF-8. The first line is the header:
//!
//! ```json
//! {"format":"expertkv-trace","version":1,"steps":16,"config":{ ...the whole DemoConfig... }}
//! ```
//!
//! Every further line is one [`LayerRecord`], in order: step 0 layer 0, step 0 layer 1, ...,
//! exactly `steps x layers` of them:
//!
//! ```json
//! {"step":0,"layer":1,"experts":[3,7,1,3],"pages_read":72,"bytes_read":294912,
//!  "pages_in_use":70,"tokens_evicted":8,"slots_moved":5,"pages_freed":1,"bytes_moved":2560}
//! ```
//!
//! - `experts`: the routed experts of the step's tokens at this layer, `n_seqs x top_k`
//!   (sequence-major, each token's k experts distinct and below `n_experts`).
//! - `pages_read`, `bytes_read`: page-list entries the layer's attention read, and their bytes
//!   (raw and compressed pages at their own sizes; QUEST counts its selected pages).
//! - `pages_in_use`: pages held by the layer's shard rings after the step.
//! - `tokens_evicted`, `slots_moved`, `pages_freed`: the layer's share of the step's eviction
//!   (victims, compaction moves, pages returned to the free stack); zero without a scheduler.
//! - `bytes_moved`: K/V bytes the compaction copied (`slots_moved` x one head's K and V).
//!
//! Readers reject, with the line number: a missing or foreign header, another version, unknown
//! fields, records out of order or past `steps x layers`, experts out of range or repeated
//! within a token, lines over [`MAX_LINE_BYTES`], and invalid UTF-8 or JSON. Nothing is
//! allocated from a size the file claims before the data backs it.

use std::io::{BufRead, Write};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::pipeline::DemoConfig;
pub use crate::pipeline::LayerRecord;

/// The header's `format` value, which marks a file as an expertkv trace.
pub const TRACE_FORMAT: &str = "expertkv-trace";
/// The format version this crate writes and reads.
pub const TRACE_VERSION: u32 = 1;
/// Longest line a reader accepts.
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// A trace's first line.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceHeader {
    /// [`TRACE_FORMAT`].
    pub format: String,
    /// [`TRACE_VERSION`] for traces this crate writes.
    pub version: u32,
    /// Decode steps recorded: the trace holds `steps x layers` records.
    pub steps: u32,
    /// The whole run configuration, so that `expertkv replay` can run it again.
    pub config: DemoConfig,
}

impl TraceHeader {
    /// The header of a trace of `config`'s run (its `steps` steps).
    pub fn new(config: DemoConfig) -> TraceHeader {
        TraceHeader { format: TRACE_FORMAT.into(), version: TRACE_VERSION, steps: config.steps, config }
    }
}

/// A whole trace in memory.
#[derive(Clone, Debug)]
pub struct Trace {
    /// The header line.
    pub header: TraceHeader,
    /// Every record, step by step and within a step layer by layer.
    pub records: Vec<LayerRecord>,
}

impl Trace {
    /// The records of one step (all layers).
    pub fn step(&self, step: u32) -> &[LayerRecord] {
        let l = self.header.config.workload.layers as usize;
        let s = step as usize * l;
        self.records.get(s..s + l).unwrap_or(&[])
    }
}

/// Writes a trace line by line.
pub struct TraceWriter<W: Write> {
    out: W,
}

impl<W: Write> TraceWriter<W> {
    /// Write `header` as the first line of `out`.
    pub fn new(mut out: W, header: &TraceHeader) -> Result<Self> {
        let line = serde_json::to_string(header).map_err(|e| Error::Input(format!("trace header: {e}")))?;
        writeln!(out, "{line}").map_err(io_err)?;
        Ok(TraceWriter { out })
    }

    /// Write one record as a line (in step, then layer order; the writer does not check).
    pub fn write(&mut self, r: &LayerRecord) -> Result<()> {
        let line = serde_json::to_string(r).map_err(|e| Error::Input(format!("trace record: {e}")))?;
        writeln!(self.out, "{line}").map_err(io_err)
    }

    /// Flush what is written so far. Called at the end of every step, a process killed
    /// mid-run leaves a trace of whole steps (at most the step being written torn), which
    /// `replay --partial` reads.
    pub fn flush(&mut self) -> Result<()> {
        self.out.flush().map_err(io_err)
    }

    /// Flush and hand the writer back.
    pub fn finish(mut self) -> Result<W> {
        self.out.flush().map_err(io_err)?;
        Ok(self.out)
    }
}

fn io_err(e: std::io::Error) -> Error {
    Error::Input(format!("trace I/O: {e}"))
}

fn bad(line: usize, msg: impl std::fmt::Display) -> Error {
    Error::Input(format!("trace line {line}: {msg}"))
}

/// Read one line of at most `MAX_LINE_BYTES`; `None` at the end.
fn next_line(r: &mut impl BufRead, n: usize, buf: &mut Vec<u8>) -> Result<Option<String>> {
    buf.clear();
    let got = std::io::Read::take(&mut *r, MAX_LINE_BYTES as u64 + 1).read_until(b'\n', buf).map_err(io_err)?;
    if got == 0 {
        return Ok(None);
    }
    if buf.len() > MAX_LINE_BYTES {
        return Err(bad(n, format!("longer than {MAX_LINE_BYTES} bytes")));
    }
    let s = std::str::from_utf8(buf).map_err(|e| bad(n, format!("not UTF-8: {e}")))?;
    Ok(Some(s.trim_end_matches(['\n', '\r']).to_string()))
}

/// Parse and validate a whole trace.
pub fn read_trace(r: impl BufRead) -> Result<Trace> {
    read_trace_with(r, false).map(|(t, _)| t)
}

/// A trace whose run stopped early (an error, a lost device, a killed process): the whole steps
/// it holds, the header's step count cut to them (its config keeps the run's own, which budgets
/// given as a share of the context depend on), and the steps the header promised when fewer are
/// there (`None`: complete). A last line torn mid-write ends the trace; anything malformed
/// before it is still an error.
pub fn read_trace_partial(r: impl BufRead) -> Result<(Trace, Option<u32>)> {
    read_trace_with(r, true)
}

fn read_trace_with(mut r: impl BufRead, partial: bool) -> Result<(Trace, Option<u32>)> {
    let mut buf = Vec::new();
    let first = next_line(&mut r, 1, &mut buf)?.ok_or_else(|| bad(1, "empty file: no trace header"))?;
    // Format and version first, so that another file or version says so plainly.
    let probe: serde_json::Value = serde_json::from_str(&first).map_err(|e| bad(1, format!("not a JSON trace header: {e}")))?;
    match probe.get("format").and_then(|f| f.as_str()) {
        Some(TRACE_FORMAT) => {}
        Some(other) => return Err(bad(1, format!("format `{other}` is not `{TRACE_FORMAT}`"))),
        None => return Err(bad(1, format!("no `format` field: not an {TRACE_FORMAT} file"))),
    }
    match probe.get("version").and_then(|v| v.as_u64()) {
        Some(v) if v == u64::from(TRACE_VERSION) => {}
        Some(v) => return Err(bad(1, format!("version {v}; this build reads version {TRACE_VERSION}"))),
        None => return Err(bad(1, "no `version` field")),
    }
    let header: TraceHeader = serde_json::from_value(probe).map_err(|e| bad(1, format!("header: {e}")))?;
    let w = &header.config.workload;
    if w.layers == 0 || w.n_seqs == 0 || w.top_k == 0 || w.n_experts == 0 || w.top_k > w.n_experts {
        return Err(bad(1, format!("config: layers {}, seqs {}, top_k {} of {} experts", w.layers, w.n_seqs, w.top_k, w.n_experts)));
    }
    if header.steps != header.config.steps {
        return Err(bad(1, format!("steps {} differs from config.steps {}", header.steps, header.config.steps)));
    }
    let expected = u64::from(header.steps) * u64::from(w.layers);
    let per_layer = w.n_seqs as usize * w.top_k as usize;
    let k = w.top_k as usize;
    let mut records = Vec::new();
    let mut n = 1;
    while let Some(line) = next_line(&mut r, n + 1, &mut buf)? {
        n += 1;
        if line.trim().is_empty() {
            continue;
        }
        let i = records.len() as u64;
        if i >= expected {
            return Err(bad(n, format!("more records than steps x layers = {expected}")));
        }
        let rec: LayerRecord = match serde_json::from_str(&line) {
            Ok(rec) => rec,
            Err(e) => {
                // A torn last line: what follows it decides (nothing may).
                let last = next_line(&mut r, n + 1, &mut buf)?.is_none();
                if partial && last {
                    break;
                }
                let hint = if last { " (the last line, torn? `replay --partial` reads the whole steps before it)" } else { "" };
                return Err(bad(n, format!("{e}{hint}")));
            }
        };
        let (want_step, want_layer) = ((i / u64::from(w.layers)) as u32, (i % u64::from(w.layers)) as u32);
        if (rec.step, rec.layer) != (want_step, want_layer) {
            return Err(bad(n, format!("record for step {} layer {}, expected step {want_step} layer {want_layer}", rec.step, rec.layer)));
        }
        if rec.experts.len() != per_layer {
            return Err(bad(n, format!("{} experts, expected seqs x top_k = {per_layer}", rec.experts.len())));
        }
        for (t, ex) in rec.experts.chunks(k).enumerate() {
            if let Some(e) = ex.iter().find(|&&e| e >= w.n_experts) {
                return Err(bad(n, format!("token {t}: expert {e} is not below n_experts = {}", w.n_experts)));
            }
            if (1..ex.len()).any(|a| ex[..a].contains(&ex[a])) {
                return Err(bad(n, format!("token {t}: experts {ex:?} repeat")));
            }
        }
        if rec.slots_moved > 0 && rec.bytes_moved == 0 {
            return Err(bad(n, "slots moved but no bytes moved"));
        }
        records.push(rec);
    }
    if records.len() as u64 != expected {
        if !partial {
            return Err(bad(
                n,
                format!(
                    "{} records, the header promises steps x layers = {expected} (truncated? `replay --partial` reads the whole steps there are)",
                    records.len()
                ),
            ));
        }
        let promised = header.steps;
        let steps = (records.len() / w.layers as usize) as u32;
        records.truncate(steps as usize * w.layers as usize);
        let mut header = header;
        header.steps = steps;
        return Ok((Trace { header, records }, Some(promised)));
    }
    Ok((Trace { header, records }, None))
}

/// Where a replay first departs from its trace.
pub fn first_difference(want: &LayerRecord, got: &LayerRecord) -> Option<String> {
    let fields: [(&str, u64, u64); 7] = [
        ("pages_read", want.pages_read, got.pages_read),
        ("bytes_read", want.bytes_read, got.bytes_read),
        ("pages_in_use", want.pages_in_use, got.pages_in_use),
        ("tokens_evicted", want.tokens_evicted, got.tokens_evicted),
        ("slots_moved", want.slots_moved, got.slots_moved),
        ("pages_freed", want.pages_freed, got.pages_freed),
        ("bytes_moved", want.bytes_moved, got.bytes_moved),
    ];
    if want.experts != got.experts {
        let i = want.experts.iter().zip(&got.experts).position(|(a, b)| a != b).unwrap_or(0);
        return Some(format!("routing differs first at entry {i}: trace {:?}, replay {:?}", want.experts.get(i), got.experts.get(i)));
    }
    fields.iter().find(|(_, a, b)| a != b).map(|(name, a, b)| format!("{name}: trace {a}, replay {b}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    fn sample(steps: u32) -> String {
        let mut cfg = DemoConfig { steps, ..Default::default() };
        cfg.workload.layers = 2;
        cfg.workload.n_seqs = 3;
        let mut w = TraceWriter::new(Vec::new(), &TraceHeader::new(cfg.clone())).unwrap();
        let mut rng = Rng::new(1);
        for step in 0..steps {
            for layer in 0..2 {
                let mut experts = Vec::new();
                for _ in 0..3 {
                    let a = rng.below(cfg.workload.n_experts);
                    let b = (a + 1 + rng.below(cfg.workload.n_experts - 1)) % cfg.workload.n_experts;
                    experts.extend([a, b]);
                }
                w.write(&LayerRecord {
                    step,
                    layer,
                    experts,
                    pages_read: 10,
                    bytes_read: 40960,
                    pages_in_use: 9,
                    tokens_evicted: 2,
                    slots_moved: 1,
                    pages_freed: 0,
                    bytes_moved: 256,
                })
                .unwrap();
            }
        }
        String::from_utf8(w.finish().unwrap()).unwrap()
    }

    #[test]
    fn round_trip() {
        let text = sample(4);
        let t = read_trace(text.as_bytes()).unwrap();
        assert_eq!(t.records.len(), 8);
        assert_eq!(t.step(3)[1].layer, 1);
        assert!(first_difference(&t.records[0], &t.records[0]).is_none());
        let mut other = t.records[0].clone();
        other.bytes_moved += 1;
        assert!(first_difference(&t.records[0], &other).unwrap().contains("bytes_moved"));
    }

    #[test]
    fn malformed_traces_are_named_errors() {
        let text = sample(2);
        let lines: Vec<&str> = text.lines().collect();
        let err = |t: &str| read_trace(t.as_bytes()).unwrap_err().to_string();
        assert!(err("").contains("empty"));
        assert!(err("not json\n").contains("line 1"));
        assert!(err(&text.replace(TRACE_FORMAT, "other-trace")).contains("format `other-trace`"));
        assert!(err(&text.replacen("\"version\":1", "\"version\":2", 1)).contains("version 2"));
        assert!(err(&lines[..3].join("\n")).contains("truncated"));
        let swapped = [lines[0], lines[2], lines[1], lines[3], lines[4]].join("\n");
        assert!(err(&swapped).contains("expected step 0 layer 0"));
        let extra = format!("{text}{}\n", lines[4]);
        assert!(err(&extra).contains("more records"));
        let bad_expert = text.replacen("\"experts\":[", "\"experts\":[999,", 1);
        assert!(err(&bad_expert).contains("line 2"));
        let unknown = text.replacen("\"pages_read\"", "\"pages_reed\"", 1);
        assert!(err(&unknown).contains("line 2"));
    }

    #[test]
    fn a_stopped_runs_trace_reads_to_its_last_whole_step() {
        let text = sample(4);
        let lines: Vec<&str> = text.lines().collect();
        // Header, 3 whole steps (2 layers each), one layer of the 4th, and a torn line.
        let cut = format!("{}\n{}", lines[..8].join("\n"), &lines[8][..lines[8].len() / 2]);
        assert!(read_trace(cut.as_bytes()).unwrap_err().to_string().contains("--partial"));
        let (t, promised) = read_trace_partial(cut.as_bytes()).unwrap();
        assert_eq!((t.header.steps, t.header.config.steps, t.records.len(), promised), (3, 4, 6, Some(4)));
        assert_eq!(t.step(2)[1].layer, 1);
        // A complete trace reads the same either way; a malformed line before the end is still an error.
        let (whole, none) = read_trace_partial(text.as_bytes()).unwrap();
        assert_eq!((whole.records.len(), none), (8, None));
        let broken = text.replacen("\"pages_read\"", "\"pages_reed\"", 1);
        assert!(read_trace_partial(broken.as_bytes()).unwrap_err().to_string().contains("line 2"));
    }

    #[test]
    fn fuzzed_traces_never_panic() {
        let text = sample(3).into_bytes();
        let mut rng = Rng::new(7);
        let (mut ok, mut rejected) = (0, 0);
        for _ in 0..3000 {
            let mut t = text.clone();
            for _ in 0..1 + rng.below(4) {
                if t.is_empty() {
                    break;
                }
                let i = rng.below(t.len() as u32) as usize;
                match rng.below(5) {
                    0 => t[i] = rng.below(256) as u8,
                    1 => t[i] = b"{}[],:\"0123456789-e."[rng.below(20) as usize],
                    2 => {
                        t.truncate(i);
                    }
                    3 => {
                        let j = (i + 1 + rng.below(40) as usize).min(t.len());
                        t.drain(i..j);
                    }
                    _ => {
                        let j = (i + rng.below(60) as usize).min(t.len());
                        let piece = t[i..j].to_vec();
                        t.splice(i..i, piece);
                    }
                }
            }
            match read_trace(t.as_slice()) {
                Ok(_) => ok += 1,
                Err(e) => {
                    assert!(e.to_string().contains("trace"), "{e}");
                    rejected += 1;
                }
            }
        }
        assert!(rejected > 2500 && ok + rejected == 3000, "{ok} accepted, {rejected} rejected");
    }
}
