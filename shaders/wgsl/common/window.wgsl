// The pool is split over several buffers when it exceeds the adapter's storage-binding limit.
// Kernels that touch K/V run once per pool buffer, bound to that buffer, and act only on the
// pages it holds.

// must match `PoolWindow` in core/src/gpu_data.rs
struct PoolWindow {
    buffer_index: u32,
    first_page: u32,   // global id of the buffer's first page
    page_count: u32,   // pages held by this buffer
    n_buffers: u32,
}

fn in_window(w: PoolWindow, page: u32) -> bool {
    return page >= w.first_page && page - w.first_page < w.page_count;
}
