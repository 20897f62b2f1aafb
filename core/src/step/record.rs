//! A step's recording: one command stream, timed stage by stage, cut into segments where the
//! host must act before the GPU goes on (a host tier's page fetch, an expert cache's copies, the
//! CPU lockstep's checks). A step with nothing for the host is one segment, one submission.

use std::collections::BTreeMap;

use crate::error::Result;
use crate::runtime::Runtime;

/// Where the host acts between a step's segments for the K/V side (the sources of a step add
/// their own, [`Recorder::cut`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvPause {
    /// Layer `l`'s tokens are appended (and full pages compressed): the lockstep appends them
    /// too, and the host tier fetches the layer's host pages before its page lists are gathered
    /// (the layer's queries are written by now).
    Appended(u32),
    /// Layer `l`'s attention ran: its output and the pool's metadata can be checked.
    Attended(u32),
    /// Every layer attended, nothing evicted yet: the lockstep reads the lists as they are, the
    /// host tier moves its coldest pages out.
    BeforeEvict,
    /// The scheduler evicted: the lockstep checks its decisions.
    Evicted,
}

/// A stage of a step that work of the host can be needed by, in step order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum StepStage {
    /// Layer `l`'s attention (reads its K/V pages).
    Attention(u32),
    /// What the step's source runs after layer `l`'s attention (a model's FFN or experts).
    Output(u32),
}

/// A piece of a step's recording: the stages it runs and where the host acts after it.
pub struct Segment<P> {
    /// The recorded commands.
    pub cb: wgpu::CommandBuffer,
    /// The stages the segment runs, in order.
    pub stages: Vec<StepStage>,
    /// What the host does once the segment is submitted (`None`: nothing, the next follows).
    pub then: Option<P>,
}

/// How a [`StepTimer`] times a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timing {
    /// A timestamp pair around every timed pass: the passes' own time (what WebGPU offers).
    Passes,
    /// A timestamp between passes: all the GPU time of the stream, copies and barriers
    /// included, each stretch given to the stage that ends it (needs
    /// `TIMESTAMP_QUERY_INSIDE_ENCODERS`).
    Marks,
}

/// GPU timestamps of one recording at a time, each labelled with its stage; [`StepTimer::read`]
/// sums them by stage.
pub struct StepTimer {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    capacity: u32,
    period_ns: f64,
    timing: Timing,
    /// The stage of every pair ([`Timing::Passes`]) or of every mark after the first
    /// ([`Timing::Marks`]).
    labels: Vec<&'static str>,
}

impl StepTimer {
    /// Room for `capacity` timed passes or marks; `None` where the device cannot write the
    /// timestamps `timing` needs.
    pub fn new(rt: &Runtime, capacity: u32, timing: Timing) -> Option<StepTimer> {
        let needed = match timing {
            Timing::Passes => wgpu::Features::TIMESTAMP_QUERY,
            Timing::Marks => wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS,
        };
        if !rt.device.features().contains(needed) || capacity < 2 {
            return None;
        }
        let count = match timing {
            Timing::Passes => 2 * capacity,
            Timing::Marks => capacity,
        };
        let set =
            rt.device.create_query_set(&wgpu::QuerySetDescriptor { label: Some("step timer"), ty: wgpu::QueryType::Timestamp, count });
        let resolve = rt.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("step timer resolve"),
            size: u64::from(count) * 8,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        Some(StepTimer { set, resolve, capacity, period_ns: f64::from(rt.caps.timestamp_period_ns), timing, labels: Vec::new() })
    }

    /// How it times.
    pub fn timing(&self) -> Timing {
        self.timing
    }

    fn start(&mut self, enc: &mut wgpu::CommandEncoder) {
        self.labels.clear();
        if self.timing == Timing::Marks {
            enc.write_timestamp(&self.set, 0);
        }
    }

    /// The timestamp writes of a pass of `stage` (timing passes, while there is room).
    fn pass_writes(&mut self, stage: &'static str) -> Option<wgpu::ComputePassTimestampWrites<'_>> {
        let i = self.labels.len() as u32;
        if self.timing != Timing::Passes || i >= self.capacity {
            return None;
        }
        self.labels.push(stage);
        Some(wgpu::ComputePassTimestampWrites {
            query_set: &self.set,
            beginning_of_pass_write_index: Some(2 * i),
            end_of_pass_write_index: Some(2 * i + 1),
        })
    }

    /// A mark ending `stage` (timing marks; past the capacity its time goes to the next kept).
    fn mark(&mut self, enc: &mut wgpu::CommandEncoder, stage: &'static str) {
        let i = self.labels.len() as u32 + 1;
        if self.timing == Timing::Marks && i < self.capacity {
            enc.write_timestamp(&self.set, i);
            self.labels.push(stage);
        }
    }

    fn finish(&self, enc: &mut wgpu::CommandEncoder) {
        let n = self.labels.len() as u32;
        match self.timing {
            Timing::Passes if n > 0 => enc.resolve_query_set(&self.set, 0..2 * n, &self.resolve, 0),
            Timing::Marks if n > 0 => enc.resolve_query_set(&self.set, 0..n + 1, &self.resolve, 0),
            _ => {}
        }
    }

    /// The last recording's milliseconds per stage, summed over its passes or marks (after
    /// the recording was submitted).
    pub async fn read(&self, rt: &Runtime) -> Result<BTreeMap<&'static str, f64>> {
        let mut stages = BTreeMap::new();
        let n = self.labels.len();
        if n == 0 {
            return Ok(stages);
        }
        let ms = |a: u64, b: u64| b.saturating_sub(a) as f64 * self.period_ns * 1e-6;
        match self.timing {
            Timing::Passes => {
                let ticks: Vec<u64> = rt.read(&self.resolve, 0, 2 * n as u64).await?;
                for (label, pair) in self.labels.iter().zip(ticks.chunks(2)) {
                    *stages.entry(*label).or_insert(0.0) += ms(pair[0], pair[1]);
                }
            }
            Timing::Marks => {
                let ticks: Vec<u64> = rt.read(&self.resolve, 0, n as u64 + 1).await?;
                for (i, label) in self.labels.iter().enumerate() {
                    *stages.entry(*label).or_insert(0.0) += ms(ticks[i], ticks[i + 1]);
                }
            }
        }
        Ok(stages)
    }
}

/// A step being recorded: the current encoder, the segments cut so far, the stages they run and
/// the timer's labels.
pub struct Recorder<'t, P> {
    rt: &'t Runtime,
    label: &'static str,
    enc: wgpu::CommandEncoder,
    segments: Vec<Segment<P>>,
    stages: Vec<StepStage>,
    timer: Option<&'t mut StepTimer>,
}

impl<'t, P> Recorder<'t, P> {
    /// A recording labelled `label`, timed by `timer` when given.
    pub fn new(rt: &'t Runtime, label: &'static str, mut timer: Option<&'t mut StepTimer>) -> Self {
        let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(label) });
        if let Some(t) = timer.as_deref_mut() {
            t.start(&mut enc);
        }
        Recorder { rt, label, enc, segments: Vec::new(), stages: Vec::new(), timer }
    }

    /// The encoder, for work between passes (copies).
    pub fn enc(&mut self) -> &mut wgpu::CommandEncoder {
        &mut self.enc
    }

    /// One compute pass of `stage`, filled by `f`, timed as the timer times: a timestamp pair
    /// around it, or a mark after it (which gives the copies recorded since the last mark to
    /// `stage` too).
    pub fn pass<R>(&mut self, stage: &'static str, f: impl FnOnce(&mut wgpu::ComputePass<'_>) -> R) -> R {
        let out = {
            let ts = self.timer.as_deref_mut().and_then(|t| t.pass_writes(stage));
            let mut pass = self.enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some(stage), timestamp_writes: ts });
            f(&mut pass)
        };
        self.mark(stage);
        out
    }

    /// A mark ending `stage` (work recorded outside [`Recorder::pass`], timing marks).
    pub fn mark(&mut self, stage: &'static str) {
        if let Some(t) = self.timer.as_deref_mut() {
            t.mark(&mut self.enc, stage);
        }
    }

    /// The segment so far runs `stage`.
    pub fn tag(&mut self, stage: StepStage) {
        self.stages.push(stage);
    }

    /// End the segment here: the host does `then` once it is submitted.
    pub fn cut(&mut self, then: P) {
        let next = self.rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(self.label) });
        let cb = std::mem::replace(&mut self.enc, next).finish();
        self.segments.push(Segment { cb, stages: std::mem::take(&mut self.stages), then: Some(then) });
    }

    /// The recording's segments, the last one's timestamps resolved.
    pub fn finish(mut self) -> Vec<Segment<P>> {
        if let Some(t) = self.timer.as_deref() {
            t.finish(&mut self.enc);
        }
        self.segments.push(Segment { cb: self.enc.finish(), stages: self.stages, then: None });
        self.segments
    }
}
