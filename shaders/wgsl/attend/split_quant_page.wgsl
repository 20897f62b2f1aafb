// attend_decode, split pass over KIVI int8 / int4 pages, a page at a time (the default fast
// variant; split_quant.wgsl works a block of slots at a time and is kept for comparison). Each
// token group of LANES invocations takes one compressed page per round, in three phases:
//   0. the page's per-channel key parameters, read once, fold into the scaled queries:
//      qs = q * scale (to workgroup memory, per token group) and bias = q . min (shuffles);
//   1. lane = slot: each lane scores its PAGE_SIZE / LANES whole key rows against every query
//      head (score = bias + qs . code; no per-element dequantisation, no cross-lane sums), then
//      one max per page over the lanes, the page's probabilities and one rescale of the
//      running sums;
//   2. lane = dimensions: the values, dequantised per token group (min + code * scale), are
//      accumulated with each slot's probabilities, taken from their lane by shuffle.
// Against the slot-block kernel this drops the per-slot cross-lane reductions and the per-slot
// rescaling, and keeps a page's loads in flight together. Nothing is decompressed to memory.
// Partials go to the last "buffer" index, as in split_codec.wgsl (the portable fallback).

//!import common/pool.wgsl
//!import attend/common.wgsl
//!import common/codec.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: AttendParams;
@group(0) @binding(2) var<storage, read> page_list: array<u32>;
@group(0) @binding(3) var<storage, read> page_counts: array<u32>;
@group(0) @binding(4) var<storage, read> page_meta: array<PageMeta>;
@group(0) @binding(5) var<storage, read> codec_kv: array<u32>;
@group(0) @binding(6) var<storage, read> queries: array<f32>;
@group(0) @binding(7) var<storage, read_write> partials: array<f32>;
@group(0) @binding(8) var<storage, read_write> scores: array<f32>;

//!define GROUP 4u
//!define LANES 16u
//!define BITS 4u
//!define HEAD_DIM 128u
//!define PAGE_SIZE 16u
//!define VP_PER_WORD true
//!define WG 128u
//!define V_PREFETCH 16u
// GROUP: query heads per KV head. LANES: invocations per token group (a multiple of nothing
// but a divisor of PAGE_SIZE). BITS: 8 or 4. HEAD_DIM: d (a multiple of LANES * 32 / BITS).
// VP_PER_WORD: the value groups are a multiple of a code word's dimensions, so one parameter word
// serves a code word. WG: invocations per workgroup (128, or 64 where the scaled queries of 128
// would not fit the device's workgroup memory). V_PREFETCH: slots whose value words are loaded
// with the keys, before phase 1 (PAGE_SIZE: all; fewer holds fewer registers, the rest are loaded
// in phase 2 a slot ahead of their use).

const CPW: u32 = 32u / BITS;                  // codes per u32 word
const KW: u32 = HEAD_DIM / CPW;               // code words per row
const WPL: u32 = KW / LANES;                  // value code words per lane per row (phase 2)
const VPW: u32 = CPW / 4u;                    // vec4 of dimensions per code word
const NV: u32 = WPL * VPW;                    // vec4 of dimensions per lane per row
const CODE_MASK: u32 = (1u << BITS) - 1u;
const NVP: u32 = select(NV, WPL, VP_PER_WORD);  // value parameter words per lane per slot
const SPL: u32 = PAGE_SIZE / LANES;           // slots per lane (phase 1)
const D4: u32 = HEAD_DIM / 4u;
const N_TG: u32 = WG / LANES;

var<workgroup> chunk_page: array<u32, 64>;
var<workgroup> chunk_fill: array<u32, 64>;
var<workgroup> ml_sh: array<vec2<f32>, 256>;
var<workgroup> acc_sh: array<vec4<f32>, GROUP * D4>;  // the scaled queries first, the merge at the end
var<workgroup> qs_sh: array<vec4<f32>, N_TG * GROUP * D4>;  // per token group: q * the page's key scales
var<workgroup> count_sh: u32;
var<workgroup> live_sh: u32;

// First dimension of vec4 n (0..NV) of this lane's slice of a row.
fn dim_of(lane: u32, n: u32) -> u32 {
    return CPW * (lane + (n / VPW) * LANES) + 4u * (n % VPW);
}

// The code at bit p of a code word, as a float, without an integer-to-float conversion (a
// quarter-rate instruction on common GPUs): the code's bits are masked in place into the
// mantissa of a float whose exponent makes their lowest bit weigh 1, i.e. 2^(23 - s) + code,
// and the power of two is subtracted, exactly. Bits 16 and up are taken from the word's upper
// half so every code sits below the exponent field. Same value as f32((w >> p) & CODE_MASK).
fn code_float(w: u32, p: u32) -> f32 {
    let x = select(w, w >> 16u, p >= 16u);
    let s = p & 15u;
    let e = (150u - s) << 23u;
    return bitcast<f32>((x & (CODE_MASK << s)) | e) - bitcast<f32>(e);
}

// Codes of dimensions 4 sub .. 4 sub + 3 of a code word, as floats.
fn codes4(w: u32, sub: u32) -> vec4<f32> {
    let sh = sub * 4u * BITS;
    return vec4<f32>(code_float(w, sh), code_float(w, sh + BITS), code_float(w, sh + 2u * BITS), code_float(w, sh + 3u * BITS));
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) t: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_id) sg_id: u32,
) {
    let chunk = wg.x;
    let kvh = wg.y;
    let seq = wg.z;
    let lane = sg_lane % LANES;
    let group_base = sg_lane - lane;
    let tg = sg_id * (sg_size / LANES) + sg_lane / LANES;
    let buffer = params.n_buffers - 1u;

    if (t == 0u) {
        count_sh = page_counts[list_index(geo, params.layer, seq, kvh)];
    }
    let n_pages = workgroupUniformLoad(&count_sh);
    let first = chunk * params.chunk_pages;
    if (first >= n_pages) {
        if (t < GROUP) {
            let o = partial_index(params, seq, kvh * GROUP + t, buffer, chunk) * partial_stride(HEAD_DIM);
            partials[o] = NEG_BIG;
            partials[o + 1u] = 0.0;
        }
        return;
    }
    let list = list_index(geo, params.layer, seq, kvh) * geo.max_pages_per_seq;
    for (var c = t; c < params.chunk_pages; c += WG) {
        var page = 0u;
        var fill = 0u;
        if (first + c < n_pages) {
            page = page_list[list + first + c];
            if (page >= geo.n_pages) {
                fill = page_meta[page].fill;
            }
        }
        chunk_page[c] = page;
        chunk_fill[c] = fill;
    }
    workgroupBarrier();
    // A chunk with none of this kernel's pages (they live in another buffer, or compressed)
    // leaves an empty partial and costs nothing more.
    if (t == 0u) {
        var live = 0u;
        for (var c = 0u; c < params.chunk_pages; c++) {
            live |= chunk_fill[c];
        }
        live_sh = live;
    }
    if (workgroupUniformLoad(&live_sh) == 0u) {
        if (t < GROUP) {
            let o = partial_index(params, seq, kvh * GROUP + t, buffer, chunk) * partial_stride(HEAD_DIM);
            partials[o] = NEG_BIG;
            partials[o + 1u] = 0.0;
        }
        return;
    }

    // The scaled queries of this KV head's GROUP heads, in workgroup memory.
    let q0 = (seq * params.q_heads + kvh * GROUP) * HEAD_DIM;
    for (var e = t; e < GROUP * D4; e += WG) {
        let d = q0 + 4u * e;
        acc_sh[e] = vec4<f32>(queries[d], queries[d + 1u], queries[d + 2u], queries[d + 3u]) * params.scale;
    }
    workgroupBarrier();
    var acc: array<vec4<f32>, GROUP * NV>;
    var m: array<f32, GROUP>;
    var l: array<f32, GROUP>;  // this lane's share of the running sum (phase 1's slots)
    for (var g = 0u; g < GROUP; g++) {
        m[g] = NEG_BIG;
        l[g] = 0.0;
    }
    for (var i = 0u; i < GROUP * NV; i++) {
        acc[i] = vec4<f32>(0.0);
    }

    let rw = code_row_words(geo);
    let kc_off = k_codes_off(geo);
    let vp_off = v_params_off(geo);
    let vc_off = v_codes_off(geo);
    let vgroups = HEAD_DIM / geo.v_group;
    var vgi: array<u32, NVP>;  // value parameter word of each of this lane's parameter slots
    for (var n = 0u; n < NVP; n++) {
        vgi[n] = dim_of(lane, select(n, n * VPW, VP_PER_WORD)) / geo.v_group;
    }
    let qs_base = tg * GROUP * D4;
    let rounds = (params.chunk_pages + N_TG - 1u) / N_TG;
    for (var r = 0u; r < rounds; r++) {
        let c = tg + r * N_TG;
        let cc = min(c, 63u);
        var fill = 0u;
        if (c < params.chunk_pages) {
            fill = chunk_fill[cc];
        }
        let cbase = (chunk_page[cc] - geo.n_pages) * geo.codec_page_words;
        // Issue every load of the page before anything waits on one: the key parameters of this
        // lane's channels, its slots' key rows, and its dimensions' value codes and parameters.
        var kp: array<vec4<u32>, NV>;
        for (var n = 0u; n < NV; n++) {
            kp[n] = vec4<u32>(0u);
            if (fill > 0u) {
                let p0 = cbase + dim_of(lane, n);
                kp[n] = vec4<u32>(codec_kv[p0], codec_kv[p0 + 1u], codec_kv[p0 + 2u], codec_kv[p0 + 3u]);
            }
        }
        var krow: array<u32, SPL * KW>;
        for (var ss = 0u; ss < SPL; ss++) {
            let s = lane + ss * LANES;
            for (var w = 0u; w < KW; w++) {
                krow[ss * KW + w] = 0u;
                if (s < fill) {
                    krow[ss * KW + w] = codec_kv[cbase + kc_off + s * rw + w];
                }
            }
        }
        var vw: array<u32, V_PREFETCH * WPL>;
        var vprm: array<u32, V_PREFETCH * NVP>;
        for (var s = 0u; s < V_PREFETCH; s++) {
            for (var i = 0u; i < WPL; i++) {
                vw[s * WPL + i] = 0u;
                if (s < fill) {
                    vw[s * WPL + i] = codec_kv[cbase + vc_off + s * rw + lane + i * LANES];
                }
            }
            for (var n = 0u; n < NVP; n++) {
                vprm[s * NVP + n] = 0u;
                if (s < fill) {
                    vprm[s * NVP + n] = codec_kv[cbase + vp_off + s * vgroups + vgi[n]];
                }
            }
        }
        // Phase 0: qs = q * scale for this page, and bias = q . min summed over the lanes.
        var bias: array<f32, GROUP>;
        for (var g = 0u; g < GROUP; g++) {
            bias[g] = 0.0;
        }
        for (var n = 0u; n < NV; n++) {
            let w = kp[n];
            let mins = vec4<f32>(f16_value(w.x), f16_value(w.y), f16_value(w.z), f16_value(w.w));
            let scales = vec4<f32>(f16_value(w.x >> 16u), f16_value(w.y >> 16u), f16_value(w.z >> 16u), f16_value(w.w >> 16u));
            let d4 = dim_of(lane, n) / 4u;
            for (var g = 0u; g < GROUP; g++) {
                let qv = acc_sh[g * D4 + d4];
                qs_sh[qs_base + g * D4 + d4] = qv * scales;
                bias[g] += dot(qv, mins);
            }
        }
        for (var g = 0u; g < GROUP; g++) {
            for (var mask = LANES / 2u; mask > 0u; mask = mask / 2u) {
                bias[g] += subgroupShuffleXor(bias[g], mask);
            }
        }
        workgroupBarrier();
        // Phase 1: lane = slot. Each code is decoded once for all heads.
        var sc: array<f32, SPL * GROUP>;
        var m_page: array<f32, GROUP>;
        for (var g = 0u; g < GROUP; g++) {
            m_page[g] = NEG_BIG;
        }
        for (var ss = 0u; ss < SPL; ss++) {
            var x: array<f32, GROUP>;
            for (var g = 0u; g < GROUP; g++) {
                x[g] = bias[g];
            }
            for (var w = 0u; w < KW; w++) {
                for (var sub = 0u; sub < VPW; sub++) {
                    let code = codes4(krow[ss * KW + w], sub);
                    for (var g = 0u; g < GROUP; g++) {
                        x[g] += dot(qs_sh[qs_base + g * D4 + w * VPW + sub], code);
                    }
                }
            }
            let s = lane + ss * LANES;
            let valid = s < fill;
            for (var g = 0u; g < GROUP; g++) {
                sc[ss * GROUP + g] = select(NEG_BIG, x[g], valid);
                m_page[g] = max(m_page[g], sc[ss * GROUP + g]);
                if (valid && params.write_scores != 0u) {
                    scores[(seq * params.q_heads + kvh * GROUP + g) * params.max_tokens + (first + c) * PAGE_SIZE + s] = x[g];
                }
            }
        }
        var corr: array<f32, GROUP>;
        var p: array<f32, SPL * GROUP>;
        for (var g = 0u; g < GROUP; g++) {
            var mx = m_page[g];
            for (var mask = LANES / 2u; mask > 0u; mask = mask / 2u) {
                mx = max(mx, subgroupShuffleXor(mx, mask));
            }
            let m_new = max(m[g], mx);
            corr[g] = exp(m[g] - m_new);
            var lsum = l[g] * corr[g];
            for (var ss = 0u; ss < SPL; ss++) {
                let s = lane + ss * LANES;
                p[ss * GROUP + g] = select(0.0, exp(sc[ss * GROUP + g] - m_new), s < fill);
                lsum += p[ss * GROUP + g];
            }
            m[g] = m_new;
            l[g] = lsum;
        }
        // Phase 2: lane = dimensions; slot s's probabilities come from lane s % LANES.
        for (var i = 0u; i < GROUP * NV; i++) {
            acc[i] *= corr[i / NV];
        }
        for (var s = 0u; s < PAGE_SIZE; s++) {
            var pv: array<f32, GROUP>;
            for (var g = 0u; g < GROUP; g++) {
                pv[g] = subgroupShuffle(p[(s / LANES) * GROUP + g], group_base + s % LANES);
            }
            var cw: array<u32, WPL>;
            var cp: array<u32, NVP>;
            if (s < V_PREFETCH) {
                for (var i = 0u; i < WPL; i++) {
                    cw[i] = vw[min(s, V_PREFETCH - 1u) * WPL + i];
                }
                for (var n = 0u; n < NVP; n++) {
                    cp[n] = vprm[min(s, V_PREFETCH - 1u) * NVP + n];
                }
            } else {
                for (var i = 0u; i < WPL; i++) {
                    cw[i] = select(0u, codec_kv[cbase + vc_off + s * rw + lane + i * LANES], s < fill);
                }
                for (var n = 0u; n < NVP; n++) {
                    cp[n] = select(0u, codec_kv[cbase + vp_off + s * vgroups + vgi[n]], s < fill);
                }
            }
            for (var n = 0u; n < NV; n++) {
                let prm = cp[select(n, n / VPW, VP_PER_WORD)];
                let v = f16_value(prm) + codes4(cw[n / VPW], n % VPW) * f16_value(prm >> 16u);
                for (var g = 0u; g < GROUP; g++) {
                    acc[g * NV + n] += pv[g] * v;
                }
            }
        }
        // qs_sh is rewritten by the next round.
        workgroupBarrier();
    }

    // The lanes' shares of each running sum, then merge the token groups of this workgroup.
    for (var g = 0u; g < GROUP; g++) {
        for (var mask = LANES / 2u; mask > 0u; mask = mask / 2u) {
            l[g] += subgroupShuffleXor(l[g], mask);
        }
    }
    if (lane == 0u) {
        for (var g = 0u; g < GROUP; g++) {
            ml_sh[tg * GROUP + g] = vec2<f32>(m[g], l[g]);
        }
    }
    workgroupBarrier();
    var big_m: array<f32, GROUP>;
    var big_l: array<f32, GROUP>;
    for (var g = 0u; g < GROUP; g++) {
        var mm = NEG_BIG;
        for (var r = 0u; r < N_TG; r++) {
            mm = max(mm, ml_sh[r * GROUP + g].x);
        }
        var ll = 0.0;
        for (var r = 0u; r < N_TG; r++) {
            let e = ml_sh[r * GROUP + g];
            ll += e.y * exp(e.x - mm);
        }
        big_m[g] = mm;
        big_l[g] = ll;
    }
    for (var r = 0u; r < N_TG; r++) {
        if (tg == r) {
            for (var g = 0u; g < GROUP; g++) {
                let f = exp(ml_sh[tg * GROUP + g].x - big_m[g]);
                for (var n = 0u; n < NV; n++) {
                    let a = g * D4 + dim_of(lane, n) / 4u;
                    var prev = vec4<f32>(0.0);
                    if (r > 0u) {
                        prev = acc_sh[a];
                    }
                    acc_sh[a] = prev + acc[g * NV + n] * f;
                }
            }
        }
        workgroupBarrier();
    }
    let stride = partial_stride(HEAD_DIM);
    for (var e = t; e < GROUP * D4; e += WG) {
        let g = e / D4;
        let o = partial_index(params, seq, kvh * GROUP + g, buffer, chunk) * stride + 4u + 4u * (e % D4);
        let a = acc_sh[e];
        partials[o] = a.x;
        partials[o + 1u] = a.y;
        partials[o + 2u] = a.z;
        partials[o + 3u] = a.w;
    }
    if (t < GROUP) {
        let o = partial_index(params, seq, kvh * GROUP + t, buffer, chunk) * stride;
        partials[o] = big_m[t];
        partials[o + 1u] = big_l[t];
        partials[o + 2u] = 0.0;
        partials[o + 3u] = 0.0;
    }
}
