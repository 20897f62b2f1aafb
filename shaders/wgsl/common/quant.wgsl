// Weight blocks of the model's matrices as the GPU holds them (ggml's layouts, one row of a
// matrix after the other). The importer declares `FORMAT` and `weight_word(i)`, word `i` of the
// matrix's buffer.
//   F32:  32 words, the values.
//   Q8_0: 9 words: the f16 scale d in the low half of word 0, then 32 signed bytes q;
//         w = d x q. (ggml's block is 34 bytes; the upload pads it to 36 so words align.)
//   Q4_1: 5 words, ggml's block as is: f16 d (low half) and f16 m (high half) of word 0, then 16
//         bytes whose low nibbles are weights 0..15 and high nibbles weights 16..31; w = d x q + m.
//   F16, BF16: 16 words, two weights each (the low half first).
//   Q4_0: 5 words: f16 d in the low half of word 0 (ggml's 18-byte block padded to 20), then 16
//         bytes as Q4_1's; w = d x (q - 8).
//   Q4_K, Q5_K, Q6_K: super-blocks of 256 weights (36, 44 and 53 words: ggml's 144, 176 and
//         210 bytes, Q6_K's padded to 212), read 32 weights at a time; the layouts are ggml's
//         (`block_q4_K` etc.), decoded as `dequantize_row_q4_K` does.

//!expects const FORMAT: u32 = 0u;
//!expects fn weight_word(i: u32) -> u32 { return i; }

const FORMAT_F32: u32 = 0u;
const FORMAT_Q8_0: u32 = 1u;
const FORMAT_Q4_1: u32 = 2u;
const FORMAT_F16: u32 = 3u;
const FORMAT_BF16: u32 = 4u;
const FORMAT_Q4_0: u32 = 5u;
const FORMAT_Q4_K: u32 = 6u;
const FORMAT_Q5_K: u32 = 7u;
const FORMAT_Q6_K: u32 = 8u;

// Words of one block (a super-block for the K-quants).
fn block_words(format: u32) -> u32 {
    switch format {
        case 1u: {
            return 9u;
        }
        case 2u, 5u: {
            return 5u;
        }
        case 3u, 4u: {
            return 16u;
        }
        case 6u: {
            return 36u;
        }
        case 7u: {
            return 44u;
        }
        case 8u: {
            return 53u;
        }
        default: {
            return 32u;
        }
    }
}

// Weights of one block: 32, or 256 for the K-quants.
fn block_weights(format: u32) -> u32 {
    return select(32u, 256u, format >= FORMAT_Q4_K);
}

// Byte `i` (0..) of the words from `base` on, as an unsigned value.
fn byte_at(w: u32, i: u32) -> u32 {
    return (w >> (8u * (i % 4u))) & 255u;
}

// Byte `off` of the block whose first word is `base`.
fn block_byte(base: u32, off: u32) -> u32 {
    return byte_at(weight_word(base + off / 4u), off % 4u);
}

// A K-quant's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4); the 12 scale bytes
// start at byte 4 of the super-block.
fn scale_min_k4(base: u32, j: u32) -> vec2<f32> {
    if (j < 4u) {
        return vec2<f32>(f32(block_byte(base, 4u + j) & 63u), f32(block_byte(base, 8u + j) & 63u));
    }
    let q = block_byte(base, 8u + j);
    let sc = (q & 15u) | ((block_byte(base, j) >> 6u) << 4u);
    let m = (q >> 4u) | ((block_byte(base, 4u + j) >> 6u) << 4u);
    return vec2<f32>(f32(sc), f32(m));
}

// Where 32-weight block `blk` of row `row` (of `cols` columns) sits: the first word of its block
// (a K-quant's super-block) and which 32 weights of that block it is.
fn block_at(row: u32, blk: u32, cols: u32) -> vec2<u32> {
    let per_block = block_weights(FORMAT) / 32u;
    return vec2<u32>((row * (cols / block_weights(FORMAT)) + blk / per_block) * block_words(FORMAT), blk % per_block);
}

// Weights 32 blk .. 32 blk + 31 of row `row` of a matrix of `cols` columns (a multiple of the
// format's block), dequantised.
fn weights32(row: u32, blk: u32, cols: u32) -> array<f32, 32> {
    var wv: array<f32, 32>;
    let at = block_at(row, blk, cols);
    let base = at.x;
    let sub = at.y;
    switch FORMAT {
        case 1u: {
            let d = unpack2x16float(weight_word(base)).x;
            for (var k = 0u; k < 32u; k++) {
                let q = i32(byte_at(weight_word(base + 1u + k / 4u), k % 4u) << 24u) >> 24u;
                wv[k] = d * f32(q);
            }
        }
        case 2u, 5u: {
            let dm = unpack2x16float(weight_word(base));
            for (var k = 0u; k < 16u; k++) {
                let q = byte_at(weight_word(base + 1u + k / 4u), k % 4u);
                if (FORMAT == FORMAT_Q4_1) {
                    wv[k] = dm.x * f32(q & 15u) + dm.y;
                    wv[16u + k] = dm.x * f32(q >> 4u) + dm.y;
                } else {
                    wv[k] = dm.x * (f32(q & 15u) - 8.0);
                    wv[16u + k] = dm.x * (f32(q >> 4u) - 8.0);
                }
            }
        }
        case 3u: {
            for (var k = 0u; k < 16u; k++) {
                let p = unpack2x16float(weight_word(base + k));
                wv[2u * k] = p.x;
                wv[2u * k + 1u] = p.y;
            }
        }
        case 4u: {
            for (var k = 0u; k < 16u; k++) {
                let word = weight_word(base + k);
                wv[2u * k] = bitcast<f32>(word << 16u);
                wv[2u * k + 1u] = bitcast<f32>(word & 0xffff0000u);
            }
        }
        case 6u, 7u: {
            // Sub-block `sub` of the super-block: its 32 weights are the low (even sub-block) or
            // high (odd) nibbles of the 32 bytes qs[32 (sub / 2) ..]; Q5_K adds bit `sub` of
            // qh[l] as 16.
            let dd = unpack2x16float(weight_word(base));
            let sm = scale_min_k4(base, sub);
            let scale = dd.x * sm.x;
            let offset = dd.y * sm.y;
            let qs = select(16u, 48u, FORMAT == FORMAT_Q5_K) + 32u * (sub / 2u);
            let shift = 4u * (sub % 2u);
            for (var l = 0u; l < 32u; l++) {
                var q = f32((block_byte(base, qs + l) >> shift) & 15u);
                if (FORMAT == FORMAT_Q5_K && ((block_byte(base, 16u + l) >> sub) & 1u) != 0u) {
                    q += 16.0;
                }
                wv[l] = scale * q - offset;
            }
        }
        case 8u: {
            // Q6_K: ql[128], qh[64], 16 int8 scales, f16 d at byte 208. Sub-block `sub` is half
            // n = sub / 4, quarter r = sub % 4 of it: low bits from ql[64 n + 32 (r % 2) + l]
            // (nibble r / 2), high bits 2r of qh[32 n + l], scale 8 n + l / 16 + 2 r.
            let d = unpack2x16float(weight_word(base + 52u)).x;
            let n = sub / 4u;
            let r = sub % 4u;
            for (var l = 0u; l < 32u; l++) {
                let lo = (block_byte(base, 64u * n + 32u * (r % 2u) + l) >> (4u * (r / 2u))) & 15u;
                let hi = (block_byte(base, 128u + 32u * n + l) >> (2u * r)) & 3u;
                let q = i32(lo | (hi << 4u)) - 32;
                let sc = i32(block_byte(base, 192u + 8u * n + l / 16u + 2u * r) << 24u) >> 24u;
                wv[l] = d * f32(sc) * f32(q);
            }
        }
        default: {
            for (var k = 0u; k < 32u; k++) {
                wv[k] = bitcast<f32>(weight_word(base + k));
            }
        }
    }
    return wv;
}

// Weights 4 j .. 4 j + 3 (j < 8) of the 32 weights `weights32(row, blk, cols)` returns,
// dequantised alone: consecutive invocations taking consecutive quarters of a block read
// consecutive words of it and of the input (the products' coalesced loop).
fn weights4(row: u32, blk: u32, j: u32, cols: u32) -> vec4<f32> {
    let at = block_at(row, blk, cols);
    let base = at.x;
    let sub = at.y;
    switch FORMAT {
        case 1u: {
            // Q8_0: the quarter's 4 signed bytes are word 1 + j.
            let d = unpack2x16float(weight_word(base)).x;
            let w = weight_word(base + 1u + j);
            let q = vec4<i32>(i32(w << 24u), i32(w << 16u), i32(w << 8u), i32(w)) >> vec4<u32>(24u);
            return d * vec4<f32>(q);
        }
        case 2u, 5u: {
            // Q4_1 / Q4_0: weights 4j.. are the low (j < 4) or high nibbles of bytes 4 (j % 4)..
            let dm = unpack2x16float(weight_word(base));
            let w = weight_word(base + 1u + j % 4u) >> (4u * (j / 4u));
            let q = vec4<f32>(vec4<u32>(w, w >> 8u, w >> 16u, w >> 24u) & vec4<u32>(15u));
            if (FORMAT == FORMAT_Q4_1) {
                return dm.x * q + dm.y;
            }
            return dm.x * (q - 8.0);
        }
        case 3u: {
            let a = unpack2x16float(weight_word(base + 2u * j));
            let b = unpack2x16float(weight_word(base + 2u * j + 1u));
            return vec4<f32>(a, b);
        }
        case 4u: {
            let a = weight_word(base + 2u * j);
            let b = weight_word(base + 2u * j + 1u);
            return vec4<f32>(bitcast<f32>(a << 16u), bitcast<f32>(a & 0xffff0000u), bitcast<f32>(b << 16u), bitcast<f32>(b & 0xffff0000u));
        }
        case 6u, 7u: {
            // As weights32: nibble sub % 2 of qs[32 (sub / 2) + l], Q5_K's bit `sub` of qh[l]
            // adding 16, for l = 4j.. (both word-aligned).
            let dd = unpack2x16float(weight_word(base));
            let sm = scale_min_k4(base, sub);
            let qs = select(16u, 48u, FORMAT == FORMAT_Q5_K) + 32u * (sub / 2u);
            let w = weight_word(base + qs / 4u + j) >> (4u * (sub % 2u));
            var q = vec4<f32>(vec4<u32>(w, w >> 8u, w >> 16u, w >> 24u) & vec4<u32>(15u));
            if (FORMAT == FORMAT_Q5_K) {
                let h = weight_word(base + 4u + j) >> sub;
                q += 16.0 * vec4<f32>(vec4<u32>(h, h >> 8u, h >> 16u, h >> 24u) & vec4<u32>(1u));
            }
            return dd.x * sm.x * q - dd.y * sm.y;
        }
        case 8u: {
            // Q6_K, as weights32 for l = 4j..: low bits of ql[64 n + 32 (r % 2) + l], high bits
            // of qh[32 n + l], one scale (l / 16 is the same for the quarter).
            let d = unpack2x16float(weight_word(base + 52u)).x;
            let n = sub / 4u;
            let r = sub % 4u;
            let lo_w = weight_word(base + (64u * n + 32u * (r % 2u)) / 4u + j) >> (4u * (r / 2u));
            let hi_w = weight_word(base + (128u + 32u * n) / 4u + j) >> (2u * r);
            let lo = vec4<u32>(lo_w, lo_w >> 8u, lo_w >> 16u, lo_w >> 24u) & vec4<u32>(15u);
            let hi = vec4<u32>(hi_w, hi_w >> 8u, hi_w >> 16u, hi_w >> 24u) & vec4<u32>(3u);
            let q = vec4<i32>(lo | (hi << vec4<u32>(4u))) - vec4<i32>(32);
            let sc = i32(block_byte(base, 192u + 8u * n + (4u * j) / 16u + 2u * r) << 24u) >> 24u;
            return d * f32(sc) * vec4<f32>(q);
        }
        default: {
            let o = base + 4u * j;
            return vec4<f32>(bitcast<f32>(weight_word(o)), bitcast<f32>(weight_word(o + 1u)), bitcast<f32>(weight_word(o + 2u)), bitcast<f32>(weight_word(o + 3u)));
        }
    }
}
