//! Builds GGUF v3 files in memory: the tests' files (the tokenizer's and the model's tests, and
//! the GPU tests' synthetic models, [`crate::synthetic`]). Whatever it is given it writes;
//! [`super::Gguf::parse`] is what checks.

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
    /// The version written in the header: 3 from [`GgufWriter::new`]; the layout written is also
    /// version 2's, so setting 2 makes a valid v2 file.
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
    /// Adds `key` = `v` as a u32 value.
    pub fn u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.raw(key, ValueType::U32, &v.to_le_bytes())
    }
    /// Adds `key` = `v` as an f32 value.
    pub fn f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.raw(key, ValueType::F32, &v.to_le_bytes())
    }
    /// Adds `key` = `v` as a bool value (one byte, 0 or 1).
    pub fn bool(&mut self, key: &str, v: bool) -> &mut Self {
        self.raw(key, ValueType::Bool, &[u8::from(v)])
    }
    /// Adds `key` = `v` as a string value.
    pub fn str(&mut self, key: &str, v: &str) -> &mut Self {
        self.raw(key, ValueType::String, &string(v.as_bytes()))
    }
    /// Adds `key` as an array of strings (a vocabulary, the merges).
    pub fn strs(&mut self, key: &str, v: &[&str]) -> &mut Self {
        let items: Vec<Vec<u8>> = v.iter().map(|s| string(s.as_bytes())).collect();
        self.raw(key, ValueType::Array, &array(ValueType::String, &items))
    }
    /// Adds `key` as an array of i32 values (token types).
    pub fn i32s(&mut self, key: &str, v: &[i32]) -> &mut Self {
        let items: Vec<Vec<u8>> = v.iter().map(|x| x.to_le_bytes().to_vec()).collect();
        self.raw(key, ValueType::Array, &array(ValueType::I32, &items))
    }
    /// Adds `key` as an array of f32 values (a SentencePiece vocabulary's scores).
    pub fn f32s(&mut self, key: &str, v: &[f32]) -> &mut Self {
        let items: Vec<Vec<u8>> = v.iter().map(|x| x.to_le_bytes().to_vec()).collect();
        self.raw(key, ValueType::Array, &array(ValueType::F32, &items))
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
