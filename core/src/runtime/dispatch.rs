//! Dispatches counted as they are encoded: every compute dispatch of expertkv goes through
//! [`CountedDispatch`], which adds one to a per-thread counter, so a caller can measure how many
//! dispatches a step encodes ([`dispatches_encoded`] before and after). Encoding happens on the
//! calling thread, so the count is exact for that thread whatever other threads encode.

use std::cell::Cell;

thread_local! {
    static DISPATCHES: Cell<u64> = const { Cell::new(0) };
}

/// Compute dispatches encoded on this thread so far (direct and indirect).
pub fn dispatches_encoded() -> u64 {
    DISPATCHES.with(Cell::get)
}

/// A compute pass's dispatches, counted ([`dispatches_encoded`]).
pub trait CountedDispatch {
    /// `dispatch_workgroups(x, y, z)`, counted.
    fn dispatch_counted(&mut self, x: u32, y: u32, z: u32);
    /// `dispatch_workgroups_indirect(buffer, offset)`, counted.
    fn dispatch_indirect_counted(&mut self, buffer: &wgpu::Buffer, offset: u64);
}

impl CountedDispatch for wgpu::ComputePass<'_> {
    fn dispatch_counted(&mut self, x: u32, y: u32, z: u32) {
        DISPATCHES.with(|c| c.set(c.get() + 1));
        self.dispatch_workgroups(x, y, z);
    }

    fn dispatch_indirect_counted(&mut self, buffer: &wgpu::Buffer, offset: u64) {
        DISPATCHES.with(|c| c.set(c.get() + 1));
        self.dispatch_workgroups_indirect(buffer, offset);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_counter_starts_per_thread_cpu() {
        let here = super::dispatches_encoded();
        let other = std::thread::spawn(super::dispatches_encoded).join().expect("thread");
        assert_eq!(other, 0, "a new thread has encoded nothing");
        assert_eq!(super::dispatches_encoded(), here);
    }
}
