// Weight blocks of the model's matrices as the GPU holds them (ggml's layouts, one row of a
// matrix after the other): 32 weights per block.
//   F32:  32 words, the values.
//   Q8_0: 9 words: the f16 scale d in the low half of word 0, then 32 signed bytes q;
//         w = d x q. (ggml's block is 34 bytes; the upload pads it to 36 so words align.)
//   Q4_1: 5 words, ggml's block as is: f16 d (low half) and f16 m (high half) of word 0, then 16
//         bytes whose low nibbles are weights 0..15 and high nibbles weights 16..31; w = d x q + m.

const FORMAT_F32: u32 = 0u;
const FORMAT_Q8_0: u32 = 1u;
const FORMAT_Q4_1: u32 = 2u;

fn block_words(format: u32) -> u32 {
    switch format {
        case 1u: {
            return 9u;
        }
        case 2u: {
            return 5u;
        }
        default: {
            return 32u;
        }
    }
}

// Byte `i` (0..) of the words from `base` on, as an unsigned value.
fn byte_at(w: u32, i: u32) -> u32 {
    return (w >> (8u * (i % 4u))) & 255u;
}
