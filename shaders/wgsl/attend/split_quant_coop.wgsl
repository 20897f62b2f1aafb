// attend_decode, split pass over KIVI int4 pages on the tensor cores (wgpu's experimental
// cooperative matrices, native only): one workgroup of NW subgroups of 32 per chunk, walking its
// compressed pages one at a time, each subgroup taking its own 16-token tiles of the page (tile
// s * NW + w for subgroup w) with its own softmax state, merged at the end.
//   fold (per page, the heads shared among the subgroups): the page's per-channel key
//     parameters folded into the queries exactly as the tile kernel does
//     (`reference::attend_decode_int8_query`): q * scale quantised to int8 with one
//     power-of-two step alpha per (page, head), and a bias; the int8 values as f16 rows of a
//     16-row matrix Q8 (rows past GROUP stay zero);
//   codes to f16: each 4-bit code c becomes the f16 64 + c with integer operations only (the
//     nibble in mantissa bits 4..7 under the exponent of 64; each u32's halves become f16
//     through 16-bit integers: naga cannot bitcast u32 to vec2<f16>, and f16 matrices read
//     from u32 arrays made the H200's compiler fail), written to workgroup memory as a
//     token-major row; a row's positions hold dimensions 8i + (0, 4, 1, 5, 2, 6, 3, 7) of each
//     code word i (the order the extraction yields), and Q8's columns follow it;
//   scores: S = Q8 (16 x d) times the key codes^T (d x 16 tokens), d / 16 products of
//     16 x 16 x 16 into f32: every term is an integer below 2^21, so the sum is exact and
//     alpha (S - 64 sum q8) + bias is the tile kernel's score;
//   softmax (one invocation per token): lazy references as in the tile kernel, rescaled only
//     when a score rises more than SLACK above its head's or a value scale exceeds its group's
//     (any subgroup's need moves every subgroup's sums, each by its own references); the weight
//     p * scale / s_ref * KSC of each (token, value group) rounded to f16;
//   values: O^T (d x 16 heads) += the value codes^T (d x 16 tokens) times those weights (16
//     tokens x 16 heads) per value group, into f32 accumulators that live across tiles; each
//     product is followed by -64 times the same weights (the tensor cores truncate their f32
//     sums, and the truncation of many 64s would land in the codes' part), the value mins go
//     into f32 sums per invocation, and the accumulators move into f32 registers only when a
//     reference moves.
// Raw pages are left to the raw pass; partials go to the last "buffer" index, as in
// split_codec.wgsl. CPU reference: `reference::attend_decode_int8_query` (the f16 weights are
// the kernel's only departure from it). On an H200 (2026-12-02) it is right and 2.1x slower than
// the tile kernel (BENCHMARKS.md, "The int4 attention on the tensor cores"): only
// `quant_kernel = coop` runs it.
enable f16;
enable wgpu_int16;
enable wgpu_cooperative_matrix;

//!import common/pool.wgsl
//!import attend/common.wgsl
//!import common/compress.wgsl
//!import attend/softmax.wgsl
//!import attend/merge.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: AttendParams;
@group(0) @binding(2) var<storage, read> page_list: array<u32>;
@group(0) @binding(3) var<storage, read> page_counts: array<u32>;
@group(0) @binding(4) var<storage, read> page_meta: array<PageMeta>;
@group(0) @binding(5) var<storage, read> codec_kv: array<vec4<u32>>;
@group(0) @binding(6) var<storage, read> queries: array<f32>;
@group(0) @binding(7) var<storage, read_write> partials: array<f32>;
@group(0) @binding(8) var<storage, read_write> scores: array<f32>;

//!define GROUP 4u
//!define HEAD_DIM 128u
//!define PAGE_SIZE 64u
//!define NG 2u
//!define NW 4u
//!define SLACK 2.0
// GROUP: query heads per KV head (at most 8). HEAD_DIM: d (32, 64 or 128). PAGE_SIZE: a
// multiple of 16 (at most 128). NG: value groups per row (d / NG a multiple of 16). NW:
// subgroups per workgroup (1, 2 or 4, dividing PAGE_SIZE / 16). SLACK: the lazy rescale's slack
// (natural-log units, >= 0). Subgroups must hold 32 invocations.

const WG: u32 = 32u * NW;
const RW: u32 = HEAD_DIM / 8u;        // code words per row
const RW4: u32 = RW / 4u;             // vec4 of code words per row
const CPL: u32 = (16u * RW4 + 31u) / 32u;  // vec4 of a tile's code words per invocation
const D4: u32 = HEAD_DIM / 4u;
const D16: u32 = HEAD_DIM / 16u;      // 16-dimension blocks
const HH: u32 = (GROUP + 1u) / 2u;    // heads per invocation in a block's move
const ROW4: u32 = D4 + 2u;            // a row of Q8 or codes: vec4 of f16, padded
const VG: u32 = HEAD_DIM / NG;
const TPP: u32 = PAGE_SIZE / 16u;     // tiles per page
const STEPS: u32 = TPP / NW;          // tiles per subgroup per page
const KSC: f32 = 4096.0;              // the f16 weights' scale: at most e^SLACK * KSC
const NM: u32 = 2u + NG;              // merged values per (subgroup, head): m, l, sum p * min per group

var<workgroup> list_page: array<u32, 64>;
var<workgroup> list_fill: array<u32, 64>;
var<workgroup> chunk_page: array<u32, 64>;
var<workgroup> chunk_fill: array<u32, 64>;
var<workgroup> chunk_pos: array<u32, 64>;
var<workgroup> count_sh: u32;
var<workgroup> live_sh: u32;
var<workgroup> flag_sh: atomic<u32>;
var<workgroup> q_sh: array<vec4<f32>, GROUP * D4>;     // the scaled queries
var<workgroup> qa_sh: array<vec4<f16>, 16u * ROW4>;    // Q8 [head][position]
var<workgroup> ab_sh: array<vec4<f32>, GROUP>;         // per head: alpha, bias, 64 sum q8
var<workgroup> neg_sh: array<vec4<f16>, 64>;           // a 16 x 16 matrix of -64
var<workgroup> kv_sh: array<vec4<f16>, NW * 16u * ROW4>;  // per subgroup: a tile's codes [token][position]
var<workgroup> s_sh: array<f32, NW * 256u>;            // per subgroup: scores; accumulators moving out
var<workgroup> w_sh: array<vec4<f16>, NW * NG * 64u>;  // per subgroup: weights [group][token][16 heads]
var<workgroup> ml_sh: array<f32, NW * GROUP * NM>;     // the merge: [subgroup][head][m, l, mins]
var<workgroup> o_sh: array<f32, GROUP * HEAD_DIM>;     // the merge: value sums [head][position]

// The u32 word `i` of the compressed pages.
fn codec_word(i: u32) -> u32 {
    return codec_kv[i >> 2u][i & 3u];
}

// The two f16 whose bits are the halves of x (low half first).
fn f16x2(x: u32) -> vec2<f16> {
    return bitcast<vec2<f16>>(vec2<u16>(u16(x & 0xffffu), u16(x >> 16u)));
}

// Writes this invocation's share of a 16-token tile's code rows (vec4 j * 32 + lane of the
// tile's 16 x RW4) to subgroup w's kv_sh as f16 64 + code, integer operations only: code word i
// of a row becomes the pairs of dimensions (0, 4), (1, 5), (2, 6), (3, 7), two vec4<f16>.
fn put_codes(w: u32, lane: u32, words: array<vec4<u32>, CPL>) {
    for (var j = 0u; j < CPL; j++) {
        let e = j * 32u + lane;
        if (e < 16u * RW4) {
            let tok = e / RW4;
            let wq = e % RW4;
            for (var m = 0u; m < 4u; m++) {
                let x = words[j][m];
                let at = (w * 16u + tok) * ROW4 + 2u * (4u * wq + m);
                kv_sh[at] = vec4<f16>(f16x2(((x << 4u) & 0x00f000f0u) | 0x54005400u), f16x2((x & 0x00f000f0u) | 0x54005400u));
                kv_sh[at + 1u] = vec4<f16>(f16x2(((x >> 4u) & 0x00f000f0u) | 0x54005400u), f16x2(((x >> 8u) & 0x00f000f0u) | 0x54005400u));
            }
        }
    }
}

// A 16-token tile's code rows from word `base` (the first token's row) on, coalesced.
fn get_codes(lane: u32, base: u32, ok: bool) -> array<vec4<u32>, CPL> {
    var x: array<vec4<u32>, CPL>;
    for (var j = 0u; j < CPL; j++) {
        x[j] = vec4<u32>(0u);
        if (ok && j * 32u + lane < 16u * RW4) {
            x[j] = codec_kv[base / 4u + j * 32u + lane];
        }
    }
    return x;
}

// The page's key parameters for position quad `lane` (code word lane / 2): the two vec4 of
// words holding its channels.
fn get_kparams(lane: u32, page: u32, ok: bool) -> array<vec4<u32>, 2> {
    var kp = array<vec4<u32>, 2>(vec4<u32>(0u), vec4<u32>(0u));
    if (ok && lane < D4) {
        let at = (page * geo.codec_page_words) / 4u + 2u * (lane / 2u);
        kp[0] = codec_kv[at];
        kp[1] = codec_kv[at + 1u];
    }
    return kp;
}

// A zero accumulator.
fn zero_c() -> coop_mat16x16<f32, C> {
    return coop_mat16x16<f32, C>();
}

// Block b's value products of subgroup w's tile added to its accumulator: the codes' 64 comes
// off right after with one more product, -64 times the same weights (the tensor cores truncate
// their f32 sums: an accumulator carrying the 64s would carry their truncation into the codes'
// part).
fn value_block(acc: coop_mat16x16<f32, C>, w: u32, b: u32, negm: coop_mat16x16<f16, A>) -> coop_mat16x16<f32, C> {
    let g = (16u * b) / VG;
    let vm = coopLoad<coop_mat16x16<f16, A>>(&kv_sh[w * 16u * ROW4 + 4u * b], ROW4);
    let wm = coopLoadT<coop_mat16x16<f16, B>>(&w_sh[(w * NG + g) * 64u], 4u);
    return coopMultiplyAdd(negm, wm, coopMultiplyAdd(vm, wm, acc));
}

// Block b's accumulator of subgroup w into this invocation's f32 sums o (then rescaled by
// corr): the element (position 16 b + r, head h), r = lane % 16 and h = 2 i + lane / 16, is
// C s_ref / KSC, at o[b * HH + i].
fn move_block(
    w: u32,
    lane: u32,
    c: coop_mat16x16<f32, C>,
    b: u32,
    corr: array<f32, GROUP>,
    s_ref: array<f32, NG>,
    o: ptr<function, array<f32, D16 * HH>>,
) {
    workgroupBarrier();  // s_sh is free
    coopStore(c, &s_sh[w * 256u], 16u);
    workgroupBarrier();
    let g = (16u * b) / VG;
    let back = select(0.0, s_ref[g] / KSC, s_ref[g] > 0.0);
    for (var i = 0u; i < HH; i++) {
        let h = 2u * i + lane / 16u;
        if (h < GROUP) {
            let x = s_sh[w * 256u + 16u * h + lane % 16u];
            (*o)[b * HH + i] = ((*o)[b * HH + i] + x * back) * corr[h];
        }
    }
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) t: u32,
) {
    let chunk = wg.x;
    let kvh = wg.y;
    let seq = wg.z;
    let buffer = params.n_buffers - 1u;
    let w = t / 32u;
    let lane = t % 32u;

    // The chunk's range as attend/chunk.wgsl's `chunk_of` reads it, written out: naga takes a
    // function's result for non-uniform, and the cooperative matrices need uniform control flow.
    if (t == 0u) {
        count_sh = page_counts[list_index(geo, params.layer, seq, kvh)];
        atomicStore(&flag_sh, 0u);
    }
    let n_pages = workgroupUniformLoad(&count_sh);
    let first = chunk * params.chunk_pages;
    if (first >= n_pages) {
        write_chunk_empty(t, GROUP, seq, kvh, buffer, chunk, HEAD_DIM);
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
        list_page[c] = page;
        list_fill[c] = fill;
    }
    workgroupBarrier();
    if (t == 0u) {
        var k = 0u;
        for (var c = 0u; c < params.chunk_pages; c++) {
            if (list_fill[c] > 0u) {
                chunk_page[k] = list_page[c] - geo.n_pages;
                chunk_fill[k] = list_fill[c];
                chunk_pos[k] = c;
                k++;
            }
        }
        live_sh = k;
    }
    let n_live = workgroupUniformLoad(&live_sh);
    if (n_live == 0u) {
        write_chunk_empty(t, GROUP, seq, kvh, buffer, chunk, HEAD_DIM);
        return;
    }
    let q0 = (seq * params.q_heads + kvh * GROUP) * HEAD_DIM;
    for (var e = t; e < GROUP * D4; e += WG) {
        let d = q0 + 4u * e;
        q_sh[e] = vec4<f32>(queries[d], queries[d + 1u], queries[d + 2u], queries[d + 3u]) * params.scale;
    }
    for (var e = t; e < 16u * ROW4; e += WG) {
        qa_sh[e] = vec4<f16>(0.0h);
    }
    for (var e = t; e < NW * NG * 64u; e += WG) {
        w_sh[e] = vec4<f16>(0.0h);
    }
    for (var e = t; e < 64u; e += WG) {
        neg_sh[e] = vec4<f16>(-64.0h);
    }
    workgroupBarrier();
    let negm = coopLoad<coop_mat16x16<f16, A>>(&neg_sh[0], 4u);

    let kc_off = k_codes_off(geo);
    let vp_off = v_params_off(geo);
    let vc_off = v_codes_off(geo);
    let pw = geo.codec_page_words;

    var m_ref: array<f32, GROUP>;
    var lsum: array<f32, GROUP>;
    var s_ref: array<f32, NG>;
    var ratio: array<f32, NG>;            // KSC / s_ref (0 while s_ref is 0)
    var minacc: array<f32, GROUP * NG>;   // [h * NG + g]: sum of p * min over this invocation's tokens
    var o: array<f32, D16 * HH>;          // moved value sums (see move_block)
    for (var h = 0u; h < GROUP; h++) {
        m_ref[h] = NEG_BIG;
        lsum[h] = 0.0;
        for (var g = 0u; g < NG; g++) {
            minacc[h * NG + g] = 0.0;
        }
    }
    for (var g = 0u; g < NG; g++) {
        s_ref[g] = 0.0;
        ratio[g] = 0.0;
    }
    for (var i = 0u; i < D16 * HH; i++) {
        o[i] = 0.0;
    }
    // The value accumulators of blocks 0 .. D16 - 1 (D16 is 2, 4 or 8; the unused ones are
    // never touched).
    var acc0 = zero_c();
    var acc1 = zero_c();
    var acc2 = zero_c();
    var acc3 = zero_c();
    var acc4 = zero_c();
    var acc5 = zero_c();
    var acc6 = zero_c();
    var acc7 = zero_c();

    // This subgroup's first tile: the first page's tile w.
    var kw = get_codes(lane, chunk_page[0] * pw + kc_off + 16u * w * RW, 16u * w < chunk_fill[0]);
    var vw = get_codes(lane, chunk_page[0] * pw + vc_off + 16u * w * RW, 16u * w < chunk_fill[0]);
    var vp: array<u32, NG>;
    for (var g = 0u; g < NG; g++) {
        vp[g] = 0u;
        if (lane < 16u && 16u * w + lane < chunk_fill[0]) {
            vp[g] = codec_word(chunk_page[0] * pw + vp_off + (16u * w + lane) * NG + g);
        }
    }
    var kp = get_kparams(lane, chunk_page[0], true);
    for (var k = 0u; k < n_live; k++) {
        let page = chunk_page[k];
        let fill = chunk_fill[k];
        workgroupBarrier();  // the last page's score products are done with qa_sh and ab_sh
        // Fold, this subgroup's heads: invocation `lane` takes position quad lane
        // (dimensions 8i + (0, 4, 1, 5) or 8i + (2, 6, 3, 7), i = lane / 2).
        let live = lane < D4;
        let i = lane / 2u;
        let odd = (lane % 2u) == 1u;
        var prm: vec4<u32>;
        if (odd) {
            prm = vec4<u32>(kp[0].z, kp[1].z, kp[0].w, kp[1].w);
        } else {
            prm = vec4<u32>(kp[0].x, kp[1].x, kp[0].y, kp[1].y);
        }
        let p0 = unpack2x16float(prm.x);
        let p1 = unpack2x16float(prm.y);
        let p2 = unpack2x16float(prm.z);
        let p3 = unpack2x16float(prm.w);
        let mins = vec4<f32>(p0.x, p1.x, p2.x, p3.x);
        let scl = vec4<f32>(p0.y, p1.y, p2.y, p3.y);
        for (var h = w; h < GROUP; h += NW) {
            var qv = vec4<f32>(0.0);
            if (live) {
                let qa = q_sh[h * D4 + 2u * i];
                let qb = q_sh[h * D4 + 2u * i + 1u];
                qv = select(vec4<f32>(qa.x, qb.x, qa.y, qb.y), vec4<f32>(qa.z, qb.z, qa.w, qb.w), odd);
            }
            let qs = qv * scl;
            let a = abs(qs);
            let mx = subgroupMax(max(max(a.x, a.y), max(a.z, a.w)));
            // As the tile kernel: alpha = 2^(E - 6), E the exponent of the page's largest
            // |q * scale| (at least -120); q * scale / alpha rounded to nearest even.
            let ex = max(i32((bitcast<u32>(mx) >> 23u) & 0xffu) - 127, -120);
            let step = pow2(6 - ex);
            let al = pow2(ex - 6);
            let q8 = round(min(qs * step, vec4<f32>(127.0)));
            let qsum = subgroupAdd(q8.x + q8.y + q8.z + q8.w);
            let fsum = subgroupAdd(dot(qs, vec4<f32>(1.0)));
            let qmin = subgroupAdd(dot(qv, mins));
            if (live) {
                qa_sh[h * ROW4 + lane] = vec4<f16>(q8);
            }
            if (lane == 0u) {
                ab_sh[h] = vec4<f32>(al, qmin + 8.0 * (fsum - al * qsum), 64.0 * qsum, 0.0);
            }
        }
        // The next page's key parameters, loaded while this one is used.
        kp = get_kparams(lane, chunk_page[min(k + 1u, n_live - 1u)], k + 1u < n_live);
        for (var s = 0u; s < STEPS; s++) {
            let tok0 = 16u * (s * NW + w);
            // This subgroup's next tile: the next step's of this page, or the next page's first.
            let last = s + 1u == STEPS;
            let nk = select(k, min(k + 1u, n_live - 1u), last);
            let ntok0 = select(tok0 + 16u * NW, 16u * w, last);
            let next_ok = (!last || k + 1u < n_live) && ntok0 < chunk_fill[nk];
            let nbase = chunk_page[nk] * pw + ntok0 * RW;
            if (s > 0u) {
                workgroupBarrier();  // the last step's value products are done with kv_sh
            }
            put_codes(w, lane, kw);
            kw = get_codes(lane, nbase + kc_off, next_ok);
            workgroupBarrier();

            // Scores: S = Q8 K^T into f32, stored column-major (token-major).
            var sm = zero_c();
            for (var b = 0u; b < D16; b++) {
                let qm = coopLoadT<coop_mat16x16<f16, A>>(&qa_sh[4u * b], ROW4);
                let km = coopLoad<coop_mat16x16<f16, B>>(&kv_sh[w * 16u * ROW4 + 4u * b], ROW4);
                sm = coopMultiplyAdd(qm, km, sm);
            }
            coopStore(sm, &s_sh[w * 256u], 16u);
            workgroupBarrier();

            // Softmax: invocations 0..15 take a token each.
            let valid = lane < 16u && tok0 + lane < fill;
            var x: array<f32, GROUP>;
            for (var h = 0u; h < GROUP; h++) {
                let ab = ab_sh[h];
                x[h] = select(NEG_BIG, ab.x * (s_sh[w * 256u + (lane % 16u) * 16u + h] - ab.z) + ab.y, valid);
            }
            if (valid && params.write_scores != 0u) {
                let pos = (first + chunk_pos[k]) * PAGE_SIZE + tok0 + lane;
                for (var h = 0u; h < GROUP; h++) {
                    scores[(seq * params.q_heads + kvh * GROUP + h) * params.max_tokens + pos] = x[h];
                }
            }
            var s_a: array<f32, NG>;
            var need = false;
            for (var g = 0u; g < NG; g++) {
                s_a[g] = select(0.0, unpack2x16float(vp[g]).y, valid);
                need = need || s_a[g] > s_ref[g];
            }
            for (var h = 0u; h < GROUP; h++) {
                need = need || x[h] > m_ref[h] + SLACK;
            }
            if (subgroupAny(need) && lane == 0u) {
                atomicOr(&flag_sh, 1u);
            }
            if (workgroupUniformLoad(&flag_sh) != 0u) {
                // Some subgroup's reference moves: each subgroup's new maxima, then its
                // accumulators move into its f32 sums, rescaled to them.
                var corr: array<f32, GROUP>;
                for (var h = 0u; h < GROUP; h++) {
                    let mv = softmax_move(m_ref[h], lsum[h], subgroupMax(x[h]));
                    corr[h] = mv.corr;
                    m_ref[h] = mv.m;
                    lsum[h] = mv.l;
                    for (var g = 0u; g < NG; g++) {
                        minacc[h * NG + g] *= corr[h];
                    }
                }
                // (move_block's first barrier: every invocation has read its scores from s_sh.)
                move_block(w, lane, acc0, 0u, corr, s_ref, &o);
                move_block(w, lane, acc1, 1u, corr, s_ref, &o);
                acc0 = zero_c();
                acc1 = zero_c();
                if (D16 > 2u) {
                    move_block(w, lane, acc2, 2u, corr, s_ref, &o);
                    move_block(w, lane, acc3, 3u, corr, s_ref, &o);
                    acc2 = zero_c();
                    acc3 = zero_c();
                }
                if (D16 > 4u) {
                    move_block(w, lane, acc4, 4u, corr, s_ref, &o);
                    move_block(w, lane, acc5, 5u, corr, s_ref, &o);
                    move_block(w, lane, acc6, 6u, corr, s_ref, &o);
                    move_block(w, lane, acc7, 7u, corr, s_ref, &o);
                    acc4 = zero_c();
                    acc5 = zero_c();
                    acc6 = zero_c();
                    acc7 = zero_c();
                }
                for (var g = 0u; g < NG; g++) {
                    let r = subgroupMax(s_a[g]);
                    // Headroom of 2: a later scale up to twice this tile's largest moves nothing.
                    if (r > s_ref[g]) {
                        s_ref[g] = 2.0 * r;
                    }
                    ratio[g] = select(0.0, KSC / s_ref[g], s_ref[g] > 0.0);
                }
            }

            // Weights against the (possibly moved) references.
            var p: array<f32, GROUP>;
            for (var h = 0u; h < GROUP; h++) {
                p[h] = softmax_prob(x[h], m_ref[h], valid);
                lsum[h] += p[h];
            }
            if (lane < 16u) {
                for (var g = 0u; g < NG; g++) {
                    let mn = unpack2x16float(vp[g]).x;
                    for (var h = 0u; h < GROUP; h++) {
                        minacc[h * NG + g] += p[h] * mn;
                        w_sh[((w * NG + g) * 16u + lane) * 4u + h / 4u][h % 4u] = f16(p[h] * s_a[g] * ratio[g]);
                    }
                }
            }
            // The value codes replace the key codes (every score product is done: barrier above).
            put_codes(w, lane, vw);
            // The next tile's value codes and parameters.
            vw = get_codes(lane, nbase + vc_off, next_ok);
            for (var g = 0u; g < NG; g++) {
                vp[g] = 0u;
                if (next_ok && lane < 16u && ntok0 + lane < chunk_fill[nk]) {
                    vp[g] = codec_word(chunk_page[nk] * pw + vp_off + (ntok0 + lane) * NG + g);
                }
            }
            workgroupBarrier();
            if (t == 0u) {
                // Every invocation read the flag before the barrier above.
                atomicStore(&flag_sh, 0u);
            }

            // Values: O^T += V^T W per 16-dimension block.
            acc0 = value_block(acc0, w, 0u, negm);
            acc1 = value_block(acc1, w, 1u, negm);
            if (D16 > 2u) {
                acc2 = value_block(acc2, w, 2u, negm);
                acc3 = value_block(acc3, w, 3u, negm);
            }
            if (D16 > 4u) {
                acc4 = value_block(acc4, w, 4u, negm);
                acc5 = value_block(acc5, w, 5u, negm);
                acc6 = value_block(acc6, w, 6u, negm);
                acc7 = value_block(acc7, w, 7u, negm);
            }
        }
    }

    // The accumulators' last move, the sums over each subgroup's invocations, then the merge
    // of the subgroups.
    var one: array<f32, GROUP>;
    for (var h = 0u; h < GROUP; h++) {
        one[h] = 1.0;
        lsum[h] = subgroupAdd(lsum[h]);
        for (var g = 0u; g < NG; g++) {
            minacc[h * NG + g] = subgroupAdd(minacc[h * NG + g]);
        }
    }
    move_block(w, lane, acc0, 0u, one, s_ref, &o);
    move_block(w, lane, acc1, 1u, one, s_ref, &o);
    if (D16 > 2u) {
        move_block(w, lane, acc2, 2u, one, s_ref, &o);
        move_block(w, lane, acc3, 3u, one, s_ref, &o);
    }
    if (D16 > 4u) {
        move_block(w, lane, acc4, 4u, one, s_ref, &o);
        move_block(w, lane, acc5, 5u, one, s_ref, &o);
        move_block(w, lane, acc6, 6u, one, s_ref, &o);
        move_block(w, lane, acc7, 7u, one, s_ref, &o);
    }
    // The merge: each subgroup's maxima, sums and p * min sums into ml_sh; then, one subgroup at
    // a time, its value sums scaled to the merged maxima into o_sh [head][position].
    if (lane < GROUP) {
        let at = (w * GROUP + lane) * NM;
        ml_sh[at] = m_ref[lane];
        ml_sh[at + 1u] = lsum[lane];
        for (var g = 0u; g < NG; g++) {
            ml_sh[at + 2u + g] = minacc[lane * NG + g];
        }
    }
    workgroupBarrier();
    var f: array<f32, GROUP>;
    for (var h = 0u; h < GROUP; h++) {
        var mx = NEG_BIG;
        for (var v = 0u; v < NW; v++) {
            mx = max(mx, ml_sh[(v * GROUP + h) * NM]);
        }
        f[h] = softmax_rescale(m_ref[h], mx);
    }
    for (var v = 0u; v < NW; v++) {
        if (w == v) {
            for (var b = 0u; b < D16; b++) {
                for (var i = 0u; i < HH; i++) {
                    let h = 2u * i + lane / 16u;
                    if (h < GROUP) {
                        let e = h * HEAD_DIM + 16u * b + lane % 16u;
                        let val = f[h] * (o[b * HH + i] + minacc[h * NG + (16u * b) / VG]);
                        o_sh[e] = select(o_sh[e] + val, val, v == 0u);
                    }
                }
            }
        }
        workgroupBarrier();
    }
    // Position 8i + 2m (+1) holds dimension 8i + m (+4).
    for (var e = t; e < GROUP * HEAD_DIM; e += WG) {
        let h = e / HEAD_DIM;
        let d = e % HEAD_DIM;
        let j = d % 8u;
        let pos = (d - j) + select(2u * j, 2u * (j - 4u) + 1u, j >= 4u);
        let o_at = partial_at(seq, kvh * GROUP + h, buffer, chunk, HEAD_DIM) + 4u + d;
        partials[o_at] = o_sh[h * HEAD_DIM + pos];
    }
    if (t < GROUP) {
        var mx = NEG_BIG;
        for (var v = 0u; v < NW; v++) {
            mx = max(mx, ml_sh[(v * GROUP + t) * NM]);
        }
        var l = 0.0;
        for (var v = 0u; v < NW; v++) {
            let at = (v * GROUP + t) * NM;
            l += softmax_rescale(ml_sh[at], mx) * ml_sh[at + 1u];
        }
        write_partial_stats(partial_at(seq, kvh * GROUP + t, buffer, chunk, HEAD_DIM), mx, l);
    }
}
