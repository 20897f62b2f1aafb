// shard_append, pass 2 of 3: take pages for the items that open one, in batch order, from the
// GPU-resident free stack (no host round trip), and advance each ring. One workgroup.
// If the free stack cannot cover the batch, nothing changes: the batch is refused with
// ERR_POOL_EXHAUSTED and `abort` set, so no cached token is lost or half-written; likewise with
// ERR_RING_FULL where a full ring would recycle a compressed page (an id past the raw pages) as
// a raw one. Every page the batch writes into has its generation (`page_gen`) raised, so a
// summary of the page's contents (QUEST's bounds) knows it is stale.

//!import common/pool.wgsl
//!import common/append.wgsl
//!import common/scan.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: AppendParams;
@group(0) @binding(2) var<storage, read_write> plan: array<TokenPlan>;
@group(0) @binding(3) var<storage, read_write> rings: array<RingState>;
@group(0) @binding(4) var<storage, read_write> ring_pages: array<u32>;
@group(0) @binding(5) var<storage, read> free_stack: array<u32>;
@group(0) @binding(6) var<storage, read_write> ctl: PoolCtl;
@group(0) @binding(7) var<storage, read_write> page_meta: array<PageMeta>;
@group(0) @binding(8) var<storage, read_write> page_gen: array<atomic<u32>>;

const WG: u32 = 256u;
var<workgroup> verdict: u32;

fn n_items() -> u32 {
    return params.n_tokens * geo.kv_heads;
}

fn needs_free(i: u32) -> u32 {
    if (i < n_items() && (plan[i].flags & PLAN_NEEDS_FREE) != 0u) {
        return 1u;
    }
    return 0u;
}

// Inclusive prefix sum of `v` over the workgroup; returns this invocation's inclusive sum.

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) t: u32) {
    let n = n_items();
    let rounds = (n + WG - 1u) / WG;

    // Count pages wanted from the free stack; refuse the whole batch if they are not there.
    var wanted = 0u;
    var invalid = 0u;
    var full = 0u;
    for (var r = 0u; r < rounds; r++) {
        let i = r * WG + t;
        wanted += needs_free(i);
        if (i < n && (plan[i].flags & PLAN_INVALID) != 0u) {
            invalid = 1u;
        }
        if (i < n && (plan[i].flags & (PLAN_RECYCLES | PLAN_INVALID)) == PLAN_RECYCLES
            && ring_pages[plan[i].key * geo.ring_capacity + plan[i].ring_index] >= geo.n_pages) {
            full = 1u;
        }
    }
    let total = workgroup_scan(t, wanted);
    let any_invalid = workgroup_scan(t, invalid);
    let any_full = workgroup_scan(t, full);
    if (t == WG - 1u) {
        var v = 0u;
        if (any_invalid != 0u) {
            v = ERR_BAD_TOKEN;
        } else if (total > ctl.free_top) {
            v = ERR_POOL_EXHAUSTED;
        } else if (any_full != 0u) {
            v = ERR_RING_FULL;
        }
        verdict = v;
        if (v != 0u) {
            ctl.error_flags |= v;
            ctl.abort = 1u;
        } else {
            ctl.abort = 0u;
        }
    }
    if (workgroupUniformLoad(&verdict) != 0u) {
        return;
    }

    let free_top = ctl.free_top;
    var base = 0u;
    var recycled = 0u;
    for (var r = 0u; r < rounds; r++) {
        let i = r * WG + t;
        let f = needs_free(i);
        let incl = workgroup_scan(t, f);
        let round_total = workgroupUniformLoad(&scan[WG - 1u]);
        if (i < n) {
            let p = plan[i];
            let entry = p.key * geo.ring_capacity + p.ring_index;
            if (f == 1u) {
                // The k-th page taken in this batch is the k-th from the top of the stack.
                let k = base + incl - 1u;
                let page = free_stack[free_top - 1u - k];
                ring_pages[entry] = page;
                page_meta[page].owner = p.key;
                page_meta[page].fill = 0u;
            } else if ((p.flags & PLAN_RECYCLES) != 0u) {
                // Ring full: its oldest page becomes its newest, in place; its tokens are dropped.
                let page = ring_pages[entry];
                page_meta[page].fill = 0u;
                recycled += 1u;
            }
            if ((p.flags & PLAN_LAST_IN_KEY) != 0u) {
                let P = geo.page_size;
                let R = geo.ring_capacity;
                var ring = rings[p.key];
                if (p.u < P) {
                    ring.fill = p.u + 1u;
                } else {
                    let new_pages = (p.u - P) / P + 1u;
                    let grown = ring.count + new_pages;
                    if (grown > R) {
                        ring.head = (ring.head + grown - R) % R;
                        ring.count = R;
                    } else {
                        ring.count = grown;
                    }
                    ring.fill = (p.u - P) % P + 1u;
                }
                rings[p.key] = ring;
            }
        }
        base += round_total;
        workgroupBarrier();
    }
    // Each item's page (taken above, possibly by another invocation) gains a generation.
    storageBarrier();
    for (var r = 0u; r < rounds; r++) {
        let i = r * WG + t;
        if (i < n) {
            let page = ring_pages[plan[i].key * geo.ring_capacity + plan[i].ring_index];
            if (page < geo.n_pages) {
                atomicAdd(&page_gen[page], 1u);
            }
        }
    }
    let overflows = workgroup_scan(t, recycled);
    if (t == WG - 1u) {
        ctl.free_top = free_top - base;
        ctl.ring_overflows += overflows;
        ctl.tokens_appended += params.n_tokens;
    }
}
