// attend_decode, split pass over KIVI int8 / int4 pages with integer key scores: a round of WG
// tokens at a time, one token per invocation for the scores and one code word per invocation for
// the values.
//
// Per page, the query of each head is folded with the page's per-channel key scales and
// quantised to int8 with a power-of-two step (alpha = 2^(E - 6), E the exponent of the largest
// |q * scale|, so q8 = round(q * scale / alpha) is exact and in -127..127); a key's score is then
// alpha * sum q8 * code + sum q * min, the sum an integer dot product of packed bytes
// (dot4I8Packed: one instruction per 4 channels where the device has it). The CPU reference of
// this arithmetic is `reference::attend_decode_int8_query`. Values stay f32: min + code * scale
// per token group of dimensions, the min term summed apart. Nothing is decompressed to memory.
// Partials go to the last "buffer" index, as in split_codec.wgsl.

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
// The same words as `codec_kv`, four at a time (key rows start on a multiple of 4 words).
@group(0) @binding(9) var<storage, read> codec_kv4: array<vec4<u32>>;

//!define GROUP 4u
//!define BITS 4u
//!define HEAD_DIM 128u
//!define PAGE_SIZE 16u
//!define WG 128u
//!define ABLATE 0u
// GROUP: query heads per KV head (1..4). BITS: 8 or 4. HEAD_DIM: d, with a code row a multiple
// of 4 words, dividing 128 words. PAGE_SIZE: slots per page, dividing WG.

const CPW: u32 = 32u / BITS;                 // codes per u32 word
const RW: u32 = HEAD_DIM / CPW;              // code words per row
const QW: u32 = HEAD_DIM / 4u;               // int8 query words per head
const RP: u32 = WG / PAGE_SIZE;              // pages per round
const TS: u32 = WG / RW;                     // token subsets of the value pass
const NB8: u32 = HEAD_DIM / 8u;              // folding items (8 channels) per page
const NI: u32 = RP * NB8;                    // folding items per round
const IPI: u32 = (NI + WG - 1u) / WG;        // folding items per invocation
const VT: u32 = WG / TS;                     // tokens per invocation of the value pass
const CODE_MASK: u32 = (1u << BITS) - 1u;
const NIB: u32 = 0x0f0f0f0fu;
const MAX_CHUNK_PAGES: u32 = 64u;
const ACC: u32 = GROUP * CPW + 2u * GROUP;   // merged values per invocation: acc, min terms, l

var<workgroup> chunk_page: array<u32, 64>;
var<workgroup> chunk_fill: array<u32, 64>;
var<workgroup> qf_sh: array<vec4<f32>, GROUP * HEAD_DIM / 4u>; // q * scale
var<workgroup> q8_sh: array<vec4<u32>, RP * GROUP * QW / 4u>;  // per (page, head): packed int8
var<workgroup> amax_sh: array<atomic<u32>, RP * GROUP>;       // max |q * key scale| as bits
var<workgroup> qsum_sh: array<atomic<i32>, RP * GROUP>;       // sum q8 (int8 codes)
var<workgroup> part_sh: array<f32, RP * GROUP * NB8>;         // bias partials per (segment, head)
var<workgroup> qa_sh: array<vec2<f32>, RP * GROUP>;           // (alpha, bias) per (page, head)
var<workgroup> p_sh: array<vec4<f32>, WG>;                    // probabilities per token
var<workgroup> m_sh: array<vec4<f32>, WG / 4u>;                    // per subgroup score maxima
var<workgroup> red_sh: array<f32, (WG / 2u) * ACC>;
var<workgroup> count_sh: u32;
var<workgroup> live_sh: u32;

// The code at bit p of a word as a float, exactly, without an integer-to-float conversion (as
// in split_quant.wgsl).
fn code_float(w: u32, p: u32) -> f32 {
    let x = select(w, w >> 16u, p >= 16u);
    let s = p & 15u;
    let e = (150u - s) << 23u;
    return bitcast<f32>((x & (CODE_MASK << s)) | e) - bitcast<f32>(e);
}

// q * scale of head g, channels 8 b .. 8 b + 7.
fn fold_q(g: u32, b: u32) -> array<f32, 8> {
    let i = (g * HEAD_DIM) / 4u + 2u * b;
    let x = qf_sh[i];
    let y = qf_sh[i + 1u];
    return array<f32, 8>(x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w);
}

fn write_empty(seq: u32, kvh: u32, chunk: u32, t: u32) {
    if (t < GROUP) {
        let o = partial_index(params, seq, kvh * GROUP + t, params.n_buffers - 1u, chunk) * partial_stride(HEAD_DIM);
        partials[o] = NEG_BIG;
        partials[o + 1u] = 0.0;
    }
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
    let buffer = params.n_buffers - 1u;

    if (t == 0u) {
        count_sh = page_counts[list_index(geo, params.layer, seq, kvh)];
    }
    let n_pages = workgroupUniformLoad(&count_sh);
    let first = chunk * params.chunk_pages;
    if (first >= n_pages) {
        write_empty(seq, kvh, chunk, t);
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
    if (t == 0u) {
        var live = 0u;
        for (var c = 0u; c < params.chunk_pages; c++) {
            live |= chunk_fill[c];
        }
        live_sh = live;
    }
    if (workgroupUniformLoad(&live_sh) == 0u) {
        write_empty(seq, kvh, chunk, t);
        return;
    }
    let q0 = (seq * params.q_heads + kvh * GROUP) * HEAD_DIM;
    for (var e = t; e < GROUP * HEAD_DIM / 4u; e += WG) {
        let d = q0 + 4u * e;
        qf_sh[e] = vec4<f32>(queries[d], queries[d + 1u], queries[d + 2u], queries[d + 3u]) * params.scale;
    }

    let rw = code_row_words(geo);
    let kc_off = k_codes_off(geo);
    let vp_off = v_params_off(geo);
    let vc_off = v_codes_off(geo);
    let vgroups = HEAD_DIM / geo.v_group;
    // The value pass: this invocation's code word and token subset.
    let vj = t % RW;
    let vts = t / RW;
    let vgi = (vj * CPW) / geo.v_group;

    var acc: array<f32, GROUP * CPW>;
    var pmin: array<f32, GROUP>;     // sum p * min of this word's value group
    var lsum: array<f32, GROUP>;     // sum p (the invocations of word 0)
    var m: array<f32, GROUP>;
    for (var g = 0u; g < GROUP; g++) {
        pmin[g] = 0.0;
        lsum[g] = 0.0;
        m[g] = NEG_BIG;
    }
    for (var i = 0u; i < GROUP * CPW; i++) {
        acc[i] = 0.0;
    }

    let rounds = (params.chunk_pages + RP - 1u) / RP;
    // This invocation's token of the score pass.
    let r = t / PAGE_SIZE;
    let s = t % PAGE_SIZE;
    for (var rd = 0u; rd < rounds; rd++) {
        if (t < RP * GROUP) {
            atomicStore(&amax_sh[t], 0u);
            atomicStore(&qsum_sh[t], 0);
        }
        // Issue every load of the round before anything waits on one: the folding items' key
        // parameters, the token's key row, and the value words and parameters of the value pass.
        var kprm: array<u32, IPI * 8u>;
        var fold_live: array<bool, IPI>;
        for (var j = 0u; j < IPI; j++) {
            let it = t + j * WG;
            let fc = rd * RP + it / NB8;
            fold_live[j] = it < NI && fc < params.chunk_pages && chunk_fill[min(fc, MAX_CHUNK_PAGES - 1u)] > 0u;
            let fbase = (chunk_page[min(fc, MAX_CHUNK_PAGES - 1u)] - geo.n_pages) * geo.codec_page_words + (it % NB8) * 8u;
            for (var k = 0u; k < 8u; k++) {
                kprm[j * 8u + k] = codec_kv[select(0u, fbase + k, fold_live[j])];
            }
        }
        let c = rd * RP + r;
        var fill = 0u;
        if (c < params.chunk_pages) {
            fill = chunk_fill[min(c, MAX_CHUNK_PAGES - 1u)];
        }
        let valid = s < fill;
        let kb = select(0u, ((chunk_page[min(c, MAX_CHUNK_PAGES - 1u)] - geo.n_pages) * geo.codec_page_words + kc_off + s * rw) / 4u, valid);
        var krow: array<vec4<u32>, RW / 4u>;
        for (var v = 0u; v < RW / 4u; v++) {
            krow[v] = codec_kv4[kb + v];
        }
        var vok: array<bool, VT>;
        var vwd: array<u32, VT>;
        var vpd: array<u32, VT>;
        for (var i = 0u; i < VT; i++) {
            let tt = vts + i * TS;
            let vc = rd * RP + tt / PAGE_SIZE;
            let vs = tt % PAGE_SIZE;
            vok[i] = vc < params.chunk_pages && vs < chunk_fill[min(vc, MAX_CHUNK_PAGES - 1u)];
            let vbase = (chunk_page[min(vc, MAX_CHUNK_PAGES - 1u)] - geo.n_pages) * geo.codec_page_words;
            vwd[i] = codec_kv[select(0u, vbase + vc_off + vs * rw + vj, vok[i])];
            vpd[i] = codec_kv[select(0u, vbase + vp_off + vs * vgroups + vgi, vok[i])];
        }
        workgroupBarrier();

        // Fold, pass 1: per item (page, 8 channels) and head, the largest |q * scale| and the
        // bias sum (q * scale) * min, reduced over the page's items in a subgroup segment, then
        // across segments (atomic max; bias partials per segment).
        let seg = min(NB8, sg_size);
        for (var j = 0u; j < IPI; j++) {
            let it = t + j * WG;
            for (var g = 0u; g < GROUP; g++) {
                var mx = 0.0;
                var bias = 0.0;
                if (fold_live[j]) {
                    let q = fold_q(g, it % NB8);
                    for (var k = 0u; k < 8u; k++) {
                        mx = max(mx, abs(q[k] * f16_value(kprm[j * 8u + k] >> 16u)));
                        bias += q[k] * f16_value(kprm[j * 8u + k]);
                    }
                }
                for (var mask = 1u; mask < seg; mask = mask * 2u) {
                    mx = max(mx, subgroupShuffleXor(mx, mask));
                    bias += subgroupShuffleXor(bias, mask);
                }
                if (it < NI && (it % seg) == 0u) {
                    atomicMax(&amax_sh[(it / NB8) * GROUP + g], bitcast<u32>(mx));
                    part_sh[((it / NB8) * GROUP + g) * (NB8 / seg) + (it % NB8) / seg] = bias;
                }
            }
        }
        workgroupBarrier();
        // Pass 2: quantise (q * scale * 2^(6 - E), rounded to nearest even by adding 1.5 * 2^23,
        // whose low byte is then the two's complement code) and pack in the order the key words
        // unpack (int4: a word's even channels, then its odd ones; int8: in order).
        for (var j = 0u; j < IPI; j++) {
            let it = t + j * WG;
            for (var g = 0u; g < GROUP; g++) {
                var qsum = 0;
                if (it < NI) {
                    let pg = (it / NB8) * GROUP + g;
                    let ex = i32((atomicLoad(&amax_sh[pg]) >> 23u) & 0xffu) - 127;
                    let step = ldexp(1.0, 6 - ex);
                    let q = fold_q(g, it % NB8);
                    var b: array<u32, 8>;
                    for (var k = 0u; k < 8u; k++) {
                        let x = bitcast<u32>(min(q[k] * f16_value(kprm[j * 8u + k] >> 16u) * step, 127.0) + 12582912.0);
                        b[k] = select(0u, x & 0xffu, fold_live[j]);
                        qsum += i32(select(0u, x - 0x4b400000u, fold_live[j]));
                    }
                    var w0: u32;
                    var w1: u32;
                    if (BITS == 4u) {
                        w0 = b[0] | (b[2] << 8u) | (b[4] << 16u) | (b[6] << 24u);
                        w1 = b[1] | (b[3] << 8u) | (b[5] << 16u) | (b[7] << 24u);
                    } else {
                        w0 = b[0] | (b[1] << 8u) | (b[2] << 16u) | (b[3] << 24u);
                        w1 = b[4] | (b[5] << 8u) | (b[6] << 16u) | (b[7] << 24u);
                    }
                    let wi = pg * QW + 2u * (it % NB8);
                    q8_sh[wi / 4u][wi % 4u] = w0;
                    q8_sh[wi / 4u][wi % 4u + 1u] = w1;
                }
                if (BITS == 8u) {
                    for (var mask = 1u; mask < seg; mask = mask * 2u) {
                        qsum += subgroupShuffleXor(qsum, mask);
                    }
                    if (it < NI && (it % seg) == 0u) {
                        atomicAdd(&qsum_sh[(it / NB8) * GROUP + g], qsum);
                    }
                }
            }
        }
        if (t < RP * GROUP) {
            var bias = 0.0;
            for (var b = 0u; b < NB8 / seg; b++) {
                bias += part_sh[t * (NB8 / seg) + b];
            }
            let ex = i32((atomicLoad(&amax_sh[t]) >> 23u) & 0xffu) - 127;
            qa_sh[t] = vec2<f32>(ldexp(1.0, ex - 6), bias);
        }
        workgroupBarrier();

        // Scores: token t of the round.
        var sc = vec4<f32>(NEG_BIG);
        if (valid) {
            var isum = vec4<i32>(0);
            for (var v = 0u; v < select(RW / 4u, 0u, (ABLATE & 1u) != 0u); v++) {
                let kw = krow[v];
                for (var g = 0u; g < GROUP; g++) {
                    let qb = ((r * GROUP + g) * QW) / 4u;
                    if (BITS == 4u) {
                        let qa = q8_sh[qb + 2u * v];
                        let qc = q8_sh[qb + 2u * v + 1u];
                        isum[g] += dot4I8Packed(qa.x, kw.x & NIB) + dot4I8Packed(qa.y, (kw.x >> 4u) & NIB)
                            + dot4I8Packed(qa.z, kw.y & NIB) + dot4I8Packed(qa.w, (kw.y >> 4u) & NIB)
                            + dot4I8Packed(qc.x, kw.z & NIB) + dot4I8Packed(qc.y, (kw.z >> 4u) & NIB)
                            + dot4I8Packed(qc.z, kw.w & NIB) + dot4I8Packed(qc.w, (kw.w >> 4u) & NIB);
                    } else {
                        let qa = q8_sh[qb + v];
                        // Codes are unsigned bytes and the dot product signed: read as code - 128,
                        // 128 * sum q8 added back below.
                        let k8 = kw ^ vec4<u32>(0x80808080u);
                        isum[g] += dot4I8Packed(qa.x, k8.x) + dot4I8Packed(qa.y, k8.y) + dot4I8Packed(qa.z, k8.z)
                            + dot4I8Packed(qa.w, k8.w);
                    }
                }
            }
            for (var g = 0u; g < GROUP; g++) {
                let ab = qa_sh[r * GROUP + g];
                var x = isum[g];
                if (BITS == 8u) {
                    x += 128 * atomicLoad(&qsum_sh[r * GROUP + g]);
                }
                sc[g] = ab.x * f32(x) + ab.y;
                if (params.write_scores != 0u) {
                    scores[(seq * params.q_heads + kvh * GROUP + g) * params.max_tokens + (first + c) * PAGE_SIZE + s] = sc[g];
                }
            }
        }
        // The round's maximum per head: subgroups, then across them.
        let sm = vec4<f32>(subgroupMax(sc.x), subgroupMax(sc.y), subgroupMax(sc.z), subgroupMax(sc.w));
        if (sg_lane == 0u) {
            m_sh[sg_id] = sm;
        }
        workgroupBarrier();
        var m_new = vec4<f32>(NEG_BIG);
        for (var g = 0u; g < GROUP; g++) {
            m_new[g] = m[g];
        }
        for (var i = 0u; i < WG / sg_size; i++) {
            m_new = max(m_new, m_sh[i]);
        }
        var p = vec4<f32>(0.0);
        for (var g = 0u; g < GROUP; g++) {
            p[g] = select(0.0, exp(sc[g] - m_new[g]), valid);
        }
        p_sh[t] = p;
        // Rescale the running sums to the new maximum.
        for (var g = 0u; g < GROUP; g++) {
            let corr = exp(m[g] - m_new[g]);
            m[g] = m_new[g];
            pmin[g] *= corr;
            lsum[g] *= corr;
            for (var k = 0u; k < CPW; k++) {
                acc[g * CPW + k] *= corr;
            }
        }
        workgroupBarrier();

        // Values: word vj of tokens vts, vts + TS, ...
        for (var i = 0u; i < VT; i++) {
            if ((ABLATE & 2u) != 0u) {
                acc[0] += p_sh[vts + i * TS].x * f32(vwd[i] ^ vpd[i]);
                continue;
            }
            if (vok[i]) {
                let pt = p_sh[vts + i * TS];
                let vscale = f16_value(vpd[i] >> 16u);
                let vmin = f16_value(vpd[i]);
                for (var g = 0u; g < GROUP; g++) {
                    let ps = pt[g] * vscale;
                    pmin[g] += pt[g] * vmin;
                    lsum[g] += pt[g];
                    for (var k = 0u; k < CPW; k++) {
                        acc[g * CPW + k] += ps * code_float(vwd[i], k * BITS);
                    }
                }
            }
        }
    }

    // Merge the token subsets: a tree over workgroup memory.
    for (var h = TS / 2u; h > 0u; h = h / 2u) {
        if (vts >= h && vts < 2u * h) {
            let o = ((vts - h) * RW + vj) * ACC;
            for (var i = 0u; i < GROUP * CPW; i++) {
                red_sh[o + i] = acc[i];
            }
            for (var g = 0u; g < GROUP; g++) {
                red_sh[o + GROUP * CPW + g] = pmin[g];
                red_sh[o + GROUP * CPW + GROUP + g] = lsum[g];
            }
        }
        workgroupBarrier();
        if (vts < h) {
            let o = (vts * RW + vj) * ACC;
            for (var i = 0u; i < GROUP * CPW; i++) {
                acc[i] += red_sh[o + i];
            }
            for (var g = 0u; g < GROUP; g++) {
                pmin[g] += red_sh[o + GROUP * CPW + g];
                lsum[g] += red_sh[o + GROUP * CPW + GROUP + g];
            }
        }
        workgroupBarrier();
    }
    if (vts == 0u) {
        let stride = partial_stride(HEAD_DIM);
        for (var g = 0u; g < GROUP; g++) {
            let o = partial_index(params, seq, kvh * GROUP + g, buffer, chunk) * stride;
            for (var k = 0u; k < CPW; k++) {
                partials[o + 4u + vj * CPW + k] = acc[g * CPW + k] + pmin[g];
            }
            if (vj == 0u) {
                partials[o] = m[g];
                partials[o + 1u] = lsum[g];
                partials[o + 2u] = 0.0;
                partials[o + 3u] = 0.0;
            }
        }
    }
}
