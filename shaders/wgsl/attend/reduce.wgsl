// attend_decode, reduce pass: merge the partials of every (buffer, chunk) of a sequence into the
// attention output of each query head, and keep the final (max, sum) for the mass pass.
// One workgroup per (query head, sequence).

//!import attend/common.wgsl

@group(0) @binding(0) var<uniform> params: AttendParams;
@group(0) @binding(1) var<uniform> dims: vec4<u32>;  // x: head_dim
@group(0) @binding(2) var<storage, read> partials: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read_write> stats: array<vec2<f32>>;

const WG: u32 = 64u;
var<workgroup> red: array<f32, 64>;

fn workgroup_max(t: u32, v: f32) -> f32 {
    red[t] = v;
    workgroupBarrier();
    for (var off = WG / 2u; off > 0u; off = off / 2u) {
        if (t < off) {
            red[t] = max(red[t], red[t + off]);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

fn workgroup_sum(t: u32, v: f32) -> f32 {
    red[t] = v;
    workgroupBarrier();
    for (var off = WG / 2u; off > 0u; off = off / 2u) {
        if (t < off) {
            red[t] = red[t] + red[t + off];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let qh = wg.x;
    let seq = wg.y;
    let D = dims.x;
    let stride = partial_stride(D);
    let n = params.n_buffers * params.n_chunks;
    let base = partial_index(params, seq, qh, 0u, 0u);

    var mx = NEG_BIG;
    for (var r = t; r < n; r += WG) {
        let o = (base + r) * stride;
        if (partials[o + 1u] > 0.0) {
            mx = max(mx, partials[o]);
        }
    }
    let big_m = workgroup_max(t, mx);
    var sum = 0.0;
    for (var r = t; r < n; r += WG) {
        let o = (base + r) * stride;
        let l = partials[o + 1u];
        if (l > 0.0) {
            sum += l * exp(partials[o] - big_m);
        }
    }
    let big_l = workgroup_sum(t, sum);
    let inv = select(0.0, 1.0 / big_l, big_l > 0.0);
    for (var d = t; d < D; d += WG) {
        var a = 0.0;
        for (var r = 0u; r < n; r++) {
            let o = (base + r) * stride;
            let l = partials[o + 1u];
            if (l > 0.0) {
                a += partials[o + 4u + d] * exp(partials[o] - big_m);
            }
        }
        out[(seq * params.q_heads + qh) * D + d] = a * inv;
    }
    if (t == 0u) {
        stats[seq * params.q_heads + qh] = vec2<f32>(big_m, big_l);
    }
}
