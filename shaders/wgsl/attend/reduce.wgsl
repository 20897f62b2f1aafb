// attend_decode, reduce pass: merge the partials of every (buffer, chunk) of a sequence into the
// attention output of each query head, and keep the final (max, sum) for the mass pass.
// One workgroup per (query head, sequence); the partials are split over WG / (d / 4) slices of
// invocations so long sequences (hundreds of chunks) merge in parallel.

//!import attend/common.wgsl
//!import attend/softmax.wgsl
//!import common/reduce.wgsl

@group(0) @binding(0) var<uniform> params: AttendParams;
@group(0) @binding(1) var<uniform> dims: vec4<u32>;  // x: head_dim
@group(0) @binding(2) var<storage, read> partials: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read_write> stats: array<vec2<f32>>;

const WG: u32 = 256u;
var<workgroup> red_v: array<vec4<f32>, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let qh = wg.x;
    let seq = wg.y;
    let D4 = dims.x / 4u;
    let stride4 = D4 + 1u;  // header (m, l, 0, 0) then d / 4 vec4 of accumulators
    let n = params.n_buffers * params.n_chunks;
    let base = partial_index(params, seq, qh, 0u, 0u);

    var mx = NEG_BIG;
    for (var r = t; r < n; r += WG) {
        let h = partials[(base + r) * stride4];
        if (h.y > 0.0) {
            mx = max(mx, h.x);
        }
    }
    let big_m = workgroup_max(t, mx);
    var sum = 0.0;
    for (var r = t; r < n; r += WG) {
        let h = partials[(base + r) * stride4];
        if (h.y > 0.0) {
            sum += h.y * softmax_rescale(h.x, big_m);
        }
    }
    let big_l = workgroup_sum(t, sum);

    let slices = WG / D4;
    let slice = t / D4;
    let v = t % D4;
    var a = vec4<f32>(0.0);
    if (slice < slices) {
        for (var r = slice; r < n; r += slices) {
            let o = (base + r) * stride4;
            let h = partials[o];
            if (h.y > 0.0) {
                a += partials[o + 1u + v] * softmax_rescale(h.x, big_m);
            }
        }
    }
    red_v[t] = a;
    workgroupBarrier();
    if (t < D4) {
        var total = vec4<f32>(0.0);
        for (var s = 0u; s < slices; s++) {
            total += red_v[s * D4 + t];
        }
        let inv = select(0.0, 1.0 / big_l, big_l > 0.0);
        let o = (seq * params.q_heads + qh) * dims.x + 4u * t;
        out[o] = total.x * inv;
        out[o + 1u] = total.y * inv;
        out[o + 2u] = total.z * inv;
        out[o + 3u] = total.w * inv;
    }
    if (t == 0u) {
        stats[seq * params.q_heads + qh] = vec2<f32>(big_m, big_l);
    }
}
