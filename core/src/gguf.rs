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

use crate::error::{Error, Result};

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

fn model_err(what: impl Into<String>) -> Error {
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
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
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
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    /// The raw bytes: GGUF says UTF-8 but nothing enforces it; [`Value::as_str`] checks.
    String(&'a [u8]),
    Array(Array<'a>),
}

impl<'a> Value<'a> {
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
    pub fn elem_type(&self) -> ValueType {
        self.elem
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// File offset of the first element.
    pub fn offset(&self) -> u64 {
        self.offset
    }

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
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Iq2Xxs,
    Iq2Xs,
    Iq3Xxs,
    Iq1S,
    Iq4Nl,
    Iq3S,
    Iq2S,
    Iq4Xs,
    I8,
    I16,
    I32,
    I64,
    F64,
    Iq1M,
    Bf16,
    Tq1_0,
    Tq2_0,
    Mxfp4,
    Nvfp4,
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
    pub fn name(&self) -> &'a str {
        self.name
    }
    pub fn dims(&self) -> &[u64] {
        self.dims.get(..self.n_dims).unwrap_or_default()
    }
    pub fn ggml_type(&self) -> GgmlType {
        self.ggml_type
    }
    /// Offset of the tensor's bytes from the start of the data section.
    pub fn offset(&self) -> u64 {
        self.offset
    }
    pub fn n_elements(&self) -> u64 {
        self.n_elements
    }
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

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| Self::mistyped(key, v, "a bool"))
    }

    pub fn get_str(&self, key: &str) -> Result<&'a str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| Self::mistyped(key, v, "a UTF-8 string"))
    }

    pub fn get_array(&self, key: &str) -> Result<&Array<'a>> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| Self::mistyped(key, v, "an array"))
    }

    /// `Ok(None)` when the key is absent; an error when it is present with the wrong type.
    pub fn opt<T>(&self, key: &str, get: impl FnOnce(&Self, &str) -> Result<T>) -> Result<Option<T>> {
        if self.get(key).is_some() { get(self, key).map(Some) } else { Ok(None) }
    }

    pub fn tensors(&self) -> &[TensorInfo<'a>] {
        &self.tensors
    }

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

fn unsupported(ty: GgmlType, what: &str) -> Error {
    model_err(format!(
        "{what} has type {ty}, which expertkv cannot dequantise on the CPU (it can: F32, F16, BF16, F64, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K)"
    ))
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Decodes `src`, whole blocks of `ty`, into `dst`, whose length must be the blocks' element
/// count.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let (block, size) = (ty.block_size(), ty.type_size());
    let blocks = src.len() as u64 / size;
    if !(src.len() as u64).is_multiple_of(size) || Some(dst.len() as u64) != blocks.checked_mul(block) {
        return Err(Error::Input(format!(
            "dequantize {ty}: {} bytes are not whole {size}-byte blocks of {block} elements each for {} outputs",
            src.len(),
            dst.len()
        )));
    }
    use GgmlType::*;
    match ty {
        F32 => each::<4, 1>(src, dst, |b, y| y[0] = f32::from_le_bytes(*b)),
        F16 => each::<2, 1>(src, dst, |b, y| y[0] = f16_at(b, 0)),
        Bf16 => each::<2, 1>(src, dst, |b, y| y[0] = half::bf16::from_bits(u16::from_le_bytes(*b)).to_f32()),
        F64 => each::<8, 1>(src, dst, |b, y| y[0] = f64::from_le_bytes(*b) as f32),
        Q4_0 => each::<18, 32>(src, dst, block_q4_0),
        Q4_1 => each::<20, 32>(src, dst, block_q4_1),
        Q5_0 => each::<22, 32>(src, dst, block_q5_0),
        Q5_1 => each::<24, 32>(src, dst, block_q5_1),
        Q8_0 => each::<34, 32>(src, dst, block_q8_0),
        Q2K => each::<84, 256>(src, dst, block_q2_k),
        Q3K => each::<110, 256>(src, dst, block_q3_k),
        Q4K => each::<144, 256>(src, dst, block_q4_k),
        Q5K => each::<176, 256>(src, dst, block_q5_k),
        Q6K => each::<210, 256>(src, dst, block_q6_k),
        Q8K => each::<292, 256>(src, dst, block_q8_k),
        other => return Err(unsupported(other, "the data")),
    }
    Ok(())
}

/// Applies `f` to each (block, outputs) pair; the sizes were checked by the caller.
fn each<const S: usize, const B: usize>(src: &[u8], dst: &mut [f32], f: impl Fn(&[u8; S], &mut [f32; B])) {
    let (blocks, _) = src.as_chunks::<S>();
    let (outs, _) = dst.as_chunks_mut::<B>();
    for (b, y) in blocks.iter().zip(outs.iter_mut()) {
        f(b, y);
    }
}

/// Q4_0: f16 scale d, then 16 bytes whose low nibbles are elements 0..16 and high nibbles
/// 16..32; x = (q - 8) * d.
fn block_q4_0(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        let q = b[2 + j];
        y[j] = (i32::from(q & 0xf) - 8) as f32 * d;
        y[j + 16] = (i32::from(q >> 4) - 8) as f32 * d;
    }
}

/// Q4_1: f16 d, f16 m, 16 bytes of nibbles as Q4_0; x = q * d + m.
fn block_q4_1(b: &[u8; 20], y: &mut [f32; 32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for j in 0..16 {
        let q = b[4 + j];
        y[j] = f32::from(q & 0xf) * d + m;
        y[j + 16] = f32::from(q >> 4) * d + m;
    }
}

/// Q5_0: f16 d, u32 of fifth bits (bit j for element j), 16 bytes of nibbles; x = (q - 16) * d.
fn block_q5_0(b: &[u8; 22], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for j in 0..16 {
        let q = b[6 + j];
        let lo = u32::from(q & 0xf) | (((qh >> j) & 1) << 4);
        let hi = u32::from(q >> 4) | (((qh >> (j + 16)) & 1) << 4);
        y[j] = (lo as i32 - 16) as f32 * d;
        y[j + 16] = (hi as i32 - 16) as f32 * d;
    }
}

/// Q5_1: f16 d, f16 m, u32 of fifth bits, 16 bytes of nibbles; x = q * d + m.
fn block_q5_1(b: &[u8; 24], y: &mut [f32; 32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for j in 0..16 {
        let q = b[8 + j];
        let lo = u32::from(q & 0xf) | (((qh >> j) & 1) << 4);
        let hi = u32::from(q >> 4) | (((qh >> (j + 16)) & 1) << 4);
        y[j] = lo as f32 * d + m;
        y[j + 16] = hi as f32 * d + m;
    }
}

/// Q8_0: f16 d, 32 i8; x = q * d.
fn block_q8_0(b: &[u8; 34], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = f32::from(b[2 + j] as i8) * d;
    }
}

/// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block's 12 packed bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    let (sc, m) =
        if j < 4 { (q[j] & 63, q[j + 4] & 63) } else { ((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)) };
    (f32::from(sc), f32::from(m))
}

/// Q2_K: 16 bytes of 4-bit scale/min pairs, 64 bytes of 2-bit quants, f16 d, f16 dmin.
fn block_q2_k(b: &[u8; 84], y: &mut [f32; 256]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let mut out = 0;
    let mut is = 0;
    for n in 0..2 {
        let q = &qs[32 * n..32 * n + 32];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let sc = scales[is];
                is += 1;
                let (dl, ml) = (d * f32::from(sc & 0xf), dmin * f32::from(sc >> 4));
                for l in 0..16 {
                    y[out] = dl * f32::from((q[16 * half + l] >> shift) & 3) - ml;
                    out += 1;
                }
            }
        }
    }
}

/// Q3_K: 32 bytes of high bits, 64 bytes of 2-bit quants, 12 bytes of packed 6-bit scales, f16 d.
fn block_q3_k(b: &[u8; 110], y: &mut [f32; 256]) {
    let (hmask, qs, packed) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    // Unpack the sixteen 6-bit scales as ggml does (low 4 bits from bytes 0..8, high 2 from 8..12).
    let mut scales = [0i8; 16];
    for (i, s) in scales.iter_mut().enumerate() {
        let low = if i < 8 { packed[i] & 0xf } else { packed[i - 8] >> 4 };
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        *s = (low | (high << 4)) as i8 - 32;
    }
    let mut out = 0;
    let mut is = 0;
    let mut m = 1u8;
    for n in 0..2 {
        let q = &qs[32 * n..32 * n + 32];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let dl = d * f32::from(scales[is]);
                is += 1;
                for l in 0..16 {
                    let k = 16 * half + l;
                    let v = i32::from((q[k] >> shift) & 3) - if hmask[k] & m != 0 { 0 } else { 4 };
                    y[out] = dl * v as f32;
                    out += 1;
                }
            }
            m <<= 1;
        }
    }
}

/// Q4_K: f16 d, f16 dmin, 12 bytes of packed 6-bit scales/mins, 128 bytes of nibbles (each 32
/// bytes hold two 32-element sub-blocks: low nibbles then high).
fn block_q4_k(b: &[u8; 144], y: &mut [f32; 256]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for j in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * j, scales);
        let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
        let q = &qs[32 * j..32 * j + 32];
        for l in 0..32 {
            y[64 * j + l] = d * sc1 * f32::from(q[l] & 0xf) - dmin * m1;
            y[64 * j + 32 + l] = d * sc2 * f32::from(q[l] >> 4) - dmin * m2;
        }
    }
}

/// Q5_K: Q4_K plus 32 bytes of fifth bits (bit 2j / 2j+1 of byte l for sub-blocks 2j / 2j+1).
fn block_q5_k(b: &[u8; 176], y: &mut [f32; 256]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for j in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * j, scales);
        let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
        let q = &qs[32 * j..32 * j + 32];
        for l in 0..32 {
            let h1 = if qh[l] & (1 << (2 * j)) != 0 { 16.0 } else { 0.0 };
            let h2 = if qh[l] & (2 << (2 * j)) != 0 { 16.0 } else { 0.0 };
            y[64 * j + l] = d * sc1 * (f32::from(q[l] & 0xf) + h1) - dmin * m1;
            y[64 * j + 32 + l] = d * sc2 * (f32::from(q[l] >> 4) + h2) - dmin * m2;
        }
    }
}

/// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 i8 scales, f16 d; x = d * s * (q - 32).
fn block_q6_k(b: &[u8; 210], y: &mut [f32; 256]) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for n in 0..2 {
        let (ql, qh, sc, y) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..], &mut y[128 * n..]);
        for l in 0..32 {
            let is = l / 16;
            let q1 = i32::from((ql[l] & 0xf) | ((qh[l] & 3) << 4)) - 32;
            let q2 = i32::from((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
            let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            let s = |k: usize| d * f32::from(sc[is + k] as i8);
            y[l] = s(0) * q1 as f32;
            y[l + 32] = s(2) * q2 as f32;
            y[l + 64] = s(4) * q3 as f32;
            y[l + 96] = s(6) * q4 as f32;
        }
    }
}

/// Q8_K: f32 d, 256 i8, 16 i16 block sums (unused here); x = q * d.
fn block_q8_k(b: &[u8; 292], y: &mut [f32; 256]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for j in 0..256 {
        y[j] = f32::from(b[4 + j] as i8) * d;
    }
}

/// The hyper-parameters of a Llama-architecture model, from its GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// `llama.block_count`: transformer layers.
    pub block_count: u32,
    /// `llama.embedding_length`: the hidden size.
    pub embedding_length: u32,
    /// `llama.feed_forward_length`: the FFN's inner size (SwiGLU).
    pub feed_forward_length: u32,
    /// `llama.attention.head_count`: query heads.
    pub head_count: u32,
    /// `llama.attention.head_count_kv` (default: `head_count`).
    pub head_count_kv: u32,
    /// `llama.attention.key_length` (default: `embedding_length / head_count`).
    pub head_dim: u32,
    /// `llama.rope.freq_base` (default 10000).
    pub rope_freq_base: f32,
    /// `llama.rope.dimension_count` (default: `head_dim`).
    pub rope_dimension_count: u32,
    /// `llama.attention.layer_norm_rms_epsilon`.
    pub rms_norm_eps: f32,
    /// `llama.context_length`: the trained context.
    pub context_length: u32,
    /// Entries of `tokenizer.ggml.tokens` (checked against `llama.vocab_size` when present).
    pub vocab_size: u32,
    /// `llama.expert_count` / `llama.expert_used_count` (0 for a dense model).
    pub expert_count: u32,
    pub expert_used_count: u32,
}

impl LlamaConfig {
    /// Reads and checks the hyper-parameters; `general.architecture` must be `llama`.
    pub fn from_gguf(g: &Gguf<'_>) -> Result<Self> {
        let arch = g.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(model_err(format!("general.architecture is `{arch}`; only `llama` is supported")));
        }
        let embedding_length = g.get_u32("llama.embedding_length")?;
        let head_count = g.get_u32("llama.attention.head_count")?;
        if head_count == 0 || embedding_length == 0 || embedding_length % head_count != 0 {
            return Err(model_err(format!(
                "llama.embedding_length {embedding_length} is not a positive multiple of head_count {head_count}"
            )));
        }
        let head_count_kv = g.opt("llama.attention.head_count_kv", Gguf::get_u32)?.unwrap_or(head_count);
        if head_count_kv == 0 || head_count % head_count_kv != 0 {
            return Err(model_err(format!("llama.attention.head_count_kv {head_count_kv} does not divide head_count {head_count}")));
        }
        let head_dim = g.opt("llama.attention.key_length", Gguf::get_u32)?.unwrap_or(embedding_length / head_count);
        let tokens = g.get_array("tokenizer.ggml.tokens")?.len();
        let vocab_size = u32::try_from(tokens).map_err(|_| model_err(format!("tokenizer.ggml.tokens has {tokens} entries")))?;
        if let Some(v) = g.opt("llama.vocab_size", Gguf::get_u32)?
            && v != vocab_size
        {
            return Err(model_err(format!("llama.vocab_size is {v} but tokenizer.ggml.tokens has {vocab_size} entries")));
        }
        let c = LlamaConfig {
            block_count: g.get_u32("llama.block_count")?,
            embedding_length,
            feed_forward_length: g.get_u32("llama.feed_forward_length")?,
            head_count,
            head_count_kv,
            head_dim,
            rope_freq_base: g.opt("llama.rope.freq_base", Gguf::get_f32)?.unwrap_or(10_000.0),
            rope_dimension_count: g.opt("llama.rope.dimension_count", Gguf::get_u32)?.unwrap_or(head_dim),
            rms_norm_eps: g.get_f32("llama.attention.layer_norm_rms_epsilon")?,
            context_length: g.get_u32("llama.context_length")?,
            vocab_size,
            expert_count: g.opt("llama.expert_count", Gguf::get_u32)?.unwrap_or(0),
            expert_used_count: g.opt("llama.expert_used_count", Gguf::get_u32)?.unwrap_or(0),
        };
        if c.expert_count > 0 && !(1..=c.expert_count).contains(&c.expert_used_count) {
            return Err(model_err(format!(
                "llama.expert_used_count {} must be in 1..={} (llama.expert_count)",
                c.expert_used_count, c.expert_count
            )));
        }
        if c.block_count == 0 || c.feed_forward_length == 0 || c.vocab_size == 0 || c.head_dim == 0 {
            return Err(model_err(format!("degenerate Llama hyper-parameters: {c:?}")));
        }
        if c.rope_dimension_count > c.head_dim || !c.rope_dimension_count.is_multiple_of(2) {
            return Err(model_err(format!(
                "llama.rope.dimension_count {} must be even and at most head_dim {}",
                c.rope_dimension_count, c.head_dim
            )));
        }
        if !(c.rms_norm_eps.is_finite() && c.rms_norm_eps > 0.0 && c.rope_freq_base.is_finite() && c.rope_freq_base > 0.0) {
            return Err(model_err(format!("RMSNorm epsilon {} and RoPE base {} must be positive", c.rms_norm_eps, c.rope_freq_base)));
        }
        Ok(c)
    }

    /// Query heads per KV head (grouped-query attention).
    pub fn group_size(&self) -> u32 {
        self.head_count / self.head_count_kv
    }

    /// Whether the LM head reuses the token embeddings (no `output.weight` tensor).
    pub fn tied_embeddings(g: &Gguf<'_>) -> bool {
        g.tensor("output.weight").is_none()
    }

    /// Checks that every tensor a Llama forward pass reads is present with the shape these
    /// hyper-parameters imply (ggml order: input dimension first). A Mixture-of-Experts file
    /// (`llama.expert_count` > 0, llama.cpp's layout) has per layer the router
    /// `ffn_gate_inp` `[hidden, E]` and the experts stacked in `ffn_gate_exps` / `ffn_up_exps`
    /// `[hidden, ffn, E]` and `ffn_down_exps` `[ffn, hidden, E]`, `ffn` being each expert's size.
    pub fn check_tensors(&self, g: &Gguf<'_>) -> Result<()> {
        let (h, f, v) = (u64::from(self.embedding_length), u64::from(self.feed_forward_length), u64::from(self.vocab_size));
        let q = u64::from(self.head_count) * u64::from(self.head_dim);
        let kv = u64::from(self.head_count_kv) * u64::from(self.head_dim);
        let want = |name: &str, dims: &[u64]| -> Result<()> {
            let t = g.tensor(name).ok_or_else(|| model_err(format!("tensor `{name}` is missing")))?;
            if t.dims() != dims {
                return Err(model_err(format!("tensor `{name}` has dims {:?}, expected {dims:?}", t.dims())));
            }
            Ok(())
        };
        want("token_embd.weight", &[h, v])?;
        want("output_norm.weight", &[h])?;
        if !Self::tied_embeddings(g) {
            want("output.weight", &[h, v])?;
        }
        for l in 0..self.block_count {
            want(&format!("blk.{l}.attn_norm.weight"), &[h])?;
            want(&format!("blk.{l}.attn_q.weight"), &[h, q])?;
            want(&format!("blk.{l}.attn_k.weight"), &[h, kv])?;
            want(&format!("blk.{l}.attn_v.weight"), &[h, kv])?;
            want(&format!("blk.{l}.attn_output.weight"), &[q, h])?;
            want(&format!("blk.{l}.ffn_norm.weight"), &[h])?;
            if self.expert_count == 0 {
                want(&format!("blk.{l}.ffn_gate.weight"), &[h, f])?;
                want(&format!("blk.{l}.ffn_up.weight"), &[h, f])?;
                want(&format!("blk.{l}.ffn_down.weight"), &[f, h])?;
            } else {
                let e = u64::from(self.expert_count);
                if g.tensor(&format!("blk.{l}.ffn_gate_exps.weight")).is_none() && g.tensor(&format!("blk.{l}.ffn_gate.0.weight")).is_some()
                {
                    return Err(model_err(
                        "this MoE file stores each expert as its own tensor (`ffn_gate.0`, the layout before llama.cpp stacked them in \
                         `ffn_gate_exps`); convert it again with a current llama.cpp",
                    ));
                }
                want(&format!("blk.{l}.ffn_gate_inp.weight"), &[h, e])?;
                want(&format!("blk.{l}.ffn_gate_exps.weight"), &[h, f, e])?;
                want(&format!("blk.{l}.ffn_up_exps.weight"), &[h, f, e])?;
                want(&format!("blk.{l}.ffn_down_exps.weight"), &[f, h, e])?;
            }
        }
        Ok(())
    }
}

/// Builds GGUF v3 files in memory: the tests' files (here, in the tokenizer's and the model's
/// tests, and the GPU tests' synthetic models, [`crate::model::synthetic`]). Whatever it is given
/// it writes; [`Gguf::parse`] is what checks.
pub mod writer {
    use super::{GgmlType, ValueType};

    /// A GGUF string: u64 length, then the bytes.
    pub fn string(s: &[u8]) -> Vec<u8> {
        let mut v = (s.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(s);
        v
    }

    /// The payload of an array value (element type, count, elements).
    pub fn array(elem: ValueType, items: &[Vec<u8>]) -> Vec<u8> {
        let mut v = elem.id().to_le_bytes().to_vec();
        v.extend_from_slice(&(items.len() as u64).to_le_bytes());
        for i in items {
            v.extend_from_slice(i);
        }
        v
    }

    /// Metadata and tensors, in the order given.
    pub struct GgufWriter {
        pub version: u32,
        alignment: u64,
        kv: Vec<u8>,
        n_kv: u64,
        tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
    }

    impl Default for GgufWriter {
        fn default() -> Self {
            Self::new()
        }
    }

    impl GgufWriter {
        /// Version 3, alignment 32.
        pub fn new() -> Self {
            GgufWriter { version: 3, alignment: 32, kv: Vec::new(), n_kv: 0, tensors: Vec::new() }
        }

        /// A metadata value from its encoded payload.
        pub fn raw(&mut self, key: &str, ty: ValueType, payload: &[u8]) -> &mut Self {
            self.kv.extend_from_slice(&string(key.as_bytes()));
            self.kv.extend_from_slice(&ty.id().to_le_bytes());
            self.kv.extend_from_slice(payload);
            self.n_kv += 1;
            self
        }
        pub fn u32(&mut self, key: &str, v: u32) -> &mut Self {
            self.raw(key, ValueType::U32, &v.to_le_bytes())
        }
        pub fn f32(&mut self, key: &str, v: f32) -> &mut Self {
            self.raw(key, ValueType::F32, &v.to_le_bytes())
        }
        pub fn bool(&mut self, key: &str, v: bool) -> &mut Self {
            self.raw(key, ValueType::Bool, &[u8::from(v)])
        }
        pub fn str(&mut self, key: &str, v: &str) -> &mut Self {
            self.raw(key, ValueType::String, &string(v.as_bytes()))
        }
        pub fn strs(&mut self, key: &str, v: &[&str]) -> &mut Self {
            let items: Vec<Vec<u8>> = v.iter().map(|s| string(s.as_bytes())).collect();
            self.raw(key, ValueType::Array, &array(ValueType::String, &items))
        }
        pub fn i32s(&mut self, key: &str, v: &[i32]) -> &mut Self {
            let items: Vec<Vec<u8>> = v.iter().map(|x| x.to_le_bytes().to_vec()).collect();
            self.raw(key, ValueType::Array, &array(ValueType::I32, &items))
        }
        /// Sets the alignment and records it as `general.alignment`.
        pub fn alignment(&mut self, a: u32) -> &mut Self {
            self.alignment = u64::from(a);
            self.u32("general.alignment", a)
        }
        /// A tensor of ggml `dims` (contiguous dimension first) whose stored bytes are `data`.
        pub fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> &mut Self {
            self.tensors.push((name.to_string(), dims.to_vec(), ty, data));
            self
        }

        /// The file's bytes.
        pub fn finish(&self) -> Vec<u8> {
            let pad = |v: &mut Vec<u8>, a: u64| v.resize((v.len() as u64).next_multiple_of(a) as usize, 0);
            let mut out = b"GGUF".to_vec();
            out.extend_from_slice(&self.version.to_le_bytes());
            out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
            out.extend_from_slice(&self.n_kv.to_le_bytes());
            out.extend_from_slice(&self.kv);
            let mut offset = 0u64;
            for (name, dims, ty, data) in &self.tensors {
                out.extend_from_slice(&string(name.as_bytes()));
                out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
                for d in dims {
                    out.extend_from_slice(&d.to_le_bytes());
                }
                out.extend_from_slice(&ty.id().to_le_bytes());
                out.extend_from_slice(&offset.to_le_bytes());
                offset = (offset + data.len() as u64).next_multiple_of(self.alignment);
            }
            pad(&mut out, self.alignment);
            for (_, _, _, data) in &self.tensors {
                out.extend_from_slice(data);
                pad(&mut out, self.alignment);
            }
            out
        }
    }
}

/// The real model of RECIPES.md, read once per test binary: `None` (with a notice) when
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
            eprintln!("{test}: skipped, no model ({e}); run scripts/fetch_model.sh (set EXPERTKV_REQUIRE_MODEL=1 to make this a failure)");
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

#[cfg(test)]
mod tests {
    use super::writer::{GgufWriter, array, string};
    use super::*;
    use crate::rng::Rng;

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
        let nested =
            array(ValueType::Array, &[array(ValueType::String, &[string(b"x"), string(b"yz")]), array(ValueType::Bool, &[vec![1]])]);
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

    /// Everything a consumer might do with a parsed file; results are ignored, only panics and
    /// allocations matter to the fuzz test.
    fn exercise(bytes: &[u8]) -> bool {
        let Ok(g) = Gguf::parse(bytes) else { return false };
        for (_, v) in g.metadata() {
            let _ = v.to_string();
            if let Some(a) = v.as_array() {
                let _ = (a.to_strs(), a.to_i64s(), a.to_f32s());
                for e in a.iter() {
                    if let Ok(Value::Array(inner)) = e {
                        let _ = (inner.to_strs(), inner.iter().count());
                    }
                }
            }
        }
        for t in g.tensors() {
            let _ = g.data(t);
            let _ = g.tensor_f32(t.name());
        }
        if let Ok(c) = LlamaConfig::from_gguf(&g) {
            let _ = c.check_tensors(&g);
        }
        if let Ok(t) = crate::tokenizer::Tokenizer::from_gguf(&g) {
            let ids = t.encode_with_special("ab 12 <|endoftext|> é");
            let _ = t.decode(&ids);
        }
        true
    }

    /// Mutates a valid file at many random places (truncation, byte flips, extreme counts and
    /// lengths written over fields, deleted and duplicated ranges) and requires a clean `Ok` or
    /// `Err` every time: no panic, and no single allocation beyond a small multiple of the input.
    #[test]
    fn gguf_malformed_files_never_panic_cpu() {
        let base = sample_file();
        let header_end = Gguf::parse(&base).unwrap().data_offset() as usize;
        assert!(exercise(&base));
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
            let outcome = std::panic::catch_unwind(|| exercise(&v));
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
}
