// codec, low-rank fit, pass 2: a rank-r orthonormal basis of the top-r eigenspace of each Gram
// matrix (the leading left singular vectors of the calibration window) by subspace iteration:
// Q <- orth(G Q), one dispatch of `iterate` per iteration, from a fixed pseudo-random start
// (`init`), orthonormalised by classical Gram-Schmidt run twice per column; `finish` writes the
// basis. One workgroup per (fit, K/V). The basis is written rounded
// to f16 values (so that encoding is exact, see common/compress.wgsl); LoRA's per-layer fit is
// copied to every head of the layer.

//!import common/pool.wgsl
//!import common/compress.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<storage, read> gram: array<f32>;
@group(0) @binding(2) var<storage, read_write> work: array<f32>;
@group(0) @binding(3) var<storage, read_write> basis: array<f32>;

const WG: u32 = 256u;
var<workgroup> dot_sh: array<f32, 64>;
var<workgroup> red_sh: array<f32, 256>;

fn sync() {
    storageBarrier();
    workgroupBarrier();
}

// A fixed start in [-1, 1) (the CPU reference does not need it: it checks the subspace).
fn start_value(i: u32, j: u32) -> f32 {
    var x = (i * 0x9e3779b9u) ^ ((j + 1u) * 0x85ebca6bu);
    x ^= x >> 16u;
    x *= 0x7feb352du;
    x ^= x >> 15u;
    x *= 0x846ca68bu;
    x ^= x >> 16u;
    return f32(x >> 8u) / 8388608.0 - 1.0;
}

// Orthonormalise the R columns (length D, column j at base + j * D) in place.
fn orthonormalise(t: u32, base: u32, D: u32, R: u32) {
    for (var j = 0u; j < R; j++) {
        for (var pass_ = 0u; pass_ < 2u; pass_++) {
            for (var k = t; k < j; k += WG) {
                var d = 0.0;
                for (var i = 0u; i < D; i++) {
                    d += work[base + k * D + i] * work[base + j * D + i];
                }
                dot_sh[k] = d;
            }
            sync();
            for (var i = t; i < D; i += WG) {
                var v = work[base + j * D + i];
                for (var k = 0u; k < j; k++) {
                    v -= dot_sh[k] * work[base + k * D + i];
                }
                work[base + j * D + i] = v;
            }
            sync();
        }
        var ss = 0.0;
        for (var i = t; i < D; i += WG) {
            let v = work[base + j * D + i];
            ss += v * v;
        }
        red_sh[t] = ss;
        workgroupBarrier();
        for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
            if (t < stride) {
                red_sh[t] += red_sh[t + stride];
            }
            workgroupBarrier();
        }
        let norm = sqrt(red_sh[0]);
        workgroupBarrier();
        for (var i = t; i < D; i += WG) {
            // A column with nothing left (rank-deficient window) stays zero.
            work[base + j * D + i] = select(0.0, work[base + j * D + i] / norm, norm > 1e-30);
        }
        sync();
    }
}

// Q (first D x R block of the fit's work area) <- orthonormalised fixed start.
@compute @workgroup_size(256)
fn init(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let D = geo.head_dim;
    let R = geo.codec_param;
    let w0 = (wg.x * 2u + wg.y) * 2u * D * R;
    for (var e = t; e < D * R; e += WG) {
        work[w0 + e] = start_value(e % D, e / D);
    }
    sync();
    orthonormalise(t, w0, D, R);
}

// One subspace iteration: Z <- G Q, orthonormalise Z, Q <- Z. One dispatch per iteration keeps
// every dispatch short (GPU watchdogs, browsers).
@compute @workgroup_size(256)
fn iterate(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let D = geo.head_dim;
    let R = geo.codec_param;
    let g0 = (wg.x * 2u + wg.y) * D * D;
    let q0 = (wg.x * 2u + wg.y) * 2u * D * R;
    let z0 = q0 + D * R;
    for (var e = t; e < D * R; e += WG) {
        let i = e % D;
        let j = e / D;
        var z = 0.0;
        for (var l = 0u; l < D; l++) {
            z += gram[g0 + i * D + l] * work[q0 + j * D + l];
        }
        work[z0 + e] = z;
    }
    sync();
    orthonormalise(t, z0, D, R);
    for (var e = t; e < D * R; e += WG) {
        work[q0 + e] = work[z0 + e];
    }
}

// The basis rows, rounded to f16 values (LoRA's per-layer fit is stored once per layer).
@compute @workgroup_size(256)
fn finish(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let D = geo.head_dim;
    let R = geo.codec_param;
    let fit = wg.x;
    let kv = wg.y;
    let q0 = (fit * 2u + kv) * 2u * D * R;
    let lora = geo.codec == CODEC_LORA;
    let heads_fit = select(geo.kv_heads, 1u, lora);
    let b0 = basis_off(geo, fit / heads_fit, fit % heads_fit, kv);
    for (var e = t; e < D * R; e += WG) {
        basis[b0 + e] = f16_value(f16_bits_rne(work[q0 + e]));
    }
}
