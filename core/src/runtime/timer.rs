//! GPU timestamps around compute passes.

use crate::error::Result;
use crate::runtime::Runtime;

/// `capacity` begin/end pairs of timestamps, resolved into one buffer.
pub struct GpuTimer {
    query_set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    capacity: u32,
    period_ns: f64,
}

impl GpuTimer {
    /// `None` when the device has no timestamp queries.
    pub fn new(rt: &Runtime, capacity: u32) -> Option<GpuTimer> {
        if !rt.caps.timestamps || capacity == 0 {
            return None;
        }
        let count = 2 * capacity;
        let query_set =
            rt.device.create_query_set(&wgpu::QuerySetDescriptor { label: Some("expertkv timer"), ty: wgpu::QueryType::Timestamp, count });
        let resolve = rt.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("expertkv timer resolve"),
            size: u64::from(count) * 8,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        Some(GpuTimer { query_set, resolve, capacity, period_ns: f64::from(rt.caps.timestamp_period_ns) })
    }

    /// Begin/end pairs the timer holds: passes it can time per resolve.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Timestamp writes for pair `i` at the beginning and end of a compute pass.
    pub fn pass(&self, i: u32) -> Option<wgpu::ComputePassTimestampWrites<'_>> {
        (i < self.capacity).then(|| wgpu::ComputePassTimestampWrites {
            query_set: &self.query_set,
            beginning_of_pass_write_index: Some(2 * i),
            end_of_pass_write_index: Some(2 * i + 1),
        })
    }

    /// Resolve the first `n` pairs (encode after the passes).
    pub fn resolve(&self, enc: &mut wgpu::CommandEncoder, n: u32) {
        let n = n.min(self.capacity);
        if n > 0 {
            enc.resolve_query_set(&self.query_set, 0..2 * n, &self.resolve, 0);
        }
    }

    /// Milliseconds of the first `n` pairs (after the resolving submission).
    pub async fn read_ms(&self, rt: &Runtime, n: u32) -> Result<Vec<f64>> {
        let n = n.min(self.capacity);
        let ticks: Vec<u64> = rt.read(&self.resolve, 0, u64::from(2 * n)).await?;
        Ok(ticks.chunks(2).map(|p| p[1].saturating_sub(p[0]) as f64 * self.period_ns * 1e-6).collect())
    }
}

/// Median of a non-empty sample (NaN when empty).
pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n % 2 == 1 { s[n / 2] } else { 0.5 * (s[n / 2 - 1] + s[n / 2]) }
}
