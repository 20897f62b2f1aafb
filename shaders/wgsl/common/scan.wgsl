// The workgroup prefix sum of the one-workgroup bookkeeping kernels (append/alloc,
// append/release, compress/plan, evict/compact, evict/free, evict/quest_select): 256 invocations,
// Hillis-Steele over workgroup memory. `scan[SCAN_WG - 1u]` holds the round's total after a call.

const SCAN_WG: u32 = 256u;
var<workgroup> scan: array<u32, SCAN_WG>;

// Inclusive prefix sum of `v` over the workgroup's invocations `0..=t`; every invocation calls it.
fn workgroup_scan(t: u32, v: u32) -> u32 {
    scan[t] = v;
    workgroupBarrier();
    for (var off = 1u; off < SCAN_WG; off = off * 2u) {
        var add = 0u;
        if (t >= off) {
            add = scan[t - off];
        }
        workgroupBarrier();
        scan[t] += add;
        workgroupBarrier();
    }
    let r = scan[t];
    workgroupBarrier();
    return r;
}
