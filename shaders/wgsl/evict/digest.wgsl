// evict, capture into the recall tier, third pass: each list's newly captured tier slots get their
// key digest (common/recall.wgsl), the one-bit sketch the recall pass scores every tier token by
// in device memory, so that only the pages it recalls cross the bus. The first time a list's tier
// holds DIGEST_CALIB_TOKENS tokens, it calibrates on all of them (the key sums, then the mean
// absolute deviations) and digests them all again against that centre; it never calibrates
// again. A bit compares k x n with the sum over n tokens (no division), so the CPU reference,
// summing in the same order, sets the same bits. With BOUNDS, every tier page that gained slots
// also gets its key bounds (common/recall.wgsl), which nominate candidates beside the digests.
// One workgroup per page list.

//!import common/pool.wgsl
//!import common/recall.wgsl

override F16: bool = true;
override BOUNDS: bool = false;

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> tier: TierParams;
@group(0) @binding(2) var<storage, read> tier_count: array<u32>;
@group(0) @binding(3) var<storage, read> tier_kv: array<u32>;
@group(0) @binding(4) var<storage, read_write> tier_digested: array<u32>;
@group(0) @binding(5) var<storage, read_write> tier_calib: array<f32>;
@group(0) @binding(6) var<storage, read_write> tier_digest: array<u32>;

const WG: u32 = 256u;
// Key dimensions the pass takes (head_dim at most).
const MAX_D: u32 = 256u;

var<workgroup> sum_sh: array<f32, MAX_D>;
var<workgroup> state_sh: vec2<u32>;

// Dimension `i` of tier slot `at`'s key.
fn key_at(at: u32, i: u32) -> f32 {
    let P = geo.page_size;
    let o = (at / P) * geo.page_words + (at % P) * geo.vec_words;
    if (F16) {
        let k = unpack2x16float(tier_kv[o + i / 2u]);
        return select(k.x, k.y, (i & 1u) == 1u);
    }
    return bitcast<f32>(tier_kv[o + i]);
}

@compute @workgroup_size(256)
fn digest(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let li = wg.x + wg.y * 65535u;
    if (li >= geo.layers * geo.max_seqs * geo.kv_heads) {
        return;
    }
    let d = geo.head_dim;
    let first = li * tier.cap;
    if (t == 0u) {
        state_sh = vec2<u32>(tier_digested[2u * li], tier_digested[2u * li + 1u]);
    }
    let state = workgroupUniformLoad(&state_sh);
    let n = min(tier_count[li], tier.cap);
    var start = state.x;
    var cal = state.y;
    if (cal == 0u && n >= DIGEST_CALIB_TOKENS) {
        cal = n;
        start = 0u;
        if (t < d) {
            var s = 0.0;
            for (var j = 0u; j < n; j++) {
                s += key_at(first + j, t);
            }
            let c = s / f32(n);
            var a = 0.0;
            for (var j = 0u; j < n; j++) {
                a += abs(key_at(first + j, t) - c);
            }
            tier_calib[3u * d * li + t] = c;
            tier_calib[3u * d * li + d + t] = a / f32(n);
            tier_calib[3u * d * li + 2u * d + t] = s;
        }
    }
    if (t < d) {
        sum_sh[t] = tier_calib[3u * d * li + 2u * d + t];
    }
    workgroupBarrier();
    let nf = f32(cal);
    let dw = (d + 31u) / 32u;
    for (var j = start + t; j < n; j += WG) {
        for (var w = 0u; w < dw; w++) {
            var bits = 0u;
            for (var b = 0u; b < min(32u, d - w * 32u); b++) {
                let i = w * 32u + b;
                let k = key_at(first + j, i);
                if (select(k, k * nf, cal > 0u) >= sum_sh[i]) {
                    bits |= 1u << b;
                }
            }
            tier_digest[(first + j) * dw + w] = bits;
        }
    }
    if (BOUNDS) {
        // Pages holding slots not digested before this pass (the first perhaps partly filled
        // before, so bounded again over all its slots).
        let P = geo.page_size;
        for (var pg = state.x / P + t; pg < (n + P - 1u) / P; pg += WG) {
            page_bounds(li, pg, n);
        }
    }
    if (t == 0u) {
        tier_digested[2u * li] = n;
        tier_digested[2u * li + 1u] = cal;
    }
}

// Tier page `pg` of list `li` (its first `n` slots live): its key bounds.
fn page_bounds(li: u32, pg: u32, n: u32) {
    let P = geo.page_size;
    let d = geo.head_dim;
    let first = li * tier.cap;
    let s0 = pg * P;
    let s1 = min(n, s0 + P);
    var m = 0.0;
    for (var s = s0; s < s1; s++) {
        for (var i = 0u; i < d; i++) {
            m = max(m, abs(key_at(first + s, i)));
        }
    }
    let e = bound_exponent(m);
    let inv = pow2(-e);
    let qw = (d + 3u) / 4u;
    let base = tier.bounds_at + (li * (tier.cap / P) + pg) * bound_words(d);
    tier_digest[base] = bitcast<u32>(e);
    for (var w = 0u; w < qw; w++) {
        var lo_w = 0u;
        var hi_w = 0u;
        for (var b = 0u; b < 4u; b++) {
            let i = w * 4u + b;
            if (i < d) {
                var lo = 3.4e38;
                var hi = -3.4e38;
                for (var s = s0; s < s1; s++) {
                    let k = key_at(first + s, i);
                    lo = min(lo, k);
                    hi = max(hi, k);
                }
                lo_w |= (bitcast<u32>(i32(floor(lo * inv))) & 0xffu) << (8u * b);
                hi_w |= (bitcast<u32>(i32(ceil(hi * inv))) & 0xffu) << (8u * b);
            }
        }
        tier_digest[base + 1u + w] = lo_w;
        tier_digest[base + 1u + qw + w] = hi_w;
    }
}
