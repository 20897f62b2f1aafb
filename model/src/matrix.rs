//! One weight matrix as the CPU reference and the GPU read it. Its own module below both
//! [`weights`](crate::weights), which loads whole models of them, and [`math`](crate::math),
//! whose products take them, so the building blocks do not depend on a model's layout.

use crate::Result;
use crate::gguf::{GgmlType, Gguf, dequantize, model_err};

/// What [`LlamaWeights::from_gguf_with`](crate::weights::LlamaWeights::from_gguf_with) keeps of each matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// Dequantise to f32 ([`Matrix::f32`]); the CPU forward pass needs it.
    pub f32: bool,
    /// Copy the bytes as stored ([`Matrix::raw`]); a GPU upload needs them.
    pub raw: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { f32: true, raw: true }
    }
}

/// One weight matrix, `rows` output features by `cols` input features.
#[derive(Clone, Debug)]
pub struct Matrix {
    /// The GGUF tensor name (`blk.3.ffn_gate.weight`).
    pub name: String,
    /// Output features (GGUF `dims[1]`).
    pub rows: usize,
    /// Input features (GGUF `dims[0]`, the contiguous one).
    pub cols: usize,
    /// Row-major `[rows][cols]`: element `(o, i)` is `f32[o * cols + i]`. Empty when not loaded.
    pub f32: Vec<f32>,
    /// The ggml type of [`Matrix::raw`].
    pub ggml_type: GgmlType,
    /// The tensor's bytes as stored in the file: `rows` rows of [`Matrix::row_bytes`] each. Empty
    /// when not loaded.
    pub raw: Vec<u8>,
}

impl Matrix {
    /// Row `o` in f32 (`cols` elements). Panics when `o >= rows` or f32 was not loaded.
    pub fn row(&self, o: usize) -> &[f32] {
        &self.f32[o * self.cols..(o + 1) * self.cols]
    }

    /// Element `(o, i)`: output feature `o`, input feature `i`.
    pub fn at(&self, o: usize, i: usize) -> f32 {
        self.f32[o * self.cols + i]
    }

    /// Bytes of one stored row.
    pub fn row_bytes(&self) -> usize {
        self.cols / self.ggml_type.block_size() as usize * self.ggml_type.type_size() as usize
    }

    /// Row `o` as stored (whole ggml blocks). Panics when `o >= rows` or raw was not loaded.
    pub fn raw_row(&self, o: usize) -> &[u8] {
        let n = self.row_bytes();
        &self.raw[o * n..(o + 1) * n]
    }

    pub(crate) fn load(g: &Gguf<'_>, name: &str, rows: usize, cols: usize, opts: LoadOptions) -> Result<Self> {
        Self::load_dims(g, name, &[cols as u64, rows as u64], opts)
    }

    /// A tensor of GGUF `dims` (`[cols, ..]`, everything after the first dimension flattened
    /// into rows): a MoE file's `[hidden, ffn, E]` experts read as `E * ffn` rows of `hidden`.
    pub(crate) fn load_dims(g: &Gguf<'_>, name: &str, dims: &[u64], opts: LoadOptions) -> Result<Self> {
        let t = g.tensor(name).ok_or_else(|| model_err(format!("tensor `{name}` is missing")))?;
        if t.dims() != dims {
            return Err(model_err(format!(
                "tensor `{name}` has GGUF dims {:?}, expected {dims:?} (input features first, then output features)",
                t.dims()
            )));
        }
        let cols = dims[0] as usize;
        let rows = dims[1..].iter().product::<u64>() as usize;
        let ty = t.ggml_type();
        let bytes = g.data(t)?;
        let f32 = if opts.f32 {
            if !ty.can_dequantize() {
                return Err(model_err(format!("tensor `{name}` has type {ty}, which expertkv cannot dequantise on the CPU")));
            }
            let mut out = vec![0f32; rows * cols];
            dequantize(ty, bytes, &mut out).map_err(|e| model_err(format!("tensor `{name}`: {e}")))?;
            out
        } else {
            Vec::new()
        };
        let raw = if opts.raw { bytes.to_vec() } else { Vec::new() };
        Ok(Matrix { name: name.to_string(), rows, cols, f32, ggml_type: ty, raw })
    }
}
