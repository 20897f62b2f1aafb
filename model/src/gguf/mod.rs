//! A reader for GGUF files (versions 3 and 2), the container llama.cpp writes models in: the
//! header, the metadata key/values (every GGUF value type, arrays included), the tensor table and
//! the tensors' bytes, with CPU dequantisation to f32 of F32, F16, BF16, F64, Q4_0, Q4_1, Q5_0,
//! Q5_1, Q8_0 and the K-quants Q2_K..Q6_K, Q8_K (block layouts exactly as ggml's).
//!
//! It reads from a `&[u8]` the caller owns (a file read into memory, or a mapping), borrowing
//! strings and tensor bytes from it. Every count, length and offset is checked with checked
//! arithmetic against the bytes that are really left before anything is allocated or sliced, so a
//! truncated, corrupted or hostile file gives [`Error::Format`] naming the byte offset of the bad
//! field, never a panic, and nothing allocated is larger than a small multiple of the file.
//!
//! Layout (all little-endian): `"GGUF"`, u32 version, u64 tensor count, u64 metadata count; the
//! metadata (u64-length string key, u32 value type, value); the tensor infos (string name, u32
//! n_dims, n_dims x u64 dims with the contiguous one first, u32 ggml type, u64 offset into the
//! data section); padding up to `general.alignment` (default 32); the data section.

use std::collections::HashMap;
use std::fmt;

use crate::{Error, Result};

/// The first four bytes of every GGUF file.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of each tensor in it when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most four dimensions.
pub const MAX_DIMS: usize = 4;
/// Arrays of arrays are legal GGUF but unused in practice; the bound keeps recursion shallow on
/// hostile input.
pub const MAX_ARRAY_DEPTH: u32 = 8;

fn format_err(offset: u64, what: impl Into<String>) -> Error {
    Error::Format { offset, what: what.into() }
}

pub(crate) fn model_err(what: impl Into<String>) -> Error {
    Error::Model(what.into())
}

/// Prefixes the description of a format error with what was being read.
fn in_context(e: Error, context: impl fmt::Display) -> Error {
    match e {
        Error::Format { offset, what } => Error::Format { offset, what: format!("{context}: {what}") },
        other => other,
    }
}

/// A bounded forward reader over part of the file; `base` is the file offset of `bytes[0]`, so
/// errors name positions in the file.
#[derive(Clone)]
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    base: u64,
}

impl<'a> Cursor<'a> {
    fn new(bytes: &'a [u8], base: u64) -> Self {
        Cursor { bytes, pos: 0, base }
    }

    fn offset(&self) -> u64 {
        self.base.saturating_add(self.pos as u64)
    }

    fn remaining(&self) -> u64 {
        self.bytes.len().saturating_sub(self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let left = self.remaining();
        let slice = usize::try_from(n)
            .ok()
            .filter(|_| n <= left)
            .and_then(|n| self.pos.checked_add(n))
            .and_then(|end| self.bytes.get(self.pos..end).map(|s| (s, end)));
        match slice {
            Some((s, end)) => {
                self.pos = end;
                Ok(s)
            }
            None => Err(format_err(self.offset(), format!("{what} needs {n} bytes but only {left} are left"))),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        self.array(what).map(u16::from_le_bytes)
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A GGUF string: u64 byte length, then the bytes (UTF-8 by the spec, checked by the callers
    /// that need text).
    fn string(&mut self, what: &str) -> Result<&'a [u8]> {
        let n = self.u64(what)?;
        self.take(n, what)
    }
}

fn utf8_at<'a>(bytes: &'a [u8], offset: u64, what: &str) -> Result<&'a str> {
    std::str::from_utf8(bytes).map_err(|e| format_err(offset, format!("{what} is not UTF-8 ({e})")))
}

/// The type tag of a metadata value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ValueType {
    /// Type id 0: an unsigned 8-bit integer.
    U8,
    /// Type id 1: a signed 8-bit integer.
    I8,
    /// Type id 2: an unsigned 16-bit integer.
    U16,
    /// Type id 3: a signed 16-bit integer.
    I16,
    /// Type id 4: an unsigned 32-bit integer.
    U32,
    /// Type id 5: a signed 32-bit integer.
    I32,
    /// Type id 6: an IEEE single-precision float.
    F32,
    /// Type id 7: one byte, 0 or 1 (any other byte is a format error).
    Bool,
    /// Type id 8: a u64 byte length, then the bytes (UTF-8 by the spec).
    String,
    /// Type id 9: a u32 element type, a u64 element count, then the elements, all of that type.
    Array,
    /// Type id 10: an unsigned 64-bit integer.
    U64,
    /// Type id 11: a signed 64-bit integer.
    I64,
    /// Type id 12: an IEEE double-precision float.
    F64,
}

impl ValueType {
    /// The type of GGUF's value type id (`gguf_type`, 0..=12); `None` for any other id.
    pub fn from_id(id: u32) -> Option<Self> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// GGUF's id of the type, as written before a metadata value and in an array header (the
    /// inverse of [`ValueType::from_id`]).
    pub fn id(self) -> u32 {
        use ValueType::*;
        match self {
            U8 => 0,
            I8 => 1,
            U16 => 2,
            I16 => 3,
            U32 => 4,
            I32 => 5,
            F32 => 6,
            Bool => 7,
            String => 8,
            Array => 9,
            U64 => 10,
            I64 => 11,
            F64 => 12,
        }
    }

    /// Bytes of one value of a fixed-size type.
    fn fixed_size(self) -> Option<u64> {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }

    /// The fewest bytes one value can take: bounds a count by the bytes left before walking it.
    fn min_size(self) -> u64 {
        match self {
            ValueType::String => 8,
            ValueType::Array => 12,
            fixed => fixed.fixed_size().unwrap_or(1),
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// One metadata value, borrowing strings and arrays from the file.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value<'a> {
    /// An unsigned 8-bit integer ([`ValueType::U8`]).
    U8(u8),
    /// A signed 8-bit integer ([`ValueType::I8`]).
    I8(i8),
    /// An unsigned 16-bit integer ([`ValueType::U16`]).
    U16(u16),
    /// A signed 16-bit integer ([`ValueType::I16`]).
    I16(i16),
    /// An unsigned 32-bit integer ([`ValueType::U32`]): most of llama.cpp's counts and sizes.
    U32(u32),
    /// A signed 32-bit integer ([`ValueType::I32`]).
    I32(i32),
    /// An unsigned 64-bit integer ([`ValueType::U64`]).
    U64(u64),
    /// A signed 64-bit integer ([`ValueType::I64`]).
    I64(i64),
    /// A single-precision float ([`ValueType::F32`]): epsilons, RoPE bases.
    F32(f32),
    /// A double-precision float ([`ValueType::F64`]).
    F64(f64),
    /// A boolean ([`ValueType::Bool`]), stored as one byte 0 or 1.
    Bool(bool),
    /// The raw bytes: GGUF says UTF-8 but nothing enforces it; [`Value::as_str`] checks.
    String(&'a [u8]),
    /// An array ([`ValueType::Array`]), its elements left encoded in the file until read.
    Array(Array<'a>),
}

impl<'a> Value<'a> {
    /// The type tag this value was read with.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F32(_) => ValueType::F32,
            Value::F64(_) => ValueType::F64,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
        }
    }

    /// Any integer type, when the value is representable as i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::I8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::U64(v) => i64::try_from(v).ok(),
            Value::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Any integer type, when the value is non-negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            _ => self.as_i64().and_then(|v| u64::try_from(v).ok()),
        }
    }

    /// Floats, and integers (some writers store e.g. a RoPE base as an integer).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// A bool value; `None` for every other type (integers are not converted).
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// A string value that is valid UTF-8.
    pub fn as_str(&self) -> Option<&'a str> {
        match *self {
            Value::String(s) => std::str::from_utf8(s).ok(),
            _ => None,
        }
    }

    /// An array value; `None` for every other type.
    pub fn as_array(&self) -> Option<&Array<'a>> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl fmt::Display for Value<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::U8(v) => write!(f, "{v}"),
            Value::I8(v) => write!(f, "{v}"),
            Value::U16(v) => write!(f, "{v}"),
            Value::I16(v) => write!(f, "{v}"),
            Value::U32(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F32(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::String(s) => write!(f, "{:?}", String::from_utf8_lossy(s)),
            Value::Array(a) => write!(f, "[{}; {}]", a.elem_type(), a.len()),
        }
    }
}

/// An array value: its elements stay encoded in the file (a vocabulary is tens of thousands of
/// strings) and are decoded on demand. Parsing walked and validated every element already.
#[derive(Clone, Copy)]
pub struct Array<'a> {
    elem: ValueType,
    len: u64,
    bytes: &'a [u8],
    offset: u64,
    depth: u32,
}

impl<'a> Array<'a> {
    /// The type of every element (a GGUF array holds one type).
    pub fn elem_type(&self) -> ValueType {
        self.elem
    }

    /// Elements in the array (not bytes).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// File offset of the first element.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The elements, decoded one by one (strings and nested arrays borrowed from the file).
    pub fn iter(&self) -> ArrayIter<'a> {
        ArrayIter { cur: Cursor::new(self.bytes, self.offset), elem: self.elem, left: self.len, depth: self.depth }
    }

    /// Capacity for a Vec of the elements: the count, which parsing bounded by the bytes.
    fn capacity(&self) -> usize {
        usize::try_from(self.len).unwrap_or(0)
    }

    /// A string array as UTF-8 strings.
    pub fn to_strs(&self) -> Result<Vec<&'a str>> {
        if self.elem != ValueType::String {
            return Err(format_err(self.offset, format!("expected an array of strings, found an array of {}", self.elem)));
        }
        let mut cur = Cursor::new(self.bytes, self.offset);
        let mut out = Vec::with_capacity(self.capacity());
        for i in 0..self.len {
            let at = cur.offset();
            let s = cur.string("string element")?;
            out.push(utf8_at(s, at, &format!("string element {i}"))?);
        }
        Ok(out)
    }

    /// An array of any integer type as i64.
    pub fn to_i64s(&self) -> Result<Vec<i64>> {
        let mut out = Vec::with_capacity(self.capacity());
        for (i, v) in self.iter().enumerate() {
            let v = v?;
            out.push(
                v.as_i64().ok_or_else(|| {
                    format_err(self.offset, format!("expected an array of integers, element {i} is {} {v}", v.value_type()))
                })?,
            );
        }
        Ok(out)
    }

    /// An array of floats (or integers) as f32.
    pub fn to_f32s(&self) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(self.capacity());
        for (i, v) in self.iter().enumerate() {
            let v = v?;
            out.push(
                v.as_f64().ok_or_else(|| {
                    format_err(self.offset, format!("expected an array of numbers, element {i} is {} {v}", v.value_type()))
                })? as f32,
            );
        }
        Ok(out)
    }
}

impl fmt::Debug for Array<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Array").field("elem", &self.elem).field("len", &self.len).field("offset", &self.offset).finish()
    }
}

/// Equal when the element types, counts and encoded elements are equal (wherever they lie).
impl PartialEq for Array<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.elem == other.elem && self.len == other.len && self.bytes == other.bytes
    }
}

/// The elements of an [`Array`], decoded one by one.
pub struct ArrayIter<'a> {
    cur: Cursor<'a>,
    elem: ValueType,
    left: u64,
    depth: u32,
}

impl<'a> Iterator for ArrayIter<'a> {
    type Item = Result<Value<'a>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let v = read_value(&mut self.cur, self.elem, self.depth);
        if v.is_err() {
            self.left = 0;
        }
        Some(v)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = usize::try_from(self.left).unwrap_or(usize::MAX);
        (n, Some(n))
    }
}

fn read_value<'a>(cur: &mut Cursor<'a>, ty: ValueType, depth: u32) -> Result<Value<'a>> {
    Ok(match ty {
        ValueType::U8 => Value::U8(cur.u8("u8 value")?),
        ValueType::I8 => Value::I8(cur.u8("i8 value")? as i8),
        ValueType::U16 => Value::U16(cur.u16("u16 value")?),
        ValueType::I16 => Value::I16(cur.u16("i16 value")? as i16),
        ValueType::U32 => Value::U32(cur.u32("u32 value")?),
        ValueType::I32 => Value::I32(cur.u32("i32 value")? as i32),
        ValueType::U64 => Value::U64(cur.u64("u64 value")?),
        ValueType::I64 => Value::I64(cur.u64("i64 value")? as i64),
        ValueType::F32 => Value::F32(f32::from_bits(cur.u32("f32 value")?)),
        ValueType::F64 => Value::F64(f64::from_bits(cur.u64("f64 value")?)),
        ValueType::Bool => {
            let at = cur.offset();
            match cur.u8("bool value")? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(format_err(at, format!("bool value is {b}, not 0 or 1"))),
            }
        }
        ValueType::String => Value::String(cur.string("string value")?),
        ValueType::Array => Value::Array(read_array(cur, depth)?),
    })
}

/// Reads an array header and walks its elements (validating them), without allocating.
fn read_array<'a>(cur: &mut Cursor<'a>, depth: u32) -> Result<Array<'a>> {
    let at = cur.offset();
    if depth >= MAX_ARRAY_DEPTH {
        return Err(format_err(at, format!("arrays nested more than {MAX_ARRAY_DEPTH} deep")));
    }
    let elem_id = cur.u32("array element type")?;
    let elem = ValueType::from_id(elem_id).ok_or_else(|| format_err(at, format!("unknown array element type {elem_id}")))?;
    let len_at = cur.offset();
    let len = cur.u64("array length")?;
    let start = cur.pos;
    let offset = cur.offset();
    let left = cur.remaining();
    if len > left / elem.min_size() {
        return Err(format_err(
            len_at,
            format!(
                "array of {len} {elem} values needs at least {} bytes but only {left} are left",
                u128::from(len) * u128::from(elem.min_size())
            ),
        ));
    }
    match elem.fixed_size() {
        Some(size) if elem != ValueType::Bool => {
            // len * size <= left was checked above (min_size == size for fixed types).
            cur.take(len * size, "array elements")?;
        }
        _ => {
            for _ in 0..len {
                read_value(cur, elem, depth + 1)?;
            }
        }
    }
    let bytes = cur.bytes.get(start..cur.pos).unwrap_or_default();
    Ok(Array { elem, len, bytes, offset, depth: depth + 1 })
}

/// A ggml tensor type. Sizes are those of ggml's blocks (`ggml-common.h`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// Id 0: 32-bit IEEE floats, 32 bits per weight.
    F32,
    /// Id 1: IEEE halves, 16 bits per weight.
    F16,
    /// Id 2: blocks of 32 weights in 18 bytes, an f16 scale `d` and 32 4-bit codes `q` (weight
    /// `(q - 8) * d`); 4.5 bits per weight.
    Q4_0,
    /// Id 3: blocks of 32 weights in 20 bytes, an f16 scale `d` and minimum `m` and 32 4-bit codes
    /// (weight `d * q + m`); 5 bits per weight.
    Q4_1,
    /// Id 6: blocks of 32 weights in 22 bytes, an f16 scale `d`, 4 bytes of fifth bits and 16 of
    /// low nibbles (weight `(q - 16) * d`); 5.5 bits per weight.
    Q5_0,
    /// Id 7: blocks of 32 weights in 24 bytes, an f16 scale `d` and minimum `m`, 4 bytes of fifth
    /// bits and 16 of low nibbles (weight `d * q + m`); 6 bits per weight.
    Q5_1,
    /// Id 8: blocks of 32 weights in 34 bytes, an f16 scale `d` and 32 signed bytes `q` (weight
    /// `q * d`); 8.5 bits per weight.
    Q8_0,
    /// Id 9: blocks of 32 in 36 bytes, an f16 scale, an f16 of the scale times the codes' sum, and
    /// 32 signed bytes; 9 bits per value (ggml's activation format for Q4_1/Q5_1 dot products; not
    /// dequantised here).
    Q8_1,
    /// Id 10: super-blocks of 256 weights in 84 bytes: 16 sub-blocks of 16 with 4-bit scales and
    /// mins, 2-bit codes, an f16 super-block scale and min; 2.625 bits per weight.
    Q2K,
    /// Id 11: super-blocks of 256 weights in 110 bytes: 3-bit codes (a mask of high bits and 2 low
    /// bits), 16 sub-blocks of 16 with 6-bit scales, an f16 scale; 3.4375 bits per weight.
    Q3K,
    /// Id 12: super-blocks of 256 weights in 144 bytes: an f16 scale and min, 8 sub-blocks of 32
    /// with 6-bit scales and mins (12 bytes), 4-bit codes; 4.5 bits per weight.
    Q4K,
    /// Id 13: super-blocks of 256 weights in 176 bytes: Q4_K's layout plus a fifth bit per weight
    /// (32 bytes); 5.5 bits per weight.
    Q5K,
    /// Id 14: super-blocks of 256 weights in 210 bytes: 6-bit codes (128 bytes of low nibbles, 64
    /// of high bit pairs), 16 sub-blocks of 16 with signed 8-bit scales, an f16 scale last; 6.5625
    /// bits per weight.
    Q6K,
    /// Id 15: super-blocks of 256 in 292 bytes: an f32 scale, 256 signed bytes and 16 i16 sums of
    /// 16 codes; 9.125 bits per value (ggml's activation format for the K-quants' dot products).
    Q8K,
    /// Id 16: i-quant, super-blocks of 256 weights in 66 bytes (an f16 scale, groups of 8 weights
    /// as indices into a lattice codebook with sign and scale bits); 2.0625 bits per weight; not
    /// dequantised here.
    Iq2Xxs,
    /// Id 17: i-quant, super-blocks of 256 weights in 74 bytes (IQ2_XXS with a larger codebook and
    /// 4-bit scales per 16 weights); 2.3125 bits per weight; not dequantised here.
    Iq2Xs,
    /// Id 18: i-quant, super-blocks of 256 weights in 98 bytes (groups of 4 weights from a
    /// codebook, signs and scales packed alongside); 3.0625 bits per weight; not dequantised here.
    Iq3Xxs,
    /// Id 19: i-quant, super-blocks of 256 weights in 50 bytes (groups of 8 from a ternary
    /// codebook, 3-bit scales, a shift); 1.5625 bits per weight; not dequantised here.
    Iq1S,
    /// Id 20: blocks of 32 weights in 18 bytes, an f16 scale and 32 4-bit indices into a fixed
    /// non-linear table of 16 values; 4.5 bits per weight; not dequantised here.
    Iq4Nl,
    /// Id 21: i-quant, super-blocks of 256 weights in 110 bytes (codebook indices with high bits,
    /// explicit signs, 4-bit scales); 3.4375 bits per weight; not dequantised here.
    Iq3S,
    /// Id 22: i-quant, super-blocks of 256 weights in 82 bytes (codebook indices with high bits,
    /// 4-bit scales); 2.5625 bits per weight; not dequantised here.
    Iq2S,
    /// Id 23: super-blocks of 256 weights in 136 bytes, IQ4_NL's table with 6-bit scales per 32
    /// weights under an f16 scale; 4.25 bits per weight; not dequantised here.
    Iq4Xs,
    /// Id 24: signed 8-bit integers; not dequantised here.
    I8,
    /// Id 25: signed 16-bit integers; not dequantised here.
    I16,
    /// Id 26: signed 32-bit integers; not dequantised here.
    I32,
    /// Id 27: signed 64-bit integers; not dequantised here.
    I64,
    /// Id 28: 64-bit IEEE floats (narrowed to f32 when dequantised).
    F64,
    /// Id 29: i-quant, super-blocks of 256 weights in 56 bytes (ternary codebook groups, 3-bit
    /// scales with the f16 super-scale packed among them); 1.75 bits per weight; not dequantised
    /// here.
    Iq1M,
    /// Id 30: bfloat16 (f32's upper 16 bits), 16 bits per weight.
    Bf16,
    /// Id 34: ternary (-1, 0, 1 times an f16 scale), super-blocks of 256 in 54 bytes, codes packed
    /// five (or four) per byte in base 3; 1.6875 bits per weight; not dequantised here.
    Tq1_0,
    /// Id 35: ternary (-1, 0, 1 times an f16 scale), super-blocks of 256 in 66 bytes, 2 bits per
    /// code; 2.0625 bits per weight; not dequantised here.
    Tq2_0,
    /// Id 39: OCP microscaling FP4, blocks of 32 in 17 bytes: an E8M0 (power-of-two) scale and 32
    /// E2M1 4-bit floats; 4.25 bits per weight; not dequantised here.
    Mxfp4,
    /// Id 40: NVIDIA FP4, blocks of 64 in 36 bytes: four UE4M3 scales (one per 16 weights) and 64
    /// E2M1 4-bit floats; 4.5 bits per weight; not dequantised here.
    Nvfp4,
    /// Id 41: blocks of 128 weights in 18 bytes, an f16 scale `d` and one sign bit per weight
    /// (weight `+d` or `-d`); 1.125 bits per weight; not dequantised here.
    Q1_0,
}

const QK_K: u64 = 256;

impl GgmlType {
    /// The type of ggml's id (`enum ggml_type`); ids of removed types (4, 5, 31..=33, 36..=38)
    /// and unknown ones give `None`.
    pub fn from_id(id: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            16 => Iq2Xxs,
            17 => Iq2Xs,
            18 => Iq3Xxs,
            19 => Iq1S,
            20 => Iq4Nl,
            21 => Iq3S,
            22 => Iq2S,
            23 => Iq4Xs,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => Iq1M,
            30 => Bf16,
            34 => Tq1_0,
            35 => Tq2_0,
            39 => Mxfp4,
            40 => Nvfp4,
            41 => Q1_0,
            _ => return None,
        })
    }

    /// (id, name, elements per block, bytes per block).
    fn traits(self) -> (u32, &'static str, u64, u64) {
        use GgmlType::*;
        match self {
            F32 => (0, "F32", 1, 4),
            F16 => (1, "F16", 1, 2),
            Q4_0 => (2, "Q4_0", 32, 18),
            Q4_1 => (3, "Q4_1", 32, 20),
            Q5_0 => (6, "Q5_0", 32, 22),
            Q5_1 => (7, "Q5_1", 32, 24),
            Q8_0 => (8, "Q8_0", 32, 34),
            Q8_1 => (9, "Q8_1", 32, 36),
            Q2K => (10, "Q2_K", QK_K, 84),
            Q3K => (11, "Q3_K", QK_K, 110),
            Q4K => (12, "Q4_K", QK_K, 144),
            Q5K => (13, "Q5_K", QK_K, 176),
            Q6K => (14, "Q6_K", QK_K, 210),
            Q8K => (15, "Q8_K", QK_K, 292),
            Iq2Xxs => (16, "IQ2_XXS", QK_K, 66),
            Iq2Xs => (17, "IQ2_XS", QK_K, 74),
            Iq3Xxs => (18, "IQ3_XXS", QK_K, 98),
            Iq1S => (19, "IQ1_S", QK_K, 50),
            Iq4Nl => (20, "IQ4_NL", 32, 18),
            Iq3S => (21, "IQ3_S", QK_K, 110),
            Iq2S => (22, "IQ2_S", QK_K, 82),
            Iq4Xs => (23, "IQ4_XS", QK_K, 136),
            I8 => (24, "I8", 1, 1),
            I16 => (25, "I16", 1, 2),
            I32 => (26, "I32", 1, 4),
            I64 => (27, "I64", 1, 8),
            F64 => (28, "F64", 1, 8),
            Iq1M => (29, "IQ1_M", QK_K, 56),
            Bf16 => (30, "BF16", 1, 2),
            Tq1_0 => (34, "TQ1_0", QK_K, 54),
            Tq2_0 => (35, "TQ2_0", QK_K, 66),
            Mxfp4 => (39, "MXFP4", 32, 17),
            Nvfp4 => (40, "NVFP4", 64, 36),
            Q1_0 => (41, "Q1_0", 128, 18),
        }
    }

    /// ggml's id of the type (`enum ggml_type`), as stored in a tensor info (the inverse of
    /// [`GgmlType::from_id`]).
    pub fn id(self) -> u32 {
        self.traits().0
    }

    /// ggml's name (`Q4_K`, `BF16`, ...).
    pub fn name(self) -> &'static str {
        self.traits().1
    }

    /// Elements per block (1 for the plain types).
    pub fn block_size(self) -> u64 {
        self.traits().2
    }

    /// Bytes per block.
    pub fn type_size(self) -> u64 {
        self.traits().3
    }

    /// Whether [`dequantize`] decodes this type.
    pub fn can_dequantize(self) -> bool {
        use GgmlType::*;
        matches!(self, F32 | F16 | Bf16 | F64 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2K | Q3K | Q4K | Q5K | Q6K | Q8K)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One entry of the tensor table. Dimensions are in ggml order: `dims()[0]` is the contiguous
/// one (a row), so a PyTorch `[out, in]` weight appears as `[in, out]`.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo<'a> {
    name: &'a str,
    dims: [u64; MAX_DIMS],
    n_dims: usize,
    ggml_type: GgmlType,
    offset: u64,
    n_elements: u64,
    n_bytes: u64,
    info_offset: u64,
}

impl<'a> TensorInfo<'a> {
    /// The tensor's name (`blk.0.attn_q.weight`), borrowed from the file.
    pub fn name(&self) -> &'a str {
        self.name
    }
    /// The dimensions, 0 to [`MAX_DIMS`] of them, contiguous first (`[in, out]` for a weight
    /// matrix).
    pub fn dims(&self) -> &[u64] {
        self.dims.get(..self.n_dims).unwrap_or_default()
    }
    /// The type the tensor's bytes are stored in.
    pub fn ggml_type(&self) -> GgmlType {
        self.ggml_type
    }
    /// Offset of the tensor's bytes from the start of the data section.
    pub fn offset(&self) -> u64 {
        self.offset
    }
    /// Elements: the product of the dimensions (1 for a 0-dimensional tensor).
    pub fn n_elements(&self) -> u64 {
        self.n_elements
    }
    /// Bytes of the tensor's data: `n_elements / block_size * type_size` of its type.
    pub fn n_bytes(&self) -> u64 {
        self.n_bytes
    }
    /// Elements of one row (`dims()[0]`; 1 for a 0-dimensional tensor).
    pub fn row_len(&self) -> u64 {
        self.dims().first().copied().unwrap_or(1)
    }
    /// Rows: the product of the other dimensions.
    pub fn n_rows(&self) -> u64 {
        self.dims().iter().skip(1).product()
    }
}

/// A parsed GGUF file, borrowing from its bytes.
pub struct Gguf<'a> {
    bytes: &'a [u8],
    version: u32,
    metadata: Vec<(&'a str, Value<'a>)>,
    metadata_index: HashMap<&'a str, usize>,
    tensors: Vec<TensorInfo<'a>>,
    tensor_index: HashMap<&'a str, usize>,
    alignment: u64,
    data_offset: u64,
}

impl fmt::Debug for Gguf<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gguf")
            .field("bytes", &self.bytes.len())
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

/// Fewest bytes of one metadata entry (empty key, type, a one-byte value) and of one tensor info
/// (empty name, n_dims = 0, type, offset): bound the header's counts before anything is reserved.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;

impl<'a> Gguf<'a> {
    /// Parses the header, metadata and tensor table, and checks that every tensor lies inside
    /// `bytes`; tensor data is not touched.
    pub fn parse(bytes: &'a [u8]) -> Result<Self> {
        let mut cur = Cursor::new(bytes, 0);
        let magic = cur.take(4, "magic").map_err(|e| in_context(e, "not a GGUF file (too short)"))?;
        if magic != MAGIC {
            return Err(format_err(0, format!("magic is \"{}\", not \"GGUF\": not a GGUF file", magic.escape_ascii())));
        }
        let version = cur.u32("version")?;
        match version {
            2 | 3 => {}
            1 => {
                return Err(format_err(
                    4,
                    "GGUF version 1 (32-bit counts) is not supported; re-convert the model with a current llama.cpp",
                ));
            }
            v if matches!(v.swap_bytes(), 2 | 3) => return Err(format_err(4, "big-endian GGUF files are not supported")),
            v => return Err(format_err(4, format!("GGUF version {v} is not supported (2 and 3 are)"))),
        }
        let n_tensors = cur.u64("tensor count")?;
        let n_kv_at = cur.offset();
        let n_kv = cur.u64("metadata count")?;
        let left = cur.remaining();
        let least = u128::from(n_kv) * u128::from(MIN_KV_BYTES) + u128::from(n_tensors) * u128::from(MIN_TENSOR_INFO_BYTES);
        if least > u128::from(left) {
            return Err(format_err(
                8,
                format!("{n_tensors} tensors and {n_kv} metadata entries need at least {least} bytes but only {left} are left"),
            ));
        }
        // Both counts now fit in memory: each is below the file's length.
        let n_kv = usize::try_from(n_kv).map_err(|_| format_err(n_kv_at, "metadata count overflows usize"))?;
        let n_tensors = usize::try_from(n_tensors).map_err(|_| format_err(8, "tensor count overflows usize"))?;

        let mut metadata = Vec::with_capacity(n_kv);
        let mut metadata_index = HashMap::with_capacity(n_kv);
        let mut alignment_at = 0;
        for i in 0..n_kv {
            let key_at = cur.offset();
            let key = cur.string("metadata key").map_err(|e| in_context(e, format!("metadata entry {i}")))?;
            let key = utf8_at(key, key_at, &format!("metadata key {i}"))?;
            let ty_at = cur.offset();
            let ty_id = cur.u32("value type").map_err(|e| in_context(e, format!("metadata `{key}`")))?;
            let ty =
                ValueType::from_id(ty_id).ok_or_else(|| format_err(ty_at, format!("metadata `{key}` has unknown value type {ty_id}")))?;
            if key == "general.alignment" {
                alignment_at = cur.offset();
            }
            let value = read_value(&mut cur, ty, 0).map_err(|e| in_context(e, format!("metadata `{key}`")))?;
            if metadata_index.insert(key, metadata.len()).is_some() {
                return Err(format_err(key_at, format!("metadata key `{key}` appears twice")));
            }
            metadata.push((key, value));
        }

        let alignment = match metadata_index.get("general.alignment").and_then(|&i| metadata.get(i)) {
            None => DEFAULT_ALIGNMENT,
            Some((_, v)) => match v.as_u64() {
                Some(a) if a.is_power_of_two() => a,
                _ => return Err(format_err(alignment_at, format!("general.alignment is {} {v}, not a power of two", v.value_type()))),
            },
        };

        let mut tensors = Vec::with_capacity(n_tensors);
        let mut tensor_index = HashMap::with_capacity(n_tensors);
        for i in 0..n_tensors {
            let info_offset = cur.offset();
            let t = read_tensor_info(&mut cur, info_offset).map_err(|e| in_context(e, format!("tensor info {i}")))?;
            if tensor_index.insert(t.name, tensors.len()).is_some() {
                return Err(format_err(info_offset, format!("tensor `{}` appears twice", t.name)));
            }
            tensors.push(t);
        }

        let header_end = cur.offset();
        let data_offset = header_end
            .checked_next_multiple_of(alignment)
            .ok_or_else(|| format_err(header_end, format!("the data section's offset overflows with alignment {alignment}")))?;
        let len = bytes.len() as u64;
        for t in &tensors {
            if t.offset % alignment != 0 {
                return Err(format_err(
                    t.info_offset,
                    format!("tensor `{}` has data offset {}, not a multiple of the alignment {alignment}", t.name, t.offset),
                ));
            }
            let end = data_offset.checked_add(t.offset).and_then(|s| s.checked_add(t.n_bytes));
            if end.is_none_or(|end| end > len) {
                return Err(format_err(
                    t.info_offset,
                    format!(
                        "tensor `{}` ({} bytes at data offset {} + {}) runs past the end of the file ({len} bytes)",
                        t.name, t.n_bytes, data_offset, t.offset
                    ),
                ));
            }
        }

        Ok(Gguf { bytes, version, metadata, metadata_index, tensors, tensor_index, alignment, data_offset })
    }

    /// The file's GGUF version: 2 or 3, the only ones parsed.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// `general.alignment`, or 32.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// File offset of the data section: the end of the tensor table rounded up to the alignment.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// The metadata in file order.
    pub fn metadata(&self) -> impl ExactSizeIterator<Item = (&'a str, &Value<'a>)> + '_ {
        self.metadata.iter().map(|(k, v)| (*k, v))
    }

    /// The value of metadata key `key`; `None` when the file does not have it.
    pub fn get(&self, key: &str) -> Option<&Value<'a>> {
        self.metadata_index.get(key).and_then(|&i| self.metadata.get(i)).map(|(_, v)| v)
    }

    fn require(&self, key: &str) -> Result<&Value<'a>> {
        self.get(key).ok_or_else(|| model_err(format!("metadata key `{key}` is missing")))
    }

    fn mistyped(key: &str, v: &Value<'_>, wanted: &str) -> Error {
        model_err(format!("metadata `{key}` is {} {v}, expected {wanted}", v.value_type()))
    }

    /// An unsigned integer of any width that fits u64.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let v = self.require(key)?;
        v.as_u64().ok_or_else(|| Self::mistyped(key, v, "a non-negative integer"))
    }

    /// An integer of any width that fits u32.
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        let v = self.require(key)?;
        v.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(|| Self::mistyped(key, v, "an integer in 0..2^32"))
    }

    /// A float (or integer) as f32.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        let v = self.require(key)?;
        v.as_f64().map(|x| x as f32).ok_or_else(|| Self::mistyped(key, v, "a number"))
    }

    /// A bool; an error when the key is missing or holds another type.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| Self::mistyped(key, v, "a bool"))
    }

    /// A string, borrowed from the file; an error when the key is missing, holds another type or is
    /// not UTF-8.
    pub fn get_str(&self, key: &str) -> Result<&'a str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| Self::mistyped(key, v, "a UTF-8 string"))
    }

    /// An array of any element type; an error when the key is missing or holds another type.
    pub fn get_array(&self, key: &str) -> Result<&Array<'a>> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| Self::mistyped(key, v, "an array"))
    }

    /// `Ok(None)` when the key is absent; an error when it is present with the wrong type.
    pub fn opt<T>(&self, key: &str, get: impl FnOnce(&Self, &str) -> Result<T>) -> Result<Option<T>> {
        if self.get(key).is_some() { get(self, key).map(Some) } else { Ok(None) }
    }

    /// The tensor table, in file order.
    pub fn tensors(&self) -> &[TensorInfo<'a>] {
        &self.tensors
    }

    /// The tensor named `name`; `None` when the file has none of that name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo<'a>> {
        self.tensor_index.get(name).and_then(|&i| self.tensors.get(i))
    }

    fn require_tensor(&self, name: &str) -> Result<&TensorInfo<'a>> {
        self.tensor(name).ok_or_else(|| model_err(format!("tensor `{name}` is not in the file")))
    }

    /// The tensor's bytes as stored (for upload to the GPU and in-kernel dequantisation).
    pub fn data(&self, t: &TensorInfo<'_>) -> Result<&'a [u8]> {
        let range = self
            .data_offset
            .checked_add(t.offset)
            .and_then(|s| Some((s, s.checked_add(t.n_bytes)?)))
            .and_then(|(s, e)| Some(usize::try_from(s).ok()?..usize::try_from(e).ok()?));
        range.and_then(|r| self.bytes.get(r)).ok_or_else(|| format_err(t.info_offset, format!("tensor `{}` lies outside the file", t.name)))
    }

    /// The named tensor's bytes as stored ([`Gguf::data`]); an error when the file has no such
    /// tensor.
    pub fn tensor_data(&self, name: &str) -> Result<&'a [u8]> {
        self.data(self.require_tensor(name)?)
    }

    /// The tensor dequantised to f32, in ggml element order (row-major, `dims()[0]` fastest).
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.require_tensor(name)?;
        if !t.ggml_type.can_dequantize() {
            return Err(unsupported(t.ggml_type, &format!("tensor `{name}`")));
        }
        let bytes = self.data(t)?;
        let n = usize::try_from(t.n_elements).map_err(|_| model_err(format!("tensor `{name}` has too many elements for this platform")))?;
        let mut out = vec![0f32; n];
        dequantize(t.ggml_type, bytes, &mut out)?;
        Ok(out)
    }
}

fn read_tensor_info<'a>(cur: &mut Cursor<'a>, info_offset: u64) -> Result<TensorInfo<'a>> {
    let name = cur.string("tensor name")?;
    let name = utf8_at(name, info_offset, "tensor name")?;
    let ctx = |e| in_context(e, format!("tensor `{name}`"));
    let dims_at = cur.offset();
    let n_dims = cur.u32("n_dims").map_err(ctx)?;
    let n_dims = usize::try_from(n_dims)
        .ok()
        .filter(|&n| n <= MAX_DIMS)
        .ok_or_else(|| format_err(dims_at, format!("tensor `{name}` has {n_dims} dimensions, more than {MAX_DIMS}")))?;
    let mut dims = [1u64; MAX_DIMS];
    let mut n_elements: u64 = 1;
    for d in dims.iter_mut().take(n_dims) {
        let at = cur.offset();
        *d = cur.u64("dimension").map_err(ctx)?;
        n_elements = n_elements
            .checked_mul(*d)
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| format_err(at, format!("tensor `{name}`: the element count overflows")))?;
    }
    let ty_at = cur.offset();
    let ty_id = cur.u32("ggml type").map_err(ctx)?;
    let ggml_type =
        GgmlType::from_id(ty_id).ok_or_else(|| format_err(ty_at, format!("tensor `{name}` has unknown ggml type id {ty_id}")))?;
    let offset = cur.u64("data offset").map_err(ctx)?;
    let row = if n_dims == 0 { 1 } else { dims[0] };
    if row % ggml_type.block_size() != 0 {
        return Err(format_err(
            dims_at,
            format!(
                "tensor `{name}` of type {ggml_type} has rows of {row} elements, not a multiple of its block size {}",
                ggml_type.block_size()
            ),
        ));
    }
    // n_elements is a whole number of blocks because its first factor is.
    let n_bytes = (n_elements / ggml_type.block_size())
        .checked_mul(ggml_type.type_size())
        .ok_or_else(|| format_err(dims_at, format!("tensor `{name}`: the byte size overflows")))?;
    Ok(TensorInfo { name, dims, n_dims, ggml_type, offset, n_elements, n_bytes, info_offset })
}

mod dequant;
#[cfg(test)]
mod tests;
pub mod writer;

pub use dequant::dequantize;
use dequant::unsupported;

/// The real model of RECIPES.md, read once per test binary: `None` (a skip of `test`, recorded
/// as every test's skip is: `expertkv_tests::skip`) when
/// `models/SmolLM2-135M-Instruct.Q4_1.gguf` is missing, unless `EXPERTKV_REQUIRE_MODEL` is set,
/// in which case a missing file fails the test. `EXPERTKV_MODELS_DIR` moves the folder, as it does
/// for `scripts/fetch_model.sh`.
#[cfg(test)]
pub(crate) fn test_model_bytes(test: &str) -> Option<&'static [u8]> {
    use std::sync::OnceLock;
    static BYTES: OnceLock<Result<Vec<u8>, String>> = OnceLock::new();
    let dir = std::env::var_os("EXPERTKV_MODELS_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models"));
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let loaded = BYTES.get_or_init(|| std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display())));
    match loaded {
        Ok(b) => Some(b),
        Err(e) if std::env::var_os("EXPERTKV_REQUIRE_MODEL").is_some() => {
            panic!("{test}: EXPERTKV_REQUIRE_MODEL is set but the model cannot be read ({e}); run scripts/fetch_model.sh")
        }
        Err(e) => {
            expertkv_tests::skip(
                test,
                format!("no model ({e}); run scripts/fetch_model.sh (EXPERTKV_REQUIRE_MODEL=1 makes this a failure)"),
            );
            None
        }
    }
}

/// Records the largest single allocation made on the current thread, so the fuzz test can assert
/// that malformed counts never turn into huge reservations. Installed for this crate's unit-test
/// binary only; the cost is one thread-local read per allocation.
#[cfg(test)]
mod alloc_track {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    thread_local! {
        static LARGEST: Cell<usize> = const { Cell::new(0) };
    }

    fn note(size: usize) {
        let _ = LARGEST.try_with(|l| {
            if size > l.get() {
                l.set(size);
            }
        });
    }

    pub fn reset() {
        LARGEST.with(|l| l.set(0));
    }

    pub fn largest() -> usize {
        LARGEST.with(Cell::get)
    }

    pub struct Tracking;

    // SAFETY: every call forwards to `System` with the caller's arguments unchanged.
    unsafe impl GlobalAlloc for Tracking {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            note(layout.size());
            // SAFETY: forwarded as received.
            unsafe { System.alloc(layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            note(layout.size());
            // SAFETY: forwarded as received.
            unsafe { System.alloc_zeroed(layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            note(new_size);
            // SAFETY: forwarded as received.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: forwarded as received.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    #[global_allocator]
    static GLOBAL: Tracking = Tracking;
}
