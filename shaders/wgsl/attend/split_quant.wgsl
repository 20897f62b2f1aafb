// attend_decode, split pass over KIVI int8 / int4 pages, fast variant (subgroups; the layout of
// split_subgroup.wgsl): LANES invocations share one token, each holding WPL words of its key and
// value code rows (coalesced), and combine partial dot products with subgroup shuffles. Each
// token group works page by page: it folds the page's per-channel key parameters once into
// q * scale and a bias q . min (so a key's score is bias + (q * scale) . code, no per-element
// dequantisation; at int4 q * scale is quantised to int8 and the dot product is dot4I8Packed on
// packed bytes, CPU reference `reference::attend_decode_int8_query`), then runs U slots in
// flight. Values dequantise per token group (min + code * scale) straight into the
// accumulators. Nothing is decompressed to memory. Partials go to the last "buffer" index, as
// in split_codec.wgsl (which is the portable fallback).

//!import common/pool.wgsl
//!import attend/common.wgsl
//!import common/compress.wgsl
//!import attend/chunk.wgsl
//!import attend/merge.wgsl
//!import attend/lanes.wgsl

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
//!define U 4u
//!define PF 16u
//!define VP_PER_WORD true
//!define TRANSPOSE true
// GROUP: query heads per KV head. LANES: invocations per token. BITS: 8 or 4. HEAD_DIM: d
// (a multiple of LANES * 32 / BITS). PAGE_SIZE: slots per page (a multiple of U). U: slots in
// flight per token group. PF: slots whose code words are loaded together (a multiple of U
// dividing PAGE_SIZE). VP_PER_WORD: the value groups are a multiple of a code word's dimensions,
// so one parameter word serves a code word. TRANSPOSE: as in split_subgroup.wgsl.

const WG: u32 = 128u;
const CPW: u32 = 32u / BITS;                  // codes per u32 word
const WPL: u32 = HEAD_DIM / (CPW * LANES);    // code words per lane per row
const VPW: u32 = CPW / 4u;                    // vec4 of dimensions per code word
const NV: u32 = WPL * VPW;                    // vec4 of dimensions per lane per row
const CODE_MASK: u32 = (1u << BITS) - 1u;
const NVP: u32 = select(NV, WPL, VP_PER_WORD);  // value parameter words per lane per slot
const MAX_CHUNK_PAGES: u32 = 64u;

var<workgroup> chunk_page: array<u32, 64>;
var<workgroup> chunk_fill: array<u32, 64>;
var<workgroup> live_sh: u32;

// First dimension of vec4 n (0..NV) of this lane's slice of a row.
fn dim_of(lane: u32, n: u32) -> u32 {
    return CPW * (lane + (n / VPW) * LANES) + 4u * (n % VPW);
}

fn dim4_of(lane: u32, n: u32) -> u32 {
    return dim_of(lane, n) / 4u;
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

@compute @workgroup_size(128)
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
    let D4 = HEAD_DIM / 4u;
    let lane = sg_lane % LANES;
    let group_base = sg_lane - lane;
    let tg = sg_id * (sg_size / LANES) + sg_lane / LANES;
    let n_tg = WG / LANES;
    let my_head = head_of_lane(lane);
    let buffer = params.n_buffers - 1u;

    let ch = chunk_of(t, seq, kvh, chunk);
    let first = ch.first;
    if (first >= ch.n_pages) {
        write_chunk_empty(t, GROUP, seq, kvh, buffer, chunk, HEAD_DIM);
        return;
    }
    for (var c = t; c < params.chunk_pages; c += WG) {
        var page = 0u;
        var fill = 0u;
        if (first + c < ch.n_pages) {
            page = page_list[ch.list + first + c];
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
        write_chunk_empty(t, GROUP, seq, kvh, buffer, chunk, HEAD_DIM);
        return;
    }

    // The scaled queries of this KV head's GROUP heads, in workgroup memory (acc_sh, which the
    // merge reuses after a barrier): each token group reads its lanes' slice once per page to
    // fold in the page's key scales, so the queries hold no registers through the page loop.
    let q0 = (seq * params.q_heads + kvh * GROUP) * HEAD_DIM;
    for (var e = t; e < GROUP * D4; e += WG) {
        let d = q0 + 4u * e;
        acc_sh[e] = vec4<f32>(queries[d], queries[d + 1u], queries[d + 2u], queries[d + 3u]) * params.scale;
    }
    workgroupBarrier();
    var acc: array<vec4<f32>, GROUP * NV>;
    var m: array<f32, HEADS_KEPT>;
    var l: array<f32, HEADS_KEPT>;
    for (var g = 0u; g < HEADS_KEPT; g++) {
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
    let rounds = (params.chunk_pages + n_tg - 1u) / n_tg;
    for (var r = 0u; r < rounds; r++) {
        let c = tg + r * n_tg;
        let cc = min(c, MAX_CHUNK_PAGES - 1u);
        var fill = 0u;
        if (c < params.chunk_pages) {
            fill = chunk_fill[cc];
        }
        let cbase = (chunk_page[cc] - geo.n_pages) * geo.codec_page_words;
        // Issue the page's key parameters for this lane's channels, then each block's code
        // words, before anything waits on them: one memory round trip per block of PF slots
        // instead of one per U slots.
        var kp: array<vec4<u32>, NV>;
        for (var n = 0u; n < NV; n++) {
            kp[n] = vec4<u32>(0u);
            if (fill > 0u) {
                let p0 = cbase + dim_of(lane, n);
                kp[n] = vec4<u32>(codec_kv[p0], codec_kv[p0 + 1u], codec_kv[p0 + 2u], codec_kv[p0 + 3u]);
            }
        }
        var qs: array<vec4<f32>, GROUP * NV>;  // int8: q * scale
        var q8: array<u32, GROUP * NV>;        // int4: q * scale / alpha, packed bytes
        var alpha: array<f32, GROUP>;
        var bias: array<f32, GROUP>;
        for (var blk = 0u; blk < PAGE_SIZE / PF; blk++) {
            var kw: array<u32, PF * WPL>;
            var vw: array<u32, PF * WPL>;
            var vprm: array<u32, PF * NVP>;
            for (var u = 0u; u < PF; u++) {
                let s = blk * PF + u;
                for (var i = 0u; i < WPL; i++) {
                    kw[u * WPL + i] = 0u;
                    vw[u * WPL + i] = 0u;
                }
                for (var n = 0u; n < NVP; n++) {
                    vprm[u * NVP + n] = 0u;
                }
                if (s < fill) {
                    for (var i = 0u; i < WPL; i++) {
                        kw[u * WPL + i] = codec_kv[cbase + kc_off + s * rw + lane + i * LANES];
                        vw[u * WPL + i] = codec_kv[cbase + vc_off + s * rw + lane + i * LANES];
                    }
                    for (var n = 0u; n < NVP; n++) {
                        vprm[u * NVP + n] = codec_kv[cbase + vp_off + s * vgroups + vgi[n]];
                    }
                }
            }
            if (blk == 0u) {
                // The key parameters folded in once per page: q * scale and the bias q . min,
                // so a key's score is bias + (q * scale) . code with no per-element
                // dequantisation. At int4, q * scale is then quantised to int8 (q8) and the score
                // is alpha * q8 . (code - 8) + bias + 8 (q * scale) . 1: integer dot products of
                // packed bytes. alpha = 2^(E - 6), E the exponent of the page's largest
                // |q * scale| over every channel (at least -120), so every value lies in
                // (-128, 128); at most 127, rounded to nearest even (`round`), then 1.5 * 2^23
                // added exactly so that the sum's low byte is the code. Centring the codes halves the rounding's effect
                // on the score. The bias and the dot products are split over the lanes like the
                // score.
                // (Folded into a local first: at int4 nothing of it outlives the fold.)
                var qsl: array<vec4<f32>, GROUP * NV>;
                var mx: array<f32, GROUP>;
                for (var g = 0u; g < GROUP; g++) {
                    bias[g] = 0.0;
                    mx[g] = 0.0;
                }
                for (var n = 0u; n < NV; n++) {
                    let w = kp[n];
                    let mins = vec4<f32>(f16_value(w.x), f16_value(w.y), f16_value(w.z), f16_value(w.w));
                    let scales = vec4<f32>(f16_value(w.x >> 16u), f16_value(w.y >> 16u), f16_value(w.z >> 16u), f16_value(w.w >> 16u));
                    for (var g = 0u; g < GROUP; g++) {
                        let qv = acc_sh[g * D4 + dim_of(lane, n) / 4u];
                        qsl[g * NV + n] = qv * scales;
                        bias[g] += dot(qv, mins);
                        let a = abs(qsl[g * NV + n]);
                        mx[g] = max(mx[g], max(max(a.x, a.y), max(a.z, a.w)));
                    }
                }
                if (BITS == 8u) {
                    qs = qsl;
                } else {
                    for (var g = 0u; g < GROUP; g++) {
                        var mg = mx[g];
                        for (var mask = LANES / 2u; mask > 0u; mask = mask / 2u) {
                            mg = max(mg, subgroupShuffleXor(mg, mask));
                        }
                        let ex = max(i32((bitcast<u32>(mg) >> 23u) & 0xffu) - 127, -120);
                        let step = pow2(6 - ex);
                        alpha[g] = pow2(ex - 6);
                        var qsum = 0;
                        var fsum = 0.0;
                        for (var n = 0u; n < NV; n++) {
                            q8[g * NV + n] = 0u;
                        }
                        for (var n = 0u; n < NV; n++) {
                            let x = bitcast<vec4<u32>>(round(min(qsl[g * NV + n] * step, vec4<f32>(127.0))) + vec4<f32>(12582912.0));
                            let b = x & vec4<u32>(0xffu);
                            // A code word's even dimensions (its low nibbles), then its odd ones.
                            let sh = (n % 2u) * 16u;
                            q8[g * NV + n - n % 2u] |= (b.x | (b.z << 8u)) << sh;
                            q8[g * NV + n - n % 2u + 1u] |= (b.y | (b.w << 8u)) << sh;
                            let v = bitcast<vec4<i32>>(x - vec4<u32>(0x4b400000u));
                            qsum += v.x + v.y + v.z + v.w;
                            fsum += dot(qsl[g * NV + n], vec4<f32>(1.0));
                        }
                        bias[g] += 8.0 * (fsum - alpha[g] * f32(qsum));
                    }
                }
            }
            for (var sb = 0u; sb < PF / U; sb++) {
                var valid: array<bool, U>;
                var slot_of: array<u32, U>;
                for (var u = 0u; u < U; u++) {
                    let s = blk * PF + sb * U + u;
                    valid[u] = s < fill;
                    slot_of[u] = c * PAGE_SIZE + s;
                }
                var part: array<f32, U * GROUP>;
                for (var u = 0u; u < U; u++) {
                    for (var g = 0u; g < GROUP; g++) {
                        var x = 0.0;
                        if (BITS == 4u) {
                            var isum = 0;
                            for (var i = 0u; i < WPL; i++) {
                                let w = kw[(sb * U + u) * WPL + i];
                                isum += dot4I8Packed(q8[g * NV + 2u * i], w & 0x0f0f0f0fu) + dot4I8Packed(q8[g * NV + 2u * i + 1u], (w >> 4u) & 0x0f0f0f0fu);
                            }
                            // The integer as a float by the same 1.5 * 2^23 (|isum| < 2^22).
                            x = alpha[g] * (bitcast<f32>(u32(isum) + 0x4b400000u) - 12582912.0);
                        } else {
                            for (var n = 0u; n < NV; n++) {
                                x += dot(qs[g * NV + n], codes4(kw[(sb * U + u) * WPL + n / VPW], n % VPW));
                            }
                        }
                        part[u * GROUP + g] = x + bias[g];
                    }
                }
                let x = lane_scores(part, lane);
                if (params.write_scores != 0u && writes_kept(lane)) {
                    for (var u = 0u; u < U; u++) {
                        for (var k = 0u; k < HEADS_KEPT; k++) {
                            if (valid[u]) {
                                scores[(seq * params.q_heads + kvh * GROUP + select(k, my_head, TRANSPOSE)) * params.max_tokens + first * PAGE_SIZE + slot_of[u]] = x[u * HEADS_KEPT + k];
                            }
                        }
                    }
                }
                let st = lane_softmax(m, l, x, valid, group_base);
                m = st.m;
                l = st.l;
                // Values: min + code * scale per token group of dimensions, shared by the heads.
                var vdec: array<vec4<f32>, U * NV>;
                for (var u = 0u; u < U; u++) {
                    for (var n = 0u; n < NV; n++) {
                        let prm = vprm[(sb * U + u) * NVP + select(n, n / VPW, VP_PER_WORD)];
                        vdec[u * NV + n] = f16_value(prm) + codes4(vw[(sb * U + u) * WPL + n / VPW], n % VPW) * f16_value(prm >> 16u);
                    }
                }
                for (var g = 0u; g < GROUP; g++) {
                    for (var n = 0u; n < NV; n++) {
                        var a = acc[g * NV + n] * st.corr[g];
                        for (var u = 0u; u < U; u++) {
                            a += st.p[u * GROUP + g] * vdec[u * NV + n];
                        }
                        acc[g * NV + n] = a;
                    }
                }
            }
        }
    }

    merge_token_groups(t, lane, tg, m, l, acc, seq, kvh, buffer, chunk, HEAD_DIM);
}
