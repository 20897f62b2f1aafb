// attend_decode, split pass over KIVI int4 pages, tile kernel (subgroups and shader-f16). A
// workgroup of WG invocations walks its chunk's pages WG tokens at a time (a tile of WG / P
// pages) in three phases, each laid out for its own reduction:
//   fold (per page): the page's per-channel key parameters are folded into the queries once,
//     q * scale quantised to int8 (exactly as `reference::attend_decode_int8_query`) with the
//     bias q . min, by GROUP * HEAD_DIM / FC invocations per page (FC channels of one head each,
//     reduced over NSL neighbouring lanes), into workgroup memory;
//   scores (one invocation per token): the token's whole key row, dot4I8Packed against the
//     folded query of every head (no cross-lane sums at all), then the online softmax's
//     probability p; p times the token's value scale (per value group) goes to workgroup
//     memory as f16 pairs, p times the group's min into the invocation's f32 sums;
//   values (LPR = HEAD_DIM / 8 invocations per token row, 8 dimensions each): the code words
//     become f16 pairs with a logic operation and a subtraction each (with DENORM, half of them
//     without the subtraction), and accumulate as packed f16 fused multiply-adds (two
//     dimensions per instruction) over a few tiles, then into f32.
// The softmax reference maximum and the value-scale reference are lazy and shared by the
// workgroup: a tile rescales only when some token's score rises more than SLACK above its
// head's reference or some value scale exceeds its group's reference, so the f16 sums stay
// within range: at most FLUSH tiles of TPL tokens, each term below e^SLACK * 2^K * 15. With RAW
// the kernel also reads the raw f16 pages of the pool's (single) buffer, scored and accumulated
// in f32, so no other split pass runs. Partials go to the last "buffer" index, as in
// split_codec.wgsl (the portable fallback); CPU reference: `reference::attend_decode_int8_query`
// (the f16 sums are the kernel's only departure from it, within the tests' tolerance).
enable f16;

//!import common/pool.wgsl
//!import common/window.wgsl
//!import attend/common.wgsl
//!import common/compress.wgsl
//!import attend/chunk.wgsl
//!import attend/softmax.wgsl
//!import attend/merge.wgsl

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
//!define HEAD_DIM 128u
//!define PAGE_SIZE 16u
//!define NG 4u
//!define FLUSH 2u
//!define RAW true
//!define SLACK 2.0
//!define KSCALE 8.0
//!define WG 128u
//!define FC 16u
//!define DENORM false
//!define KSIGNED true
//!define PS_EARLY true
// GROUP: query heads per KV head. HEAD_DIM: d (32, 64 or 128). PAGE_SIZE: P (16..128, dividing
// WG). NG: value groups per row (d / v_group, v_group a multiple of 8). FLUSH: tiles between
// moves of the f16 sums into f32. RAW: also attend the raw pages of pool buffer 0 (the pool has
// one buffer, f16). SLACK: the lazy rescale's slack (natural-log units, >= 0). KSCALE: 2^K, the
// f16 terms' scale (the host picks the largest K that keeps the sums below f16's maximum).
// WG: invocations per workgroup (32, 64 or 128, a multiple of PAGE_SIZE; at least 8 per
// subgroup): a tile is WG tokens. The value words' loads and the value loop are expanded by
// the resolver (`//!unroll`), so the words stay in registers (left to the H200's compiler, the loop stays a loop and the words go to
// local memory). FC: channels per fold item, 16 or 8 (8 halves the fold's work per invocation
// where a page's fold has fewer items than the workgroup has invocations; its reduction spans
// HEAD_DIM / FC lanes, at most the subgroup size). DENORM: every value code becomes the f16
// code x 2^-20, half of them by a mask alone (a nibble in mantissa bits 4..7 under a zero
// exponent is that subnormal f16), so half the conversions need no subtraction. Only where the
// device's f16 arithmetic keeps subnormals exactly (the runtime's probe,
// `Runtime::f16_subnormals`), and with the scale 2^K the host picks for it (then the f16
// weights themselves bound K). KSIGNED: the key row's high nibbles (the odd channels) read in
// place as signed bytes, (w ^ 0x80808080) & 0xf0f0f0f0 = 16 (code - 8), one logic instruction
// where the shift down took two, summed apart from the low nibbles' and joined once per token
// (on by default; off, the high nibbles are shifted down like the low ones).
// PS_EARLY: the tile's probabilities go to workgroup memory before the rescale's flag is read,
// so the flag's barrier also publishes them: one barrier per tile fewer. Where a reference
// moves (rare), they are written again after the rescale, behind a barrier of their own (on by
// default; off, once per tile, after any rescale, behind a barrier of their own).

const D4: u32 = HEAD_DIM / 4u;
const RW: u32 = HEAD_DIM / 8u;        // code words per row (8 int4 codes each)
const RW4: u32 = RW / 4u;             // vec4 of code words per row
const PPT: u32 = WG / PAGE_SIZE;      // pages per tile
const NSL: u32 = HEAD_DIM / FC;       // fold items per (page, head): FC channels each
const FV: u32 = FC / 4u;              // fold: vec4 of channels per item
const FW: u32 = FC / 8u;              // fold: code words per item
const ITEMS: u32 = PPT * GROUP * NSL;
const IPL: u32 = (ITEMS + WG - 1u) / WG;
const LPR: u32 = HEAD_DIM / 8u;       // value phase: invocations per token row
const NS: u32 = WG / LPR;             // value phase: token streams
const TPL: u32 = WG / NS;             // value phase: tokens per invocation per tile
const GP: u32 = (GROUP + 1u) / 2u;    // head pairs (a vec4 of folded query words per code word)
const GQ: u32 = (GROUP + 3u) / 4u;    // head quads (a vec4 of probability words)
const VG: u32 = HEAD_DIM / NG;        // dimensions per value group
const NRED: u32 = GROUP + NG;         // values of the rescale's workgroup reduction
const NSUM: u32 = GROUP + GROUP * NG; // values of the final sums (at least NRED)
const MAX_SUBGROUPS: u32 = 16u;       // subgroups of at least 8 invocations (the tier's)
const MAX_CHUNK_PAGES: u32 = 64u;
const MAX_SLOTS: u32 = MAX_CHUNK_PAGES + 8u;  // compressed pages, padding to a tile, raw pages
const QPS: u32 = RW * GP + 1u;        // q8_sh vec4 per page (padded: two pages of a subgroup read other banks)
const KINV: f32 = 1.0 / KSCALE;
// The f16 value sums' unit of code: 1, or with DENORM 2^-20 (each code a subnormal f16, its
// nibble in mantissa bits 4..7), so the sums are multiplied by 2^20 when they move into f32.
fn code_unit() -> f32 {
    return select(1.0, 1048576.0, DENORM);
}
// The page layouts as constants (the geometry's runtime fields would cost an integer division
// per load on the H200): a compressed int4 page (`Codec::page_words`, common/compress.wgsl) and,
// with RAW, a raw f16 page of the pool (K block then V block, d / 8 vec4 words per row).
const CPW: u32 = HEAD_DIM + 2u * PAGE_SIZE * RW + PAGE_SIZE * NG;
const KC_OFF: u32 = HEAD_DIM;
const VP_OFF: u32 = HEAD_DIM + PAGE_SIZE * RW;
const VC_OFF: u32 = VP_OFF + PAGE_SIZE * NG;
const VW4: u32 = HEAD_DIM / 8u;
const PAGE_W4: u32 = 2u * PAGE_SIZE * VW4;
const V_OFF4: u32 = PAGE_SIZE * VW4;
const VPAGE: bool = PAGE_SIZE % NS == 0u;     // value tokens: JP per page, VPG pages
const JP: u32 = (PAGE_SIZE + NS - 1u) / NS;
const VPG: u32 = TPL / JP;

var<workgroup> list_page: array<u32, 64>;
var<workgroup> list_fill: array<u32, 64>;
var<workgroup> chunk_page: array<u32, MAX_SLOTS>;
var<workgroup> chunk_fill: array<u32, MAX_SLOTS>;
var<workgroup> chunk_pos: array<u32, MAX_SLOTS>;  // a live page's place in the chunk
var<workgroup> q_sh: array<vec4<f32>, GROUP * D4>;  // the scaled queries; the merge at the end
var<workgroup> q8_sh: array<vec4<u32>, PPT * QPS>;  // [page][code word][head pair]: (even, odd) x 2
var<workgroup> ab_sh: array<vec2<f32>, PPT * GROUP>;    // [page][head]: (alpha, bias)
var<workgroup> ps_sh: array<vec4<u32>, WG * NG * GQ>;   // [token][group][head quad]: p * scale, f16 pairs
var<workgroup> red_sh: array<f32, MAX_SUBGROUPS * NSUM>;
var<workgroup> flag_sh: atomic<u32>;
var<workgroup> codec_sh: atomic<u32>;
var<workgroup> raw_sh: atomic<u32>;
var<workgroup> slots_sh: u32;
var<workgroup> raw_start_sh: u32;
var<workgroup> magic_sh: vec4<u32>;  // the code conversions' exponent bits, KSIGNED's sign bits (see `magic`)

// A u32 as two f16 (low half first). WGSL's bitcast<vec2<f16>>(u32) is not in naga yet; this
// round trip through f32 is exact, and compilers fold it to a plain reinterpretation.
fn h2(x: u32) -> vec2<f16> {
    return vec2<f16>(unpack2x16float(x));
}

// The u32 word `i` of the compressed pages.
fn codec_word(i: u32) -> u32 {
    return codec_kv[i >> 2u][i & 3u];
}

// Loads for the tile whose first page is c0 (of n_live). This invocation's score-phase token:
// its key code row.
fn tile_kw(c0: u32, t: u32, n_live: u32) -> array<vec4<u32>, RW4> {
    var kw: array<vec4<u32>, RW4>;
    let c = c0 + t / PAGE_SIZE;
    let cc = min(c, MAX_SLOTS - 1u);
    let pg = chunk_page[cc];
    let ok = c < n_live && t % PAGE_SIZE < chunk_fill[cc] && pg >= geo.n_pages;
    // Not a live compressed token: the buffer's first vec4s, without a branch (its score is
    // never used).
    let r4 = select(0u, ((pg - geo.n_pages) * CPW + KC_OFF + (t % PAGE_SIZE) * RW) / 4u, ok);
    for (var i = 0u; i < RW4; i++) {
        kw[i] = codec_kv[r4 + i];
    }
    return kw;
}

// ... its value parameters (min, scale per value group).
fn tile_vprm(c0: u32, t: u32, n_live: u32) -> array<u32, NG> {
    var vp: array<u32, NG>;
    let c = c0 + t / PAGE_SIZE;
    let cc = min(c, MAX_SLOTS - 1u);
    let pg = chunk_page[cc];
    let ok = c < n_live && t % PAGE_SIZE < chunk_fill[cc] && pg >= geo.n_pages;
    let w0 = select(0u, (pg - geo.n_pages) * CPW + VP_OFF + (t % PAGE_SIZE) * NG, ok);
    for (var g = 0u; g < NG; g++) {
        vp[g] = 0u;
    }
    if (ok) {
        for (var g = 0u; g < NG; g++) {
            vp[g] = codec_word(w0 + g);
        }
    }
    return vp;
}

// This invocation's value-phase code words (word db of TPL tokens). A token that is not a live
// compressed one reads another word instead, without a branch: its probability is 0, and any
// code word decodes to finite f16 values, so it adds nothing. Where NS divides PAGE_SIZE
// (VPAGE), token j lies in page j / JP of the tile, at slot ts + NS (j % JP): the page's base is
// found once per page, not once per word, and a slot past the page's fill reads its own place in
// the page (word db of the first vec4s where the page is not a live compressed one).
fn tile_vw(c0: u32, t: u32, n_live: u32) -> array<u32, TPL> {
    var vw: array<u32, TPL>;
    let ts = t / LPR;
    let db = t % LPR;
    if (VPAGE) {
        //!unroll
        for (var k = 0u; k < VPG; k++) {
            let c = c0 + k;
            let cc = min(c, MAX_SLOTS - 1u);
            let pg = chunk_page[cc];
            let live = c < n_live && pg >= geo.n_pages;
            // vec4 index of word db of slot ts (rows and the page's V codes start on whole vec4s).
            // Slots past the page's fill are read too (inside the page, so any word; their
            // probability is 0): no compare and select per word.
            let b4 = select(0u, ((pg - geo.n_pages) * CPW + VC_OFF + ts * RW) / 4u, live) + db / 4u;
            let step = select(0u, NS * RW / 4u, live);
            //!unroll
            for (var jj = 0u; jj < JP; jj++) {
                vw[k * JP + jj] = codec_kv[b4 + step * jj][db & 3u];
            }
        }
    } else {
        //!unroll
        for (var j = 0u; j < TPL; j++) {
            let tau = ts + NS * j;
            let c = c0 + tau / PAGE_SIZE;
            let s = tau % PAGE_SIZE;
            let cc = min(c, MAX_SLOTS - 1u);
            let pg = chunk_page[cc];
            let ok = c < n_live && s < chunk_fill[cc] && pg >= geo.n_pages;
            vw[j] = codec_word(select(0u, (pg - geo.n_pages) * CPW + VC_OFF + s * RW + db, ok));
        }
    }
    return vw;
}

// The entry g of per-value-group values, by selects (a dynamic index would send the array to
// local memory).
fn pick_g(a: array<f32, NG>, g: u32) -> f32 {
    var r = a[0];
    for (var i = 1u; i < NG; i++) {
        r = select(r, a[i], g == i);
    }
    return r;
}

// This invocation's token's probabilities (against the references m_ref) into ps_sh: p times
// its value scale and the f16 terms' scale, as f16 pairs per (value group, head quad); raw
// tokens: p itself in f32, in group 0.
fn put_probs(t: u32, p: array<f32, GROUP>, raw: bool, s_a: array<f32, NG>, sc16: array<f32, NG>) {
    for (var g = 0u; g < NG; g++) {
        for (var q = 0u; q < GQ; q++) {
            var wv = vec4<u32>(0u);
            for (var e = 0u; e < 4u; e++) {
                let h = 4u * q + e;
                if (h < GROUP) {
                    if (raw) {
                        wv[e] = select(0u, bitcast<u32>(p[h]), g == 0u);
                    } else {
                        wv[e] = pack2x16float(vec2<f32>(p[h] * s_a[g] * sc16[g]));
                    }
                }
            }
            ps_sh[(t * NG + g) * GQ + q] = wv;
        }
    }
}

fn probs(x: array<f32, GROUP>, m_ref: array<f32, GROUP>, valid: bool) -> array<f32, GROUP> {
    var p: array<f32, GROUP>;
    for (var h = 0u; h < GROUP; h++) {
        p[h] = softmax_prob(x[h], m_ref[h], valid);
    }
    return p;
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
        atomicStore(&flag_sh, 0u);
        atomicStore(&codec_sh, 0u);
        atomicStore(&raw_sh, 0u);
        magic_sh = vec4<u32>(select(0x64006400u, 0x14001400u, DENORM), 0x54005400u, 0x80808080u, 0u);
    }
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
                atomicAdd(&codec_sh, 1u);
            } else if (RAW && in_window(window, page)) {
                fill = page_meta[page].fill;
                atomicAdd(&raw_sh, 1u);
            }
        }
        list_page[c] = page;
        list_fill[c] = fill;
        chunk_page[c] = page;
        chunk_fill[c] = fill;
        chunk_pos[c] = c;
    }
    workgroupBarrier();
    // The chunk's compressed pages first, in order, then (from the next tile on, so that a tile
    // holds one kind) its raw pages; pages elsewhere skipped. A chunk of compressed pages alone
    // stays as loaded.
    if (t == 0u) {
        let n_codec = atomicLoad(&codec_sh);
        let n_raw = atomicLoad(&raw_sh);
        var rs = n_codec;
        if (n_codec < params.chunk_pages) {
            rs = select(n_codec, (n_codec + PPT - 1u) / PPT * PPT, n_raw > 0u);
            var k = 0u;
            var r = rs;
            for (var c = 0u; c < params.chunk_pages; c++) {
                if (list_fill[c] > 0u) {
                    let at = select(r, k, list_page[c] >= geo.n_pages);
                    chunk_page[at] = list_page[c];
                    chunk_fill[at] = list_fill[c];
                    chunk_pos[at] = c;
                    if (list_page[c] >= geo.n_pages) {
                        k++;
                    } else {
                        r++;
                    }
                }
            }
            for (var c = n_codec; c < rs; c++) {
                chunk_fill[c] = 0u;
            }
        }
        raw_start_sh = rs;
        slots_sh = rs + n_raw;
    }
    let n_live = workgroupUniformLoad(&slots_sh);
    let raw_start = workgroupUniformLoad(&raw_start_sh);
    if (n_live == 0u) {
        write_chunk_empty(t, GROUP, seq, kvh, buffer, chunk, HEAD_DIM);
        return;
    }
    let q0 = (seq * params.q_heads + kvh * GROUP) * HEAD_DIM;
    for (var e = t; e < GROUP * D4; e += WG) {
        let d = q0 + 4u * e;
        q_sh[e] = vec4<f32>(queries[d], queries[d + 1u], queries[d + 2u], queries[d + 3u]) * params.scale;
    }
    workgroupBarrier();

    // The exponent bits of the value codes' conversions, read from workgroup memory so that
    // they sit in a register the driver cannot see through: with both constants immediate, each
    // (w & mask) | bits took two logic instructions on an H200 (an instruction takes one
    // immediate); from a register, one. 64 fewer instructions per tile, 2.5% of the time. The
    // same for KSIGNED's (w ^ 0x80808080) & 0xf0f0f0f0 (magic.z).
    let magic = magic_sh;
    let ts = t / LPR;         // value phase: this invocation's token stream
    let db = t % LPR;         // value phase: its code word (dimensions 8 db .. 8 db + 7)
    let my_g = (8u * db) / VG;

    var m_ref: array<f32, GROUP>;
    var lsum: array<f32, GROUP>;
    var s_ref: array<f32, NG>;
    var sc16: array<f32, NG>;             // KSCALE / s_ref (0 while s_ref is 0)
    var minacc: array<f32, GROUP * NG>;   // [h * NG + g]: sum of p * min over this token lane
    var acc16: array<vec2<f16>, GROUP * 4>;  // [h * 4 + k]: dimensions (k, k + 4) of the word
    var acc32: array<vec2<f32>, GROUP * 4u>;
    for (var h = 0u; h < GROUP; h++) {
        m_ref[h] = NEG_BIG;
        lsum[h] = 0.0;
        for (var k = 0u; k < 4u; k++) {
            acc16[h * 4u + k] = vec2<f16>(0.0h);
            acc32[h * 4u + k] = vec2<f32>(0.0);
        }
        for (var g = 0u; g < NG; g++) {
            minacc[h * NG + g] = 0.0;
        }
    }
    for (var g = 0u; g < NG; g++) {
        s_ref[g] = 0.0;
        sc16[g] = 0.0;
    }

    let n_tiles = (n_live + PPT - 1u) / PPT;
    for (var tile = 0u; tile < n_tiles; tile++) {
        let c0 = tile * PPT;
        let tile_raw = RAW && c0 >= raw_start;  // the tile holds raw pages only
        // This invocation's token for the score phase, and its loads.
        let p_in = t / PAGE_SIZE;
        let slot = t % PAGE_SIZE;
        let ca = min(c0 + p_in, MAX_SLOTS - 1u);
        var fill_a = 0u;
        if (c0 + p_in < n_live) {
            fill_a = chunk_fill[ca];
        }
        let page_a = chunk_page[ca];
        let valid = slot < fill_a;
        let raw_a = page_a < geo.n_pages;
        // This tile's loads, issued before anything waits on them (the fold's key parameters
        // follow in the fold). (Issuing the next tile's
        // during this one, each after its registers' last use, was slower on an H200: 0.406
        // against 0.331 ms at b8 x 32768, pages of 32, the registers carried across tiles.)
        var kw = tile_kw(c0, t, n_live);
        var vprm = tile_vprm(c0, t, n_live);
        var vw = tile_vw(c0, t, n_live);
        // Fold: item = (page, head, FC-channel slice); NSL neighbouring lanes share (page, head).
        for (var k = 0u; k < select(IPL, 0u, tile_raw); k++) {
            let it = t + WG * k;
            let pi = min(it / (GROUP * NSL), PPT - 1u);
            let h = (it / NSL) % GROUP;
            let sl = it % NSL;
            let cc = min(c0 + pi, MAX_SLOTS - 1u);
            let pg = chunk_page[cc];
            let live = it < ITEMS && c0 + pi < n_live && pg >= geo.n_pages;
            let cb4 = select(0u, (pg - geo.n_pages) * (CPW / 4u), live);
            var qs: array<vec4<f32>, FV>;
            var bias = 0.0;
            var fsum = 0.0;
            var mx = 0.0;
            for (var v = 0u; v < FV; v++) {
                let kv = codec_kv[cb4 + FV * sl + v];  // (min, scale) f16 pairs of channels FC sl + 4 v ..
                let qv = q_sh[h * D4 + FV * sl + v];
                let p0 = unpack2x16float(kv.x);
                let p1 = unpack2x16float(kv.y);
                let p2 = unpack2x16float(kv.z);
                let p3 = unpack2x16float(kv.w);
                qs[v] = qv * vec4<f32>(p0.y, p1.y, p2.y, p3.y);
                bias += dot(qv, vec4<f32>(p0.x, p1.x, p2.x, p3.x));
                fsum += dot(qs[v], vec4<f32>(1.0));
                let a = abs(qs[v]);
                mx = max(mx, max(max(a.x, a.y), max(a.z, a.w)));
            }
            for (var mask = 1u; mask < NSL; mask = mask * 2u) {
                mx = max(mx, subgroupShuffleXor(mx, mask));
            }
            // alpha = 2^(E - 6), E the exponent of the page's largest |q * scale| (at least -120):
            // every q * scale / alpha lies in (-128, 128); rounded to nearest even, at most 127,
            // then 1.5 * 2^23 added exactly so that the sum's low byte is the signed code.
            let ex = max(i32((bitcast<u32>(mx) >> 23u) & 0xffu) - 127, -120);
            let step = pow2(6 - ex);
            let alpha = pow2(ex - 6);
            var q8e: array<u32, FW>;
            var q8o: array<u32, FW>;
            for (var w = 0u; w < FW; w++) {
                q8e[w] = 0u;
                q8o[w] = 0u;
            }
            var qsum = 0;
            for (var v = 0u; v < FV; v++) {
                let x = bitcast<vec4<u32>>(round(min(qs[v] * step, vec4<f32>(127.0))) + vec4<f32>(12582912.0));
                let b = x & vec4<u32>(0xffu);
                // Channels 4 v .. 4 v + 3 of the slice: code word v / 2, nibbles 4 (v % 2) ..; the
                // even nibbles' bytes in one word, the odd ones' in the other.
                let sh = (v % 2u) * 16u;
                q8e[v / 2u] |= (b.x | (b.z << 8u)) << sh;
                q8o[v / 2u] |= (b.y | (b.w << 8u)) << sh;
                let iv = bitcast<vec4<i32>>(x - vec4<u32>(0x4b400000u));
                if (KSIGNED) {
                    qsum += iv.x + iv.z;
                } else {
                    qsum += iv.x + iv.y + iv.z + iv.w;
                }
            }
            // Score = alpha * q8 . code + q . min + 8 (sum q * scale - alpha * sum q8), which is
            // the reference's alpha * q8 . (code - 8) + q . min + 8 sum q * scale. With KSIGNED
            // the odd channels' products come as 16 q8 (code - 8): the sum is over the even
            // channels alone, and alpha / 16 multiplies 16 times the sums.
            bias += 8.0 * (fsum - alpha * f32(qsum));
            for (var mask = 1u; mask < NSL; mask = mask * 2u) {
                bias += subgroupShuffleXor(bias, mask);
            }
            if (live) {
                for (var w = 0u; w < FW; w++) {
                    let idx = pi * QPS + (FW * sl + w) * GP + h / 2u;
                    q8_sh[idx][2u * (h % 2u)] = q8e[w];
                    q8_sh[idx][2u * (h % 2u) + 1u] = q8o[w];
                }
                if (sl == 0u) {
                    // (With KSIGNED, alpha / 16 is an f32 subnormal for E below -116: a page whose
                    // |q * scale| are all below 2^-116, whose code term, below 1e-33, a device
                    // that flushes f32 subnormals drops.)
                    ab_sh[pi * GROUP + h] = vec2<f32>(select(alpha, alpha * 0.0625, KSIGNED), bias);
                }
            }
        }
        workgroupBarrier();

        // Scores: the whole key row in this invocation.
        var x: array<f32, GROUP>;
        for (var h = 0u; h < GROUP; h++) {
            x[h] = NEG_BIG;
        }
        if (valid) {
            if (RAW && raw_a) {
                let row = (page_a - window.first_page) * PAGE_W4 + slot * VW4;
                for (var h = 0u; h < GROUP; h++) {
                    x[h] = 0.0;
                }
                for (var i = 0u; i < HEAD_DIM / 8u; i++) {
                    let w = pool[row + i];
                    let k0 = vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
                    let k1 = vec4<f32>(unpack2x16float(w.z), unpack2x16float(w.w));
                    for (var h = 0u; h < GROUP; h++) {
                        x[h] += dot(q_sh[h * D4 + 2u * i], k0) + dot(q_sh[h * D4 + 2u * i + 1u], k1);
                    }
                }
            } else {
                var isum: array<i32, GROUP>;
                var ihi: array<i32, GROUP>;  // KSIGNED: the odd channels' 16 q8 (code - 8)
                for (var h = 0u; h < GROUP; h++) {
                    isum[h] = 0;
                    ihi[h] = 0;
                }
                for (var i = 0u; i < RW4; i++) {
                    if (KSIGNED) {
                        // Two code words at a time, so that each sum takes one add of two products.
                        for (var e = 0u; e < 4u; e += 2u) {
                            let w0 = kw[i][e];
                            let w1 = kw[i][e + 1u];
                            let lo0 = w0 & 0x0f0f0f0fu;
                            let lo1 = w1 & 0x0f0f0f0fu;
                            let hi0 = (w0 ^ magic.z) & 0xf0f0f0f0u;
                            let hi1 = (w1 ^ magic.z) & 0xf0f0f0f0u;
                            for (var hp = 0u; hp < GP; hp++) {
                                let q0 = q8_sh[p_in * QPS + (4u * i + e) * GP + hp];
                                let q1 = q8_sh[p_in * QPS + (4u * i + e + 1u) * GP + hp];
                                isum[2u * hp] += dot4I8Packed(q0.x, lo0) + dot4I8Packed(q1.x, lo1);
                                ihi[2u * hp] += dot4I8Packed(q0.y, hi0) + dot4I8Packed(q1.y, hi1);
                                if (2u * hp + 1u < GROUP) {
                                    isum[2u * hp + 1u] += dot4I8Packed(q0.z, lo0) + dot4I8Packed(q1.z, lo1);
                                    ihi[2u * hp + 1u] += dot4I8Packed(q0.w, hi0) + dot4I8Packed(q1.w, hi1);
                                }
                            }
                        }
                    } else {
                        for (var e = 0u; e < 4u; e++) {
                            let w = kw[i][e];
                            let lo = w & 0x0f0f0f0fu;
                            let hi = (w >> 4u) & 0x0f0f0f0fu;
                            for (var hp = 0u; hp < GP; hp++) {
                                let qv = q8_sh[p_in * QPS + (4u * i + e) * GP + hp];
                                // (Each product added on its own, `s = dot4I8Packed(a, b) + s`, compiles to
                                // the same IDP with a zero accumulator and an add on an H200.)
                                isum[2u * hp] += dot4I8Packed(qv.x, lo) + dot4I8Packed(qv.y, hi);
                                if (2u * hp + 1u < GROUP) {
                                    isum[2u * hp + 1u] += dot4I8Packed(qv.z, lo) + dot4I8Packed(qv.w, hi);
                                }
                            }
                        }
                    }
                }
                for (var h = 0u; h < GROUP; h++) {
                    let ab = ab_sh[p_in * GROUP + h];
                    // KSIGNED: 16 (q8 . code) over the even channels plus the odd ones' sum, exact
                    // in i32 and in f32 (below 2^22: 16 x 64 x 127 x 15 plus 64 x 127 x 128).
                    let s = select(isum[h], (isum[h] << 4u) + ihi[h], KSIGNED);
                    x[h] = ab.x * f32(s) + ab.y;
                }
            }
            if (params.write_scores != 0u) {
                let pos = (first + chunk_pos[ca]) * PAGE_SIZE + slot;
                for (var h = 0u; h < GROUP; h++) {
                    scores[(seq * params.q_heads + kvh * GROUP + h) * params.max_tokens + pos] = x[h];
                }
            }
        }
        var s_a: array<f32, NG>;  // this token's value scales
        var need = false;
        for (var g = 0u; g < NG; g++) {
            s_a[g] = unpack2x16float(vprm[g]).y;
            need = need || s_a[g] > s_ref[g];
        }
        for (var h = 0u; h < GROUP; h++) {
            need = need || x[h] > m_ref[h] + SLACK;
        }
        if (subgroupAny(need) && sg_lane == 0u) {
            atomicOr(&flag_sh, 1u);
        }
        let raw_p = RAW && raw_a;
        var p: array<f32, GROUP>;
        if (PS_EARLY) {
            p = probs(x, m_ref, valid);
            put_probs(t, p, raw_p, s_a, sc16);
        }
        if (workgroupUniformLoad(&flag_sh) != 0u) {
            // Some reference moves: the tile's maxima over the workgroup, then the sums so far are
            // moved to f32 and rescaled to the new maxima.
            var red: array<f32, NRED>;
            for (var h = 0u; h < GROUP; h++) {
                red[h] = x[h];
            }
            for (var g = 0u; g < NG; g++) {
                red[GROUP + g] = s_a[g];
            }
            for (var i = 0u; i < NRED; i++) {
                let r = subgroupMax(red[i]);
                if (sg_lane == 0u) {
                    red_sh[sg_id * NRED + i] = r;
                }
            }
            workgroupBarrier();
            let n_sg = (WG + sg_size - 1u) / sg_size;
            for (var i = 0u; i < NRED; i++) {
                var r = red_sh[i];
                for (var k = 1u; k < n_sg; k++) {
                    r = max(r, red_sh[k * NRED + i]);
                }
                red[i] = r;
            }
            var corr: array<f32, GROUP>;
            for (var h = 0u; h < GROUP; h++) {
                let mv = softmax_move(m_ref[h], lsum[h], red[h]);
                corr[h] = mv.corr;
                m_ref[h] = mv.m;
                lsum[h] = mv.l;
                for (var g = 0u; g < NG; g++) {
                    minacc[h * NG + g] *= corr[h];
                }
            }
            let fl = pick_g(s_ref, my_g) * KINV * code_unit();
            for (var h = 0u; h < GROUP; h++) {
                for (var k = 0u; k < 4u; k++) {
                    acc32[h * 4u + k] = (acc32[h * 4u + k] + vec2<f32>(acc16[h * 4u + k]) * fl) * corr[h];
                    acc16[h * 4u + k] = vec2<f16>(0.0h);
                }
            }
            for (var g = 0u; g < NG; g++) {
                // Headroom of 2: a later scale up to twice this tile's largest moves nothing.
                if (red[GROUP + g] > s_ref[g]) {
                    s_ref[g] = 2.0 * red[GROUP + g];
                }
                sc16[g] = select(0.0, KSCALE / s_ref[g], s_ref[g] > 0.0);
            }
            if (PS_EARLY) {
                // The early probabilities were against the old references: again, behind a
                // barrier (every invocation is here).
                p = probs(x, m_ref, valid);
                put_probs(t, p, raw_p, s_a, sc16);
                workgroupBarrier();
            }
        }

        // Probabilities against the (possibly moved) references: into this invocation's sums,
        // and (unless PS_EARLY wrote them already) into workgroup memory.
        if (!PS_EARLY) {
            p = probs(x, m_ref, valid);
        }
        for (var h = 0u; h < GROUP; h++) {
            lsum[h] += p[h];
        }
        if (!raw_p) {
            for (var g = 0u; g < NG; g++) {
                let mins = unpack2x16float(vprm[g]).x;
                for (var h = 0u; h < GROUP; h++) {
                    minacc[h * NG + g] += p[h] * mins;
                }
            }
        }
        if (!PS_EARLY) {
            put_probs(t, p, raw_p, s_a, sc16);
            workgroupBarrier();
        }

        // Values: this invocation's code word of TPL tokens.
        if (tile_raw) {
            // Raw tokens: their f16 values times p, in f32.
            for (var j = 0u; j < TPL; j++) {
                let tau = ts + NS * j;
                let c = c0 + tau / PAGE_SIZE;
                let s = tau % PAGE_SIZE;
                let cc = min(c, MAX_SLOTS - 1u);
                var f = 0u;
                if (c < n_live) {
                    f = chunk_fill[cc];
                }
                if (s < f) {
                    let w = pool[(chunk_page[cc] - window.first_page) * PAGE_W4 + V_OFF4 + s * VW4 + db];
                    let v01 = unpack2x16float(w.x);
                    let v23 = unpack2x16float(w.y);
                    let v45 = unpack2x16float(w.z);
                    let v67 = unpack2x16float(w.w);
                    for (var q = 0u; q < GQ; q++) {
                        let pw = ps_sh[(tau * NG) * GQ + q];
                        for (var e = 0u; e < 4u; e++) {
                            let h = 4u * q + e;
                            if (h < GROUP) {
                                let pf = bitcast<f32>(pw[e]);
                                acc32[h * 4u] += pf * vec2<f32>(v01.x, v45.x);
                                acc32[h * 4u + 1u] += pf * vec2<f32>(v01.y, v45.y);
                                acc32[h * 4u + 2u] += pf * vec2<f32>(v23.x, v67.x);
                                acc32[h * 4u + 3u] += pf * vec2<f32>(v23.y, v67.y);
                            }
                        }
                    }
                }
            }
        } else {
            //!unroll
            for (var j = 0u; j < TPL; j++) {
                let tau = ts + NS * j;
                // Codes as exact f16 pairs: (w & 0x000f000f) | 0x6400 pairs is 1024 + code, and
                // (w & 0x00f000f0) | 0x5400 pairs is 64 + code (mantissa step 1/16); nibbles (k, k + 4).
                let w = vw[j];
                let w8 = w >> 8u;
                var cw: array<vec2<f16>, 4>;
                if (DENORM) {
                    // Every code as code x 2^-20: bits 4..7 of a half are that subnormal f16 as
                    // they lie; bits 0..3 under the exponent of 2^-10 are 2^-10 + code x 2^-20.
                    cw[0] = h2((w & 0x000f000fu) | magic.x) - vec2<f16>(0.0009765625h);
                    cw[1] = h2(w & 0x00f000f0u);
                    cw[2] = h2((w8 & 0x000f000fu) | magic.x) - vec2<f16>(0.0009765625h);
                    cw[3] = h2(w8 & 0x00f000f0u);
                } else {
                    cw[0] = h2((w & 0x000f000fu) | magic.x) - vec2<f16>(1024.0h);
                    cw[1] = h2((w & 0x00f000f0u) | magic.y) - vec2<f16>(64.0h);
                    cw[2] = h2((w8 & 0x000f000fu) | magic.x) - vec2<f16>(1024.0h);
                    cw[3] = h2((w8 & 0x00f000f0u) | magic.y) - vec2<f16>(64.0h);
                }
                for (var q = 0u; q < GQ; q++) {
                    let pw = ps_sh[(tau * NG + my_g) * GQ + q];
                    for (var e = 0u; e < 4u; e++) {
                        let h = 4u * q + e;
                        if (h < GROUP) {
                            let ps = h2(pw[e]);
                            for (var k = 0u; k < 4u; k++) {
                                acc16[h * 4u + k] = fma(ps, cw[k], acc16[h * 4u + k]);
                            }
                        }
                    }
                }
            }
        }
        if (tile % FLUSH == FLUSH - 1u) {
            let fl = pick_g(s_ref, my_g) * KINV * code_unit();
            for (var i = 0u; i < GROUP * 4u; i++) {
                acc32[i] += vec2<f32>(acc16[i]) * fl;
                acc16[i] = vec2<f16>(0.0h);
            }
        }
        if (t == 0u) {
            // Every invocation has read the flag: where it was set, barriers followed the read
            // (the rescale's); elsewhere it is 0 already. The next tile's atomicOr calls come after
            // its fold barrier.
            atomicStore(&flag_sh, 0u);
        }
    }
    let fl = pick_g(s_ref, my_g) * KINV * code_unit();
    for (var i = 0u; i < GROUP * 4u; i++) {
        acc32[i] += vec2<f32>(acc16[i]) * fl;
    }

    // Sums over the token lanes: l per head, p * min per (head, group).
    var sums: array<f32, NSUM>;
    for (var h = 0u; h < GROUP; h++) {
        sums[h] = lsum[h];
    }
    for (var i = 0u; i < GROUP * NG; i++) {
        sums[GROUP + i] = minacc[i];
    }
    workgroupBarrier();
    for (var i = 0u; i < NSUM; i++) {
        let r = subgroupAdd(sums[i]);
        if (sg_lane == 0u) {
            red_sh[sg_id * NSUM + i] = r;
        }
    }
    workgroupBarrier();
    let n_sg = (WG + sg_size - 1u) / sg_size;
    for (var i = 0u; i < NSUM; i++) {
        var r = 0.0;
        for (var k = 0u; k < n_sg; k++) {
            r += red_sh[k * NSUM + i];
        }
        sums[i] = r;
    }
    // The token streams' value sums, one stream at a time, into q_sh (the queries are done).
    for (var r = 0u; r < NS; r++) {
        if (ts == r) {
            for (var h = 0u; h < GROUP; h++) {
                let lo = vec4<f32>(acc32[h * 4u].x, acc32[h * 4u + 1u].x, acc32[h * 4u + 2u].x, acc32[h * 4u + 3u].x);
                let hi = vec4<f32>(acc32[h * 4u].y, acc32[h * 4u + 1u].y, acc32[h * 4u + 2u].y, acc32[h * 4u + 3u].y);
                let a = h * D4 + 2u * db;
                if (r == 0u) {
                    q_sh[a] = lo;
                    q_sh[a + 1u] = hi;
                } else {
                    q_sh[a] += lo;
                    q_sh[a + 1u] += hi;
                }
            }
        }
        workgroupBarrier();
    }
    for (var e = t; e < GROUP * D4; e += WG) {
        let h = e / D4;
        let g = (4u * (e % D4)) / VG;
        let o = partial_at(seq, kvh * GROUP + h, buffer, chunk, HEAD_DIM) + 4u + 4u * (e % D4);
        let a = q_sh[e] + vec4<f32>(sums[GROUP + h * NG + g]);
        write_partial_acc4(o, a);
    }
    if (t < GROUP) {
        // This head's maximum and sum, by selects (indexed by t, the arrays would go to local memory).
        var m = m_ref[0];
        var l = sums[0];
        for (var h = 1u; h < GROUP; h++) {
            m = select(m, m_ref[h], t == h);
            l = select(l, sums[h], t == h);
        }
        write_partial_stats(partial_at(seq, kvh * GROUP + t, buffer, chunk, HEAD_DIM), m, l);
    }
}
