// attend_decode, split pass over KIVI int4 pages, stream kernel (subgroups and shader-f16;
// head_dim 128, at most 4 query heads per KV head, pages of 32 or 64 slots). A workgroup of 32
// invocations (one subgroup on most GPUs) streams its chunk one page at a time, every page's
// words loaded before any is used, and each phase laid out for its own reduction:
//   loads (page start): each invocation's share of the whole page in registers: the key
//     parameters of 4 channels, a quarter key row (16 bytes) of P / 8 tokens, one value code
//     word of P / 2 tokens, the value parameters of its score tokens; the warp's key loads
//     cover 512 contiguous bytes each, its value loads 128;
//   fold: the page's per-channel key parameters folded into the queries, q * scale quantised
//     to int8 exactly as `reference::attend_decode_int8_query` (one power-of-two step per page
//     and head, from the workgroup's largest |q * scale|), 4 channels per invocation;
//   scores: 4 invocations per token, 32 channels each, dot4I8Packed against every head's folded
//     query, the 4 heads' integer sums reduce-scattered over the 4 invocations (3 shuffles), so
//     each holds one head's score of one token;
//   softmax: one maximum per page and head (and one value-scale maximum per page and group)
//     over the workgroup; each token's probability times its value scale over the page's
//     largest, to workgroup memory; p times the group's min into the invocation's f32 sums;
//   values: 16 invocations per token row (8 dimensions each), two token streams: a code word
//     becomes four exact f16 pairs (one logic operation and a subtraction each) and accumulates
//     in packed f16 fused multiply-adds (two dimensions per instruction) over the page's P / 2
//     tokens of the stream, all below 15 * P / 2; at the page's end the f16 sums move into f32,
//     rescaled by the page's maximum and value scale.
// With RAW the kernel also reads the raw f16 pages of the pool's (single) buffer, after the
// compressed ones, scored and accumulated in f32 (no other split pass runs). Partials go to the
// last "buffer" index, as in split_quant_tile.wgsl. CPU reference:
// `reference::attend_decode_int8_query` (the f16 sums are the kernel's only departure from it,
// within the tests' tolerance). The invocations' roles come from their subgroup lane and
// subgroup id (t = sg_id * sg_size + lane), so the 4 invocations of a token share a subgroup on
// any subgroup size of at least 4.
enable f16;

//!import common/pool.wgsl
//!import common/window.wgsl
//!import attend/common.wgsl
//!import common/codec.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: AttendParams;
@group(0) @binding(2) var<uniform> window: PoolWindow;
@group(0) @binding(3) var<storage, read> page_list: array<u32>;
@group(0) @binding(4) var<storage, read> page_counts: array<u32>;
@group(0) @binding(5) var<storage, read> page_meta: array<PageMeta>;
@group(0) @binding(6) var<storage, read> codec_kv: array<vec4<u32>>;
@group(0) @binding(7) var<storage, read> pool: array<vec4<u32>>;
@group(0) @binding(8) var<storage, read> queries: array<f32>;
@group(0) @binding(9) var<storage, read_write> partials: array<f32>;
@group(0) @binding(10) var<storage, read_write> scores: array<f32>;

//!define GROUP 4u
//!define PAGE_SIZE 64u
//!define NG 2u
//!define RAW true
//!define ABLATE 0u
//!define ACC_SHARED false
//!define VC_LATE false
//!define UNROLL_S true
//!define UNROLL_V true
// GROUP: query heads per KV head (1..4; the kernel computes 4, the rest with zero queries).
// PAGE_SIZE: P (32 or 64). NG: value groups per row (1, 2 or 4: groups of 128, 64 or 32
// dimensions). RAW: also attend the raw pages of pool buffer 0 (the pool has one buffer, f16).
// ABLATE (H200 probes only, 0 otherwise: results are wrong): bit 0 skips the fold's arithmetic,
// 1 the score dot products, 2 the value arithmetic, 3 the value code loads. ACC_SHARED: the f32
// value sums live in workgroup memory between pages (fewer registers). VC_LATE: the value code
// words are loaded after the softmax, not at the page's start (fewer registers during the
// scores, one more wait per page). UNROLL_S, UNROLL_V: the score and value loops expanded by the
// resolver (else left to the driver).

const HEAD_DIM: u32 = 128u;
const WG: u32 = 32u;
const D4: u32 = HEAD_DIM / 4u;
const RW: u32 = HEAD_DIM / 8u;        // code words per row (8 int4 codes each)
const JT: u32 = PAGE_SIZE / 8u;       // score steps per page (8 tokens each, 4 invocations per token)
const VT: u32 = PAGE_SIZE / 2u;       // value tokens per invocation per page (2 streams)
const VG: u32 = HEAD_DIM / NG;        // dimensions per value group
const VT_RUN: u32 = VT * (1u - (ABLATE / 4u) % 2u);  // ABLATE bit 2: no value arithmetic
const MAX_CHUNK_PAGES: u32 = 64u;
const MAX_SG: u32 = 8u;               // subgroups of the workgroup (subgroups of at least 4)
// Word offsets inside a compressed page (common/codec.wgsl's KIVI layout at d = 128, 4 bits).
const KC_OFF4: u32 = HEAD_DIM / 4u;                    // key codes, in vec4
const VP_OFF: u32 = HEAD_DIM + PAGE_SIZE * RW;         // value parameters, in words
const VC_OFF: u32 = VP_OFF + PAGE_SIZE * NG;           // value codes, in words

var<workgroup> pages_sh: array<u32, MAX_CHUNK_PAGES>;  // compressed pages first, then raw pages
var<workgroup> fills_sh: array<u32, MAX_CHUNK_PAGES>;
var<workgroup> pos_sh: array<u32, MAX_CHUNK_PAGES>;    // a page's place in the chunk
var<workgroup> list_page_sh: array<u32, MAX_CHUNK_PAGES>;  // the chunk as listed
var<workgroup> list_fill_sh: array<u32, MAX_CHUNK_PAGES>;
var<workgroup> list_kind_sh: array<u32, MAX_CHUNK_PAGES>;  // 0 skipped, 1 compressed, 2 raw
var<workgroup> n_codec_sh: u32;
var<workgroup> n_live_sh: u32;
var<workgroup> count_sh: u32;
var<workgroup> q_sh: array<vec4<f32>, 4u * D4>;        // [head][d / 4]: the scaled queries
var<workgroup> q8_sh: array<vec4<u32>, RW * 2u>;       // [code word][head pair]: (even, odd) x 2
var<workgroup> red_max: array<vec4<f32>, MAX_SG>;
var<workgroup> red_sum: array<vec4<f32>, MAX_SG>;
var<workgroup> red_page: array<vec4<f32>, 2u * MAX_SG>;
var<workgroup> w_sh: array<vec4<f32>, PAGE_SIZE * NG>; // [slot][group]: 4 heads' p * scale / S
var<workgroup> fin_sh: array<vec4<f32>, 2u * WG>;      // the final sums
var<workgroup> acc_sh: array<vec4<f32>, 8u * 16u>;     // stream 1's value sums [head pair][lane]
var<workgroup> acc32_sh: array<vec4<f32>, select(1u, 8u * WG, ACC_SHARED)>;  // [i][invocation]

// A u32 as two f16 (low half first). WGSL's bitcast<vec2<f16>>(u32) is not in naga yet; this
// round trip through f32 is exact.
fn h2(x: u32) -> vec2<f16> {
    return vec2<f16>(unpack2x16float(x));
}

fn codec_word(i: u32) -> u32 {
    return codec_kv[i >> 2u][i & 3u];
}

// The workgroup's component-wise maximum of v (every invocation gets it): subgroup maxima, then
// one per subgroup through workgroup memory.
fn wg_max(v: vec4<f32>, sg_lane: u32, sg_id: u32, n_sg: u32) -> vec4<f32> {
    let r = subgroupMax(v);
    if (sg_lane == 0u) {
        red_max[sg_id] = r;
    }
    workgroupBarrier();
    var m = red_max[0];
    for (var k = 1u; k < n_sg; k++) {
        m = max(m, red_max[k]);
    }
    return m;
}

fn wg_sum(v: vec4<f32>, sg_lane: u32, sg_id: u32, n_sg: u32) -> vec4<f32> {
    let r = subgroupAdd(v);
    if (sg_lane == 0u) {
        red_sum[sg_id] = r;
    }
    workgroupBarrier();
    var m = red_sum[0];
    for (var k = 1u; k < n_sg; k++) {
        m += red_sum[k];
    }
    return m;
}

// Two maxima at once (the page's scores per head, its value scales per group).
fn wg_max2(a: vec4<f32>, b: vec4<f32>, sg_lane: u32, sg_id: u32, n_sg: u32) -> array<vec4<f32>, 2> {
    let ra = subgroupMax(a);
    let rb = subgroupMax(b);
    if (sg_lane == 0u) {
        red_page[2u * sg_id] = ra;
        red_page[2u * sg_id + 1u] = rb;
    }
    workgroupBarrier();
    var r: array<vec4<f32>, 2>;
    r[0] = red_page[0];
    r[1] = red_page[1];
    for (var k = 1u; k < n_sg; k++) {
        r[0] = max(r[0], red_page[2u * k]);
        r[1] = max(r[1], red_page[2u * k + 1u]);
    }
    return r;
}

// ACC_SHARED: an invocation's f32 value sums from / to workgroup memory.
fn acc_get(t: u32) -> array<vec2<f32>, 16> {
    var a: array<vec2<f32>, 16>;
    //!unroll
    for (var i = 0u; i < 8u; i++) {
        let v = acc32_sh[i * WG + t];
        a[2u * i] = v.xy;
        a[2u * i + 1u] = v.zw;
    }
    return a;
}

fn acc_put(t: u32, a: array<vec2<f32>, 16>) {
    //!unroll
    for (var i = 0u; i < 8u; i++) {
        acc32_sh[i * WG + t] = vec4<f32>(a[2u * i], a[2u * i + 1u]);
    }
}

// The value code words of this invocation's stream (word vi of tokens 2 k + vs) of the page at
// word cb.
fn load_vc(cb: u32, vs: u32, vi: u32) -> array<u32, VT> {
    var vc: array<u32, VT>;
    //!unroll
    for (var k = 0u; k < VT; k++) {
        vc[k] = 0u;
        if ((ABLATE & 8u) == 0u) {
            vc[k] = codec_word(cb + VC_OFF + (2u * k + vs) * RW + vi);
        }
    }
    return vc;
}

fn write_empty(seq: u32, kvh: u32, buffer: u32, chunk: u32, t: u32) {
    if (t < GROUP) {
        let o = partial_index(params, seq, kvh * GROUP + t, buffer, chunk) * partial_stride(HEAD_DIM);
        partials[o] = NEG_BIG;
        partials[o + 1u] = 0.0;
    }
}

@compute @workgroup_size(32)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_id) sg_id: u32,
) {
    let chunk = wg.x;
    let kvh = wg.y;
    let seq = wg.z;
    let buffer = params.n_buffers - 1u;
    let t = sg_id * sg_size + sg_lane;
    let n_sg = (WG + sg_size - 1u) / sg_size;

    if (t == 0u) {
        count_sh = page_counts[list_index(geo, params.layer, seq, kvh)];
    }
    let n_pages = workgroupUniformLoad(&count_sh);
    let first = chunk * params.chunk_pages;
    if (first >= n_pages) {
        write_empty(seq, kvh, buffer, chunk, t);
        return;
    }
    // The chunk's live pages: compressed ones first, in order, then (RAW) the raw pages of the
    // bound buffer; pages elsewhere, and empty ones, skipped. Each invocation looks up pages of
    // its own (two memory round trips in all), then one invocation orders them.
    let list = list_index(geo, params.layer, seq, kvh) * geo.max_pages_per_seq;
    let n = min(params.chunk_pages, n_pages - first);
    for (var c = t; c < n; c += WG) {
        let page = page_list[list + first + c];
        var kind = 0u;
        var fill = 0u;
        if (page >= geo.n_pages || (RAW && in_window(window, page))) {
            fill = page_meta[page].fill;
            kind = select(2u, 1u, page >= geo.n_pages);
        }
        list_page_sh[c] = page;
        list_fill_sh[c] = fill;
        list_kind_sh[c] = select(0u, kind, fill > 0u);
    }
    workgroupBarrier();
    if (t == 0u) {
        var k = 0u;
        for (var kind = 1u; kind <= 2u; kind++) {
            for (var c = 0u; c < n; c++) {
                if (list_kind_sh[c] == kind) {
                    pages_sh[k] = list_page_sh[c];
                    fills_sh[k] = list_fill_sh[c];
                    pos_sh[k] = c;
                    k++;
                }
            }
            if (kind == 1u) {
                n_codec_sh = k;
            }
        }
        n_live_sh = k;
    }
    let q0 = (seq * params.q_heads + kvh * GROUP) * HEAD_DIM;
    for (var e = t; e < 4u * D4; e += WG) {
        var v = vec4<f32>(0.0);
        if (e < GROUP * D4) {
            let d = q0 + 4u * e;
            v = vec4<f32>(queries[d], queries[d + 1u], queries[d + 2u], queries[d + 3u]) * params.scale;
        }
        q_sh[e] = v;
    }
    let n_live = workgroupUniformLoad(&n_live_sh);
    let n_codec = workgroupUniformLoad(&n_codec_sh);
    if (n_live == 0u) {
        write_empty(seq, kvh, buffer, chunk, t);
        return;
    }

    let qd = t / 4u;          // score phase: this invocation's token of each 8
    let b = t % 4u;           // ... its quarter of the key row, and after the reduce-scatter its head
    let vs = t / 16u;         // value phase: its token stream
    let vi = t % 16u;         // ... its code word (dimensions 8 vi .. 8 vi + 7)
    let my_g = (8u * vi) / VG;
    let page_w4 = geo.page_words / 4u;
    let vw4 = geo.vec_words / 4u;
    let v_off4 = block_words(geo) / 4u;

    var m = vec4<f32>(NEG_BIG);   // running maximum per head (the same in every invocation)
    var lsum = 0.0;               // head b's sum of p over this invocation's score tokens
    var minacc = vec4<f32>(0.0);  // head b's sum of p * min per value group, the same tokens
    var acc32: array<vec2<f32>, 16>;  // [h * 4 + k]: dimensions (k, k + 4) of the code word
    //!unroll
    for (var i = 0u; i < 16u; i++) {
        acc32[i] = vec2<f32>(0.0);
    }
    if (ACC_SHARED) {
        acc_put(t, acc32);
    }

    for (var c = 0u; c < n_live; c++) {
        let raw = RAW && c >= n_codec;
        let pg = pages_sh[c];
        let fill = fills_sh[c];
        let pos = first + pos_sh[c];
        let cb = select((pg - geo.n_pages) * geo.codec_page_words, 0u, raw);
        let cb4 = cb / 4u;
        // The page's loads, all issued before any is used.
        var kp = vec4<u32>(0u);
        var kc: array<vec4<u32>, JT>;
        var vc: array<u32, VT>;
        var vpw: array<vec4<u32>, JT>;
        if (!raw) {
            kp = codec_kv[cb4 + t];
            //!unroll
            for (var j = 0u; j < JT; j++) {
                kc[j] = codec_kv[cb4 + KC_OFF4 + 32u * j + t];
            }
            if (!VC_LATE) {
                vc = load_vc(cb, vs, vi);
            }
            //!unroll
            for (var j = 0u; j < JT; j++) {
                let w0 = cb + VP_OFF + (8u * j + qd) * NG;
                if (NG == 4u) {
                    vpw[j] = codec_kv[w0 / 4u];
                } else if (NG == 2u) {
                    let v = codec_kv[w0 / 4u];
                    vpw[j] = vec4<u32>(select(v.xy, v.zw, (w0 & 2u) != 0u), 0u, 0u);
                } else {
                    vpw[j] = vec4<u32>(codec_word(w0), 0u, 0u, 0u);
                }
            }
        }

        // Fold (compressed pages): channels 4 t .. 4 t + 3 of every head.
        var alpha = vec4<f32>(0.0);
        var bias = vec4<f32>(0.0);
        if (!raw && (ABLATE & 1u) == 0u) {
            var qs: array<vec4<f32>, 4>;
            var mxv = vec4<f32>(0.0);
            var bl = vec4<f32>(0.0);
            let p0 = unpack2x16float(kp.x);
            let p1 = unpack2x16float(kp.y);
            let p2 = unpack2x16float(kp.z);
            let p3 = unpack2x16float(kp.w);
            let sc4 = vec4<f32>(p0.y, p1.y, p2.y, p3.y);
            let mn4 = vec4<f32>(p0.x, p1.x, p2.x, p3.x);
            //!unroll
            for (var h = 0u; h < 4u; h++) {
                let qf = q_sh[h * D4 + t];
                qs[h] = qf * sc4;
                let a = abs(qs[h]);
                mxv[h] = max(max(a.x, a.y), max(a.z, a.w));
                bl[h] = dot(qf, mn4) + 8.0 * dot(qs[h], vec4<f32>(1.0));
            }
            let mx = wg_max(mxv, sg_lane, sg_id, n_sg);
            // alpha = 2^(E - 6), E the exponent of the page's largest |q * scale| (at least -120):
            // every q * scale / alpha lies in (-128, 128); rounded to nearest even, at most 127,
            // then 1.5 * 2^23 added exactly so that the sum's low byte is the signed code.
            let ex = max(vec4<i32>((bitcast<vec4<u32>>(mx) >> vec4<u32>(23u)) & vec4<u32>(0xffu)) - vec4<i32>(127), vec4<i32>(-120));
            let step = ldexp(vec4<f32>(1.0), vec4<i32>(6) - ex);
            alpha = ldexp(vec4<f32>(1.0), ex - vec4<i32>(6));
            var hw = vec4<u32>(0u);
            //!unroll
            for (var h = 0u; h < 4u; h++) {
                let x = bitcast<vec4<u32>>(round(min(qs[h] * step[h], vec4<f32>(127.0))) + vec4<f32>(12582912.0));
                let by = x & vec4<u32>(0xffu);
                // Channels 4 t + (0, 2) are bytes of the code word's even-nibble query word,
                // 4 t + (1, 3) of the odd one: 16 bits of each here, the other 16 in t ^ 1.
                hw[h] = (by.x | (by.z << 8u)) | ((by.y | (by.w << 8u)) << 16u);
                let iv = bitcast<vec4<i32>>(x - vec4<u32>(0x4b400000u));
                bl[h] -= 8.0 * alpha[h] * f32(iv.x + iv.y + iv.z + iv.w);
            }
            let other = subgroupShuffleXor(hw, 1u);
            if ((t & 1u) == 0u) {
                let e = (hw & vec4<u32>(0xffffu)) | (other << vec4<u32>(16u));
                let o = (hw >> vec4<u32>(16u)) | (other & vec4<u32>(0xffff0000u));
                q8_sh[t] = vec4<u32>(e.x, o.x, e.y, o.y);
                q8_sh[t + 1u] = vec4<u32>(e.z, o.z, e.w, o.w);
            }
            // (wg_sum's barrier also publishes q8_sh.)
            bias = wg_sum(bl, sg_lane, sg_id, n_sg);
        }

        // Scores: token 8 j + qd of the page, head b after the reduce-scatter.
        let my_alpha = alpha[b];
        let my_bias = bias[b];
        var x: array<f32, JT>;
        var pmax = NEG_BIG;
        var smax = vec4<f32>(0.0);
        //!unroll UNROLL_S
        for (var j = 0u; j < JT; j++) {
            let r = 8u * j + qd;
            var part = vec4<f32>(0.0);
            var ipart = vec4<i32>(0);
            if (raw) {
                let row = (pg - window.first_page) * page_w4 + min(r, fill - 1u) * vw4 + 4u * b;
                //!unroll
                for (var e = 0u; e < 4u; e++) {
                    let w = pool[row + e];
                    let k0 = vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
                    let k1 = vec4<f32>(unpack2x16float(w.z), unpack2x16float(w.w));
                    //!unroll
                    for (var h = 0u; h < 4u; h++) {
                        part[h] += dot(q_sh[h * D4 + 8u * b + 2u * e], k0) + dot(q_sh[h * D4 + 8u * b + 2u * e + 1u], k1);
                    }
                }
            } else if ((ABLATE & 2u) == 0u) {
                //!unroll
                for (var e = 0u; e < 4u; e++) {
                    let w = kc[j][e];
                    let lo = w & 0x0f0f0f0fu;
                    let hi = (w >> 4u) & 0x0f0f0f0fu;
                    let qa = q8_sh[2u * (4u * b + e)];
                    let qb = q8_sh[2u * (4u * b + e) + 1u];
                    ipart += vec4<i32>(
                        dot4I8Packed(qa.x, lo) + dot4I8Packed(qa.y, hi),
                        dot4I8Packed(qa.z, lo) + dot4I8Packed(qa.w, hi),
                        dot4I8Packed(qb.x, lo) + dot4I8Packed(qb.y, hi),
                        dot4I8Packed(qb.z, lo) + dot4I8Packed(qb.w, hi),
                    );
                }
            }
            // Reduce-scatter over the token's 4 invocations: b & 2 keeps heads (2, 3) or (0, 1),
            // then b & 1 one of the pair, so invocation b ends with head b's whole sum.
            var s = 0.0;
            let up = (b & 2u) != 0u;
            let odd = (b & 1u) != 0u;
            if (raw) {
                let keep = select(part.xy, part.zw, up);
                let k2 = keep + subgroupShuffleXor(select(part.zw, part.xy, up), 2u);
                s = select(k2.x, k2.y, odd) + subgroupShuffleXor(select(k2.y, k2.x, odd), 1u);
            } else {
                let keep = select(ipart.xy, ipart.zw, up);
                let k2 = keep + subgroupShuffleXor(select(ipart.zw, ipart.xy, up), 2u);
                let tot = select(k2.x, k2.y, odd) + subgroupShuffleXor(select(k2.y, k2.x, odd), 1u);
                s = my_alpha * f32(tot) + my_bias;
            }
            let valid = r < fill && b < GROUP;
            x[j] = select(NEG_BIG, s, valid);
            pmax = max(pmax, x[j]);
            if (!raw && r < fill) {
                //!unroll
                for (var g = 0u; g < NG; g++) {
                    smax[g] = max(smax[g], unpack2x16float(vpw[j][g]).y);
                }
            }
            if (valid && params.write_scores != 0u) {
                scores[(seq * params.q_heads + kvh * GROUP + b) * params.max_tokens + pos * PAGE_SIZE + r] = s;
            }
        }

        // Softmax: the page's maximum per head and value scale per group over the workgroup.
        var pm = vec4<f32>(NEG_BIG);
        pm[b] = pmax;
        let red = wg_max2(pm, smax, sg_lane, sg_id, n_sg);
        let m_new = max(m, red[0]);
        let corr = exp(m - m_new);
        m = m_new;
        let big_s = select(red[1], vec4<f32>(1.0), raw);
        let inv_s = select(vec4<f32>(1.0) / big_s, vec4<f32>(0.0), big_s == vec4<f32>(0.0));
        let mb = m[b];
        lsum *= corr[b];
        minacc *= corr[b];
        //!unroll
        for (var j = 0u; j < JT; j++) {
            let r = 8u * j + qd;
            // (A slot past the fill, or a padding head, weighs 0 and reads no parameter.)
            let live = x[j] > NEG_BIG;
            let p = select(0.0, exp(x[j] - mb), live);
            lsum += p;
            //!unroll
            for (var g = 0u; g < NG; g++) {
                var wt = p;
                if (!raw && live) {
                    let prm = unpack2x16float(vpw[j][g]);
                    minacc[g] += p * prm.x;
                    wt = p * prm.y * inv_s[g];
                }
                w_sh[r * NG + g][b] = wt;
            }
        }
        workgroupBarrier();

        // Values: code word vi of the stream's tokens 2 k + vs.
        if (ACC_SHARED) {
            acc32 = acc_get(t);
        }
        if (raw) {
            //!unroll
            for (var i = 0u; i < 16u; i++) {
                acc32[i] *= corr[i / 4u];
            }
            //!unroll
            for (var k = 0u; k < VT; k++) {
                let r = 2u * k + vs;
                if (r < fill) {
                    let w = pool[(pg - window.first_page) * page_w4 + v_off4 + r * vw4 + vi];
                    let v01 = unpack2x16float(w.x);
                    let v23 = unpack2x16float(w.y);
                    let v45 = unpack2x16float(w.z);
                    let v67 = unpack2x16float(w.w);
                    let pw = w_sh[r * NG];
                    //!unroll
                    for (var h = 0u; h < GROUP; h++) {
                        acc32[h * 4u] += pw[h] * vec2<f32>(v01.x, v45.x);
                        acc32[h * 4u + 1u] += pw[h] * vec2<f32>(v01.y, v45.y);
                        acc32[h * 4u + 2u] += pw[h] * vec2<f32>(v23.x, v67.x);
                        acc32[h * 4u + 3u] += pw[h] * vec2<f32>(v23.y, v67.y);
                    }
                }
            }
        } else {
            if (VC_LATE) {
                vc = load_vc(cb, vs, vi);
            }
            var acc16: array<vec2<f16>, 16>;
            //!unroll
            for (var i = 0u; i < 16u; i++) {
                acc16[i] = vec2<f16>(0.0h);
            }
            //!unroll UNROLL_V
            for (var k = 0u; k < VT_RUN; k++) {
                let r = 2u * k + vs;
                let wh = vec4<f16>(w_sh[r * NG + my_g]);
                // Codes as exact f16 pairs: (w & 0x000f000f) | 0x6400 pairs is 1024 + code, and
                // (w & 0x00f000f0) | 0x5400 pairs is 64 + code (mantissa step 1/16); nibbles (k, k + 4).
                let w = vc[k];
                let w8 = w >> 8u;
                var cw: array<vec2<f16>, 4>;
                cw[0] = h2((w & 0x000f000fu) | 0x64006400u) - vec2<f16>(1024.0h);
                cw[1] = h2((w & 0x00f000f0u) | 0x54005400u) - vec2<f16>(64.0h);
                cw[2] = h2((w8 & 0x000f000fu) | 0x64006400u) - vec2<f16>(1024.0h);
                cw[3] = h2((w8 & 0x00f000f0u) | 0x54005400u) - vec2<f16>(64.0h);
                //!unroll
                for (var h = 0u; h < GROUP; h++) {
                    let ws = vec2<f16>(wh[h]);
                    //!unroll
                    for (var q = 0u; q < 4u; q++) {
                        acc16[h * 4u + q] = fma(ws, cw[q], acc16[h * 4u + q]);
                    }
                }
            }
            let sg = big_s[my_g];
            //!unroll
            for (var i = 0u; i < 16u; i++) {
                acc32[i] = acc32[i] * corr[i / 4u] + vec2<f32>(acc16[i]) * sg;
            }
        }
        if (ACC_SHARED) {
            acc_put(t, acc32);
        }
    }
    if (ACC_SHARED) {
        acc32 = acc_get(t);
    }

    // Final sums: l and p * min over the 8 invocations of each head, stream 1's value sums
    // added to stream 0's.
    fin_sh[t] = vec4<f32>(lsum, 0.0, 0.0, 0.0);
    fin_sh[WG + t] = minacc;
    if (vs == 1u) {
        for (var i = 0u; i < 8u; i++) {
            acc_sh[i * 16u + vi] = vec4<f32>(acc32[2u * i], acc32[2u * i + 1u]);
        }
    }
    workgroupBarrier();
    if (vs == 0u) {
        let stride = partial_stride(HEAD_DIM);
        //!unroll
        for (var h = 0u; h < GROUP; h++) {
            var mins = vec4<f32>(0.0);
            for (var k = 0u; k < 8u; k++) {
                mins += fin_sh[WG + 4u * k + h];
            }
            var a: array<vec2<f32>, 4>;
            //!unroll
            for (var q = 0u; q < 4u; q++) {
                let o = acc_sh[(2u * h + q / 2u) * 16u + vi];
                a[q] = acc32[h * 4u + q] + select(o.xy, o.zw, (q & 1u) != 0u) + vec2<f32>(mins[my_g]);
            }
            let o = partial_index(params, seq, kvh * GROUP + h, buffer, chunk) * stride + 4u + 8u * vi;
            partials[o] = a[0].x;
            partials[o + 1u] = a[1].x;
            partials[o + 2u] = a[2].x;
            partials[o + 3u] = a[3].x;
            partials[o + 4u] = a[0].y;
            partials[o + 5u] = a[1].y;
            partials[o + 6u] = a[2].y;
            partials[o + 7u] = a[3].y;
        }
        if (t < GROUP) {
            var l = 0.0;
            for (var k = 0u; k < 8u; k++) {
                l += fin_sh[4u * k + t].x;
            }
            let o = partial_index(params, seq, kvh * GROUP + t, buffer, chunk) * stride;
            partials[o] = m[t];
            partials[o + 1u] = l;
            partials[o + 2u] = 0.0;
            partials[o + 3u] = 0.0;
        }
    }
}
