//! The GGUF reader's tests: round trips of every value type, every quant format against
//! hand-built blocks, and hostile files (truncations, lying counts) refused with the byte named.

use super::writer::{GgufWriter, array, string};
use super::*;
use crate::config::LlamaConfig;
use expertkv_core::rng::Rng;

fn f16_bytes(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_bits().to_le_bytes()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * (1.0 + a.abs().max(b.abs()))
}

#[test]
fn gguf_metadata_round_trip_cpu() {
    let nested = array(ValueType::Array, &[array(ValueType::U8, &[vec![1], vec![2]]), array(ValueType::U8, &[])]);
    let mut w = GgufWriter::new();
    w.raw("u8", ValueType::U8, &[200])
        .raw("i8", ValueType::I8, &[0x85])
        .raw("u16", ValueType::U16, &0xbeefu16.to_le_bytes())
        .raw("i16", ValueType::I16, &(-1234i16).to_le_bytes())
        .u32("u32", 4_000_000_000)
        .raw("i32", ValueType::I32, &(-7i32).to_le_bytes())
        .raw("u64", ValueType::U64, &u64::MAX.to_le_bytes())
        .raw("i64", ValueType::I64, &i64::MIN.to_le_bytes())
        .f32("f32", 1.5e-5)
        .raw("f64", ValueType::F64, &std::f64::consts::PI.to_le_bytes())
        .bool("yes", true)
        .bool("no", false)
        .str("text", "héllo, 世界")
        .str("empty", "")
        .strs("words", &["a", "", "Ġthe", "😀"])
        .i32s("ints", &[1, -2, 3])
        .raw("nested", ValueType::Array, &nested);
    let bytes = w.finish();
    let g = Gguf::parse(&bytes).unwrap();
    assert_eq!(g.version(), 3);
    assert_eq!(g.alignment(), DEFAULT_ALIGNMENT);
    assert_eq!(g.data_offset() % 32, 0);
    assert!(g.tensors().is_empty());
    let keys: Vec<&str> = g.metadata().map(|(k, _)| k).collect();
    assert_eq!(
        keys,
        ["u8", "i8", "u16", "i16", "u32", "i32", "u64", "i64", "f32", "f64", "yes", "no", "text", "empty", "words", "ints", "nested"]
    );
    assert_eq!(g.get("u8"), Some(&Value::U8(200)));
    assert_eq!(g.get("i8"), Some(&Value::I8(-123)));
    assert_eq!(g.get("u16"), Some(&Value::U16(0xbeef)));
    assert_eq!(g.get("i16"), Some(&Value::I16(-1234)));
    assert_eq!(g.get_u32("u32").unwrap(), 4_000_000_000);
    assert_eq!(g.get("i32"), Some(&Value::I32(-7)));
    assert_eq!(g.get_u64("u64").unwrap(), u64::MAX);
    assert_eq!(g.get("i64"), Some(&Value::I64(i64::MIN)));
    assert_eq!(g.get_f32("f32").unwrap(), 1.5e-5);
    assert_eq!(g.get("f64"), Some(&Value::F64(std::f64::consts::PI)));
    assert!(g.get_bool("yes").unwrap() && !g.get_bool("no").unwrap());
    assert_eq!(g.get_str("text").unwrap(), "héllo, 世界");
    assert_eq!(g.get_str("empty").unwrap(), "");
    assert_eq!(g.get_array("words").unwrap().to_strs().unwrap(), ["a", "", "Ġthe", "😀"]);
    assert_eq!(g.get_array("ints").unwrap().to_i64s().unwrap(), [1, -2, 3]);
    assert_eq!(g.get_array("ints").unwrap().to_f32s().unwrap(), [1.0, -2.0, 3.0]);
    let outer = g.get_array("nested").unwrap();
    assert_eq!((outer.elem_type(), outer.len()), (ValueType::Array, 2));
    let inner: Vec<Value> = outer.iter().map(Result::unwrap).collect();
    assert_eq!(inner[0].as_array().unwrap().to_i64s().unwrap(), [1, 2]);
    assert!(inner[1].as_array().unwrap().is_empty());
    // Typed getters: wrong type and missing keys are clear errors; `opt` tells them apart.
    assert!(matches!(g.get_u32("i32"), Err(Error::Model(m)) if m.contains("`i32`")));
    assert!(matches!(g.get_str("nope"), Err(Error::Model(m)) if m.contains("missing")));
    assert_eq!(g.opt("nope", Gguf::get_u32).unwrap(), None);
    assert!(g.opt("text", Gguf::get_u32).is_err());
    assert!(g.get_array("words").unwrap().to_i64s().is_err());
    assert!(g.get_array("ints").unwrap().to_strs().is_err());
}

#[test]
fn gguf_tensors_round_trip_cpu() {
    let f32s = [1.0f32, -2.5, 3.25, 0.125, -1e-3, 7.0];
    let f16s: Vec<u8> = [0.5f32, -0.25, 2.0, 65504.0].iter().flat_map(|&x| f16_bytes(x)).collect();
    let mut q8 = Vec::new();
    for blk in 0..2 {
        q8.extend_from_slice(&f16_bytes(0.5 + blk as f32));
        q8.extend((0..32).map(|j| (j as i8 - 16) as u8));
    }
    let q41: Vec<u8> = (0..40u8).map(|i| i.wrapping_mul(37)).collect();
    for alignment in [32u32, 64, 1] {
        let mut w = GgufWriter::new();
        w.alignment(alignment)
            .str("general.architecture", "test")
            .tensor("a.f32", &[3, 2], GgmlType::F32, f32_bytes(&f32s))
            .tensor("b.f16", &[4], GgmlType::F16, f16s.clone())
            .tensor("c.q8_0", &[64], GgmlType::Q8_0, q8.clone())
            .tensor("d.q4_1", &[32, 1, 2], GgmlType::Q4_1, q41.clone());
        let bytes = w.finish();
        let g = Gguf::parse(&bytes).unwrap();
        assert_eq!(g.alignment(), u64::from(alignment));
        assert_eq!(g.data_offset() % u64::from(alignment), 0);
        let names: Vec<&str> = g.tensors().iter().map(TensorInfo::name).collect();
        assert_eq!(names, ["a.f32", "b.f16", "c.q8_0", "d.q4_1"]);
        let a = g.tensor("a.f32").unwrap();
        assert_eq!(
            (a.dims(), a.ggml_type(), a.n_elements(), a.n_bytes(), a.row_len(), a.n_rows()),
            (&[3, 2][..], GgmlType::F32, 6, 24, 3, 2)
        );
        assert_eq!(g.tensor_f32("a.f32").unwrap(), f32s);
        assert_eq!(g.tensor_f32("b.f16").unwrap(), [0.5, -0.25, 2.0, 65504.0]);
        assert_eq!(g.tensor_data("c.q8_0").unwrap(), &q8[..]);
        let c = g.tensor_f32("c.q8_0").unwrap();
        assert_eq!((c[0], c[31], c[32], c[63]), (-8.0, 7.5, -24.0, 22.5));
        let d = g.tensor("d.q4_1").unwrap();
        assert_eq!((d.dims(), d.n_bytes(), d.n_rows()), (&[32, 1, 2][..], 40, 2));
        assert_eq!(g.tensor_data("d.q4_1").unwrap(), &q41[..]);
        for t in g.tensors() {
            assert_eq!(t.offset() % u64::from(alignment), 0);
            let start = (g.data_offset() + t.offset()) as usize;
            assert_eq!(g.data(t).unwrap(), &bytes[start..start + t.n_bytes() as usize]);
        }
        assert!(matches!(g.tensor_f32("missing"), Err(Error::Model(_))));
    }
}

#[test]
fn gguf_version_2_and_rejections_cpu() {
    let mut w = GgufWriter::new();
    w.version = 2;
    w.u32("k", 1);
    let v2 = w.finish();
    assert_eq!(Gguf::parse(&v2).unwrap().version(), 2);
    let expect = |bytes: &[u8], offset: u64, needle: &str| match Gguf::parse(bytes) {
        Err(Error::Format { offset: o, what }) => {
            assert_eq!(o, offset, "{what}");
            assert!(what.contains(needle), "{what:?} should mention {needle:?}");
        }
        other => panic!("expected a format error mentioning {needle:?}, got {other:?}"),
    };
    expect(b"", 0, "too short");
    expect(b"GGML\x03\0\0\0", 0, "not a GGUF file");
    let mut v = v2.clone();
    v[4..8].copy_from_slice(&1u32.to_le_bytes());
    expect(&v, 4, "version 1");
    v[4..8].copy_from_slice(&3u32.to_be_bytes());
    expect(&v, 4, "big-endian");
    v[4..8].copy_from_slice(&9u32.to_le_bytes());
    expect(&v, 4, "version 9");
    // A metadata count that cannot fit in the bytes left is refused before anything is read.
    let mut v = v2.clone();
    v[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    expect(&v, 8, "metadata entries need at least");
    // Duplicate keys, bad bools, unknown types, misaligned and out-of-file tensors.
    let mut w = GgufWriter::new();
    w.u32("k", 1).u32("k", 2);
    expect(&w.finish(), 24 + 17, "appears twice");
    let mut w = GgufWriter::new();
    w.raw("b", ValueType::Bool, &[2]);
    expect(&w.finish(), 24 + 9 + 4, "bool value is 2");
    let mut w = GgufWriter::new();
    w.raw("x", ValueType::U8, &[0]);
    let mut v = w.finish();
    v[33..37].copy_from_slice(&77u32.to_le_bytes());
    expect(&v, 33, "unknown value type 77");
    let mut w = GgufWriter::new();
    w.alignment(48);
    expect(&w.finish(), 24 + 8 + 17 + 4, "not a power of two");
    let mut w = GgufWriter::new();
    w.tensor("t", &[32], GgmlType::Q8_0, vec![0; 34]);
    let good = w.finish();
    assert!(Gguf::parse(&good).is_ok());
    expect(&good[..64 + 33], 24, "runs past the end");
    let type_at = 24 + 9 + 4 + 8;
    let mut v = good.clone();
    v[type_at..type_at + 4].copy_from_slice(&4u32.to_le_bytes());
    expect(&v, type_at as u64, "unknown ggml type id 4");
    let mut v = good.clone();
    v[type_at + 4..type_at + 12].copy_from_slice(&8u64.to_le_bytes());
    expect(&v, 24, "not a multiple of the alignment");
    let mut v = good.clone();
    v[37..45].copy_from_slice(&31u64.to_le_bytes());
    expect(&v, 33, "not a multiple of its block size 32");
    let mut v = good.clone();
    v[33..37].copy_from_slice(&5u32.to_le_bytes());
    expect(&v, 33, "more than 4");
}

/// Hand-computed blocks: the nibble order (low nibbles are elements 0..16) and the scale
/// placement are what a GPU kernel will have to match.
#[test]
fn gguf_dequant_hand_blocks_cpu() {
    // Q8_0: d = 0.5, q = [-128, -1, 0, 1, 127, 3, ...].
    let mut b = f16_bytes(0.5).to_vec();
    let q: Vec<i8> = (0..32).map(|j| [-128, -1, 0, 1, 127][j % 5]).collect();
    b.extend(q.iter().map(|&x| x as u8));
    let mut y = [0f32; 32];
    dequantize(GgmlType::Q8_0, &b, &mut y).unwrap();
    for j in 0..32 {
        assert_eq!(y[j], f32::from(q[j]) * 0.5, "q8_0 element {j}");
    }
    // Q4_0: d = 2, byte j = (hi j%16, lo 15-j%16): element j = (15 - j - 8) * 2, element
    // j + 16 = (j - 8) * 2.
    let mut b = f16_bytes(2.0).to_vec();
    b.extend((0..16u8).map(|j| (j << 4) | (15 - j)));
    let mut y = [0f32; 32];
    dequantize(GgmlType::Q4_0, &b, &mut y).unwrap();
    for j in 0..16 {
        assert_eq!(y[j], (7.0 - j as f32) * 2.0, "q4_0 low nibble {j}");
        assert_eq!(y[j + 16], (j as f32 - 8.0) * 2.0, "q4_0 high nibble {j}");
    }
    // Q4_1: d = 0.25, m = -1; byte j = (hi 15 - j, lo j): element j = j/4 - 1, element
    // j + 16 = (15 - j)/4 - 1.
    let mut b = f16_bytes(0.25).to_vec();
    b.extend_from_slice(&f16_bytes(-1.0));
    b.extend((0..16u8).map(|j| ((15 - j) << 4) | j));
    let mut y = [0f32; 32];
    dequantize(GgmlType::Q4_1, &b, &mut y).unwrap();
    for j in 0..16 {
        assert_eq!(y[j], j as f32 * 0.25 - 1.0, "q4_1 low nibble {j}");
        assert_eq!(y[j + 16], (15 - j) as f32 * 0.25 - 1.0, "q4_1 high nibble {j}");
    }
    // Q5_0: d = 1, all nibbles 0, fifth bit set for elements 3 and 20 only: 16 - 16 = 0 there,
    // -16 elsewhere.
    let mut b = f16_bytes(1.0).to_vec();
    b.extend_from_slice(&((1u32 << 3) | (1 << 20)).to_le_bytes());
    b.extend([0u8; 16]);
    let mut y = [0f32; 32];
    dequantize(GgmlType::Q5_0, &b, &mut y).unwrap();
    for (j, &v) in y.iter().enumerate() {
        assert_eq!(v, if j == 3 || j == 20 { 0.0 } else { -16.0 }, "q5_0 element {j}");
    }
    // F16 / BF16 / F64 plain conversions.
    let mut y = [0f32; 2];
    dequantize(GgmlType::Bf16, &[0x80, 0x3f, 0x00, 0xc0], &mut y).unwrap();
    assert_eq!(y, [1.0, -2.0]);
    dequantize(GgmlType::F64, &[0.5f64.to_le_bytes(), (-3.0f64).to_le_bytes()].concat(), &mut y).unwrap();
    assert_eq!(y, [0.5, -3.0]);
    // Sizes must be whole blocks; unsupported types say so.
    assert!(matches!(dequantize(GgmlType::Q4_1, &[0; 19], &mut [0.0; 32]), Err(Error::Input(_))));
    assert!(matches!(dequantize(GgmlType::Q4_1, &[0; 20], &mut [0.0; 31]), Err(Error::Input(_))));
    match dequantize(GgmlType::Iq2Xxs, &[0; 66], &mut [0.0; 256]) {
        Err(Error::Model(m)) => assert!(m.contains("IQ2_XXS") && m.contains("cannot dequantise"), "{m}"),
        other => panic!("{other:?}"),
    }
}

/// Two random blocks per type from the crate's generator, dequantised here and by gguf-py's
/// reference dequantisers (`gguf.quants.dequantize`, the same SplitMix64 stream in Python;
/// Q8_K, which gguf-py lacks, by its definition d * q): sum, index-weighted sum and four
/// elements of the outputs.
#[test]
#[allow(clippy::excessive_precision)] // the reference values exactly as gguf-py printed them
fn gguf_dequant_matches_reference_cpu() {
    #[rustfmt::skip]
    let expected: [(GgmlType, f64, f64, [f32; 4]); 11] = [
        (GgmlType::Q4_0, 0.181671142578125, 137.51780700683594, [-0.0566864013671875, 0.0793609619140625, -0.0771484375, -0.3857421875]),
        (GgmlType::Q4_1, 25.7618408203125, 3388.1522521972656, [0.972869873046875, 0.092498779296875, 0.12200927734375, 0.07220458984375]),
        (GgmlType::Q5_0, 0.295806884765625, 117.89044189453125, [0.43560791015625, -0.10052490234375, 0.0233001708984375, 0.09320068359375]),
        (GgmlType::Q5_1, 46.3955078125, 5941.828964233398, [0.84686279296875, 1.35076904296875, 0.0694732666015625, 0.1577301025390625]),
        (GgmlType::Q8_0, -19.734283447265625, -1202.1698913574219, [-0.24664306640625, 1.7470550537109375, -1.293701171875, 2.1253662109375]),
        (GgmlType::Q2K, 126.72067260742188, 15656.766540527344, [0.6143798828125, 0.6143798828125, 0.2154388427734375, 0.264251708984375]),
        (GgmlType::Q3K, -95.24603271484375, -6361.707061767578, [0.4075927734375, -0.4075927734375, 0.76470947265625, -0.76470947265625]),
        (GgmlType::Q4K, 5824.996917724609, 720924.7023162842, [3.982147216796875, 11.294647216796875, 11.047576904296875, 1.2451171875]),
        (GgmlType::Q5K, 11970.88623046875, 1524325.6126708984, [10.6707763671875, 20.3145751953125, 50.2974853515625, 85.2647705078125]),
        (GgmlType::Q6K, -1980.4360656738281, -247651.43704223633, [-124.5556640625, 135.87890625, 99.957275390625, 76.3824462890625]),
        (GgmlType::Q8K, 112.51252993196249, 24008.323883250356, [6.36944580078125, -1.868370771408081, -4.890477657318115, 0.8304584622383118]),
    ];
    for (ty, sum, weighted, elems) in expected {
        // Offsets of the f16 (or, for Q8_K, f32) scale fields in one block.
        let (f16s, f32s): (&[usize], &[usize]) = match ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => (&[0], &[]),
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => (&[0, 2], &[]),
            GgmlType::Q2K => (&[80, 82], &[]),
            GgmlType::Q3K => (&[108], &[]),
            GgmlType::Q6K => (&[208], &[]),
            _ => (&[], &[0]),
        };
        let seed = 1000 + u64::from(ty.id());
        let mut rng = Rng::new(seed);
        let size = ty.type_size() as usize;
        let mut data = Vec::new();
        for _ in 0..2 {
            let mut b: Vec<u8> = (0..size).map(|_| rng.next_u32() as u8).collect();
            for &o in f16s {
                b[o..o + 2].copy_from_slice(&f16_bytes(rng.range(0.001, 0.1) as f32));
            }
            for &o in f32s {
                b[o..o + 4].copy_from_slice(&(rng.range(0.001, 0.1) as f32).to_le_bytes());
            }
            data.extend(b);
        }
        let n = 2 * ty.block_size() as usize;
        let mut y = vec![f32::NAN; n];
        dequantize(ty, &data, &mut y).unwrap();
        let s: f64 = y.iter().map(|&v| f64::from(v)).sum();
        let ws: f64 = y.iter().enumerate().map(|(i, &v)| f64::from(v) * ((i * 7919) % 251 + 1) as f64).sum();
        let got = [y[0], y[1], y[n / 2 + 3], y[n - 1]];
        assert!(close(s, sum, 1e-9) && close(ws, weighted, 1e-9), "{ty} (seed {seed}): sums {s} {ws}, reference {sum} {weighted}");
        assert_eq!(got, elems, "{ty} (seed {seed})");
    }
}

/// A file with every feature the parser has: all value types, string/int/nested arrays,
/// tensors of several types at a custom alignment, and the Llama/tokenizer keys.
fn sample_file() -> Vec<u8> {
    let nested = array(ValueType::Array, &[array(ValueType::String, &[string(b"x"), string(b"yz")]), array(ValueType::Bool, &[vec![1]])]);
    // A complete byte-level vocabulary, so that the tokenizer is built from it too.
    let bytes: Vec<String> = crate::tokenizer::byte_to_char().iter().map(char::to_string).collect();
    let mut tokens: Vec<&str> = vec!["<|endoftext|>"];
    tokens.extend(bytes.iter().map(String::as_str));
    tokens.extend(["ab", "Ġab", "12"]);
    let types: Vec<i32> = (0..tokens.len()).map(|i| if i == 0 { 3 } else { 1 }).collect();
    let mut w = GgufWriter::new();
    w.str("general.architecture", "llama")
        .alignment(64)
        .u32("llama.block_count", 1)
        .u32("llama.embedding_length", 64)
        .u32("llama.feed_forward_length", 64)
        .u32("llama.attention.head_count", 2)
        .u32("llama.attention.head_count_kv", 1)
        .f32("llama.rope.freq_base", 1e5)
        .f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .u32("llama.context_length", 128)
        .str("tokenizer.ggml.model", "gpt2")
        .str("tokenizer.ggml.pre", "smollm")
        .strs("tokenizer.ggml.tokens", &tokens)
        .i32s("tokenizer.ggml.token_type", &types)
        .strs("tokenizer.ggml.merges", &["a b", "Ġ ab", "1 2"])
        .u32("tokenizer.ggml.eos_token_id", 0)
        .raw("f64", ValueType::F64, &1.25f64.to_le_bytes())
        .raw("i64", ValueType::I64, &(-5i64).to_le_bytes())
        .raw("nested", ValueType::Array, &nested)
        .bool("flag", true);
    let q41: Vec<u8> = (0..40u8).map(|i| i.wrapping_mul(91)).collect();
    let mut q4k = vec![0u8; 144];
    q4k[..4].copy_from_slice(&[f16_bytes(0.5), f16_bytes(0.25)].concat());
    w.tensor("token_embd.weight", &[64, 6], GgmlType::F16, vec![0x3c; 64 * 6 * 2])
        .tensor("norm", &[8], GgmlType::F32, f32_bytes(&[1.0; 8]))
        .tensor("q", &[32, 2], GgmlType::Q4_1, q41)
        .tensor("k", &[256], GgmlType::Q4K, q4k)
        .tensor("iq", &[256], GgmlType::Iq2Xxs, vec![7; 66]);
    w.finish()
}

/// Mutates a valid file at many random places (truncation, byte flips, extreme counts and
/// lengths written over fields, deleted and duplicated ranges) and requires a clean `Ok` or
/// `Err` every time: no panic, and no single allocation beyond a small multiple of the input.
#[test]
fn gguf_malformed_files_never_panic_cpu() {
    let base = sample_file();
    let header_end = Gguf::parse(&base).unwrap().data_offset() as usize;
    assert!(crate::exercise::gguf(&base));
    let g = Gguf::parse(&base).unwrap();
    assert!(
        LlamaConfig::from_gguf(&g).is_ok() && crate::tokenizer::Tokenizer::from_gguf(&g).is_ok(),
        "the base file must reach every consumer"
    );
    let nasty = |rng: &mut Rng, len: usize| -> u64 {
        match rng.below(8) {
            0 => u64::MAX,
            1 => 1 << 63,
            2 => u64::from(u32::MAX),
            3 => len as u64,
            4 => len as u64 + 1,
            5 => u64::from(rng.below(64)),
            6 => rng.next_u64() >> rng.below(64),
            _ => rng.next_u64(),
        }
    };
    let (mut parsed, mut refused) = (0, 0);
    for seed in 0..4000u64 {
        let mut rng = Rng::new(seed);
        let mut v = base.clone();
        // Most fields that matter lie in the header; aim there three times out of four.
        let span = if rng.below(4) == 0 { v.len() } else { header_end };
        let mode = rng.below(6);
        match mode {
            0 => v.truncate(rng.below(v.len() as u32) as usize),
            1 => {
                for _ in 0..=rng.below(4) {
                    let i = rng.below(span as u32) as usize;
                    v[i] = rng.next_u32() as u8;
                }
            }
            2 => {
                let i = rng.below((span - 8) as u32) as usize;
                let x = nasty(&mut rng, v.len());
                v[i..i + 8].copy_from_slice(&x.to_le_bytes());
            }
            3 => {
                let i = rng.below((span - 4) as u32) as usize;
                let x = if rng.below(2) == 0 { rng.below(48) } else { nasty(&mut rng, v.len()) as u32 };
                v[i..i + 4].copy_from_slice(&x.to_le_bytes());
            }
            4 => {
                let i = rng.below(span as u32) as usize;
                let n = (rng.below(16) as usize + 1).min(v.len() - i);
                v.drain(i..i + n);
            }
            _ => {
                let i = rng.below(span as u32) as usize;
                let n = (rng.below(16) as usize + 1).min(v.len() - i);
                let dup: Vec<u8> = v[i..i + n].to_vec();
                v.splice(i..i, dup);
            }
        }
        alloc_track::reset();
        let outcome = std::panic::catch_unwind(|| crate::exercise::gguf(&v));
        let largest = alloc_track::largest();
        match outcome {
            Ok(true) => parsed += 1,
            Ok(false) => refused += 1,
            Err(_) => panic!("seed {seed} (mutation {mode}): the reader panicked"),
        }
        let bound = 16 * v.len() + (1 << 16);
        assert!(largest <= bound, "seed {seed} (mutation {mode}): an allocation of {largest} bytes for a {}-byte file", v.len());
    }
    eprintln!("{parsed} mutated files parsed, {refused} refused");
    // Both outcomes must be common, or the mutations are not reaching the parser.
    assert!(parsed > 200 && refused > 1000, "parsed {parsed}, refused {refused}");
}

/// The fuzz test's allocation bound means something only if the tracker sees allocations.
#[test]
fn gguf_alloc_tracker_sees_allocations_cpu() {
    alloc_track::reset();
    let v: Vec<u8> = Vec::with_capacity(3 << 20);
    assert!(alloc_track::largest() >= 3 << 20);
    drop(v);
}

/// Deep nesting is refused (bounded recursion), not a stack overflow.
#[test]
fn gguf_deeply_nested_arrays_refused_cpu() {
    let mut payload = array(ValueType::U8, &[]);
    for _ in 0..10_000 {
        payload = array(ValueType::Array, &[payload]);
    }
    let mut w = GgufWriter::new();
    w.raw("deep", ValueType::Array, &payload);
    assert!(matches!(Gguf::parse(&w.finish()), Err(Error::Format { what, .. }) if what.contains("nested more than")));
}

#[test]
fn gguf_smollm2_hyperparameters_real() {
    let Some(bytes) = test_model_bytes("gguf_smollm2_hyperparameters_real") else { return };
    let g = Gguf::parse(bytes).unwrap();
    assert_eq!((g.version(), g.alignment(), g.data_offset()), (3, 32, 1_785_664));
    assert_eq!(g.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(g.get_str("tokenizer.ggml.pre").unwrap(), "smollm");
    let c = LlamaConfig::from_gguf(&g).unwrap();
    assert_eq!(
        c,
        LlamaConfig {
            arch: crate::config::Arch::Llama,
            block_count: 30,
            embedding_length: 576,
            feed_forward_length: 1536,
            head_count: 9,
            head_count_kv: 3,
            head_dim: 64,
            rope_freq_base: 1e5,
            rope_dimension_count: 64,
            rms_norm_eps: 1e-5,
            context_length: 8192,
            vocab_size: 49152,
            expert_count: 0,
            expert_used_count: 0,
            shared_feed_forward_length: 0,
            unit_expert_weights: false,
        }
    );
    assert_eq!(c.group_size(), 3);
    assert!(LlamaConfig::tied_embeddings(&g));
    c.check_tensors(&g).unwrap();
    assert_eq!(g.tensors().len(), 272);
    let count = |ty| g.tensors().iter().filter(|t| t.ggml_type() == ty).count();
    assert_eq!((count(GgmlType::Q8_0), count(GgmlType::F32), count(GgmlType::Q4_1)), (1, 61, 210));
}

/// Whole real tensors dequantised here and by gguf-py (`GGUFReader` + `quants.dequantize`):
/// element count, sum and sum of squares (f64) and the first and last elements.
#[test]
#[allow(clippy::excessive_precision)] // the reference values exactly as gguf-py printed them
fn gguf_smollm2_dequant_matches_reference_real() {
    let Some(bytes) = test_model_bytes("gguf_smollm2_dequant_matches_reference_real") else { return };
    let g = Gguf::parse(bytes).unwrap();
    #[rustfmt::skip]
    let expected = [
        ("token_embd.weight", GgmlType::Q8_0, 28_311_552, -15353.04449415207, 520415.71544763993, [-0.10654449462890625, -0.0417022705078125]),
        ("blk.0.attn_norm.weight", GgmlType::F32, 576, 0.6129436492919922, 0.9180835409024439, [0.01397705078125, -0.038330078125]),
        ("blk.0.ffn_down.weight", GgmlType::Q4_1, 884_736, 150.63577270507812, 33220.11995097203, [-0.330810546875, -0.181365966796875]),
        ("blk.0.attn_q.weight", GgmlType::Q4_1, 331_776, 59.22322082519531, 26749.573275085306, [-0.0963134765625, -0.255859375]),
        ("blk.29.attn_v.weight", GgmlType::Q4_1, 110_592, -23.565185546875, 9188.002153100446, [0.1417236328125, 0.05322265625]),
        ("output_norm.weight", GgmlType::F32, 576, 1038.33203125, 1921.7355499267578, [1.7578125, 1.984375]),
    ];
    for (name, ty, n, sum, sum_sq, ends) in expected {
        assert_eq!(g.tensor(name).unwrap().ggml_type(), ty, "{name}");
        let y = g.tensor_f32(name).unwrap();
        assert_eq!(y.len(), n, "{name}");
        let s: f64 = y.iter().map(|&v| f64::from(v)).sum();
        let s2: f64 = y.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        assert!(close(s, sum, 1e-9) && close(s2, sum_sq, 1e-9), "{name}: {s} {s2} vs reference {sum} {sum_sq}");
        assert_eq!([y[0], y[n - 1]], ends, "{name}");
    }
}
