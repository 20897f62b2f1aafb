// Workgroup tree reductions (attend/reduce, evict/budget, evict/ekva, evict/select). The importer
// declares `WG`, its workgroup size, a power of two; every invocation of the workgroup calls each
// function, and every invocation gets the result. The order of a float sum is the tree's, the
// same on every device, so the CPU references can replay it where a decision depends on it.

//!expects const WG: u32 = 256u;

var<workgroup> red_f: array<f32, WG>;
var<workgroup> red_u: array<u32, WG>;

fn workgroup_sum(t: u32, v: f32) -> f32 {
    red_f[t] = v;
    workgroupBarrier();
    for (var off = WG / 2u; off > 0u; off = off / 2u) {
        if (t < off) {
            red_f[t] += red_f[t + off];
        }
        workgroupBarrier();
    }
    let r = red_f[0];
    workgroupBarrier();
    return r;
}

fn workgroup_max(t: u32, v: f32) -> f32 {
    red_f[t] = v;
    workgroupBarrier();
    for (var off = WG / 2u; off > 0u; off = off / 2u) {
        if (t < off) {
            red_f[t] = max(red_f[t], red_f[t + off]);
        }
        workgroupBarrier();
    }
    let r = red_f[0];
    workgroupBarrier();
    return r;
}

fn workgroup_sum_u(t: u32, v: u32) -> u32 {
    red_u[t] = v;
    workgroupBarrier();
    for (var off = WG / 2u; off > 0u; off = off / 2u) {
        if (t < off) {
            red_u[t] += red_u[t + off];
        }
        workgroupBarrier();
    }
    let r = red_u[0];
    workgroupBarrier();
    return r;
}
