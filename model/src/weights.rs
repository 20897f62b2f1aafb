//! The weights of a dense Llama-architecture model, read from a GGUF file: every matrix
//! dequantised to f32 for the CPU reference, and its bytes as stored (ggml blocks) for the GPU,
//! which dequantises in its kernels.
//!
//! Layout. A GGUF matrix has dims `[in, out]` with `in` the contiguous dimension, so ggml's
//! element order is already row-major `[out][in]`: row `o` holds the `in` weights that make output
//! feature `o`, and `y[o] = dot(row o, x)`. [`Matrix::f32`] keeps exactly that order (no
//! transpose), and so do the stored bytes: row `o` is bytes `o * row_bytes .. (o + 1) * row_bytes`
//! of [`Matrix::raw`], whole blocks because ggml blocks never straddle rows. The token embedding
//! `[hidden, vocab]` reads the same way as `[vocab][hidden]`: row `t` is token `t`'s embedding and,
//! with tied embeddings, the LM head's output row for token `t`.

use crate::config::LlamaConfig;
use crate::gguf::{GgmlType, Gguf};
pub use crate::matrix::{LoadOptions, Matrix};
use crate::{Error, Result};

fn model_err(what: impl Into<String>) -> Error {
    Error::Model(what.into())
}

/// An f32 vector weight (RMSNorm gains), which every GGUF stores as F32 or F16.
fn load_vector(g: &Gguf<'_>, name: &str, n: usize) -> Result<Vec<f32>> {
    let t = g.tensor(name).ok_or_else(|| model_err(format!("tensor `{name}` is missing")))?;
    if t.dims() != [n as u64] {
        return Err(model_err(format!("tensor `{name}` has dims {:?}, expected [{n}]", t.dims())));
    }
    g.tensor_f32(name)
}

/// The weights of one transformer block.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// RMSNorm gain before attention, `[hidden]`.
    pub attn_norm: Vec<f32>,
    /// `[heads * head_dim][hidden]`; rows are permuted by the GGUF converter for the adjacent-pair
    /// ("normal") RoPE, see [`super::cpu::rope_norm`].
    pub wq: Matrix,
    /// `[kv_heads * head_dim][hidden]`, permuted like `wq`.
    pub wk: Matrix,
    /// `[kv_heads * head_dim][hidden]`.
    pub wv: Matrix,
    /// `[hidden][heads * head_dim]`.
    pub wo: Matrix,
    /// RMSNorm gain before the FFN, `[hidden]`.
    pub ffn_norm: Vec<f32>,
    /// `[ffn][hidden]`: row `n` is neuron `n`'s gate direction. In a MoE file, every expert's
    /// neurons one expert after another: `[E * ffn][hidden]`, expert `e` owning rows
    /// `e * ffn .. (e + 1) * ffn`.
    pub gate: Matrix,
    /// `[ffn][hidden]` (MoE: `[E * ffn][hidden]`, as `gate`).
    pub up: Matrix,
    /// `[hidden][ffn]`: column `n` is neuron `n`'s output direction (MoE: `[hidden][E * ffn]`,
    /// re-laid from the file's `[E][hidden][ffn]` and held as F32).
    pub down: Matrix,
    /// A MoE file's router `ffn_gate_inp`, `[E][hidden]`; `None` for a dense FFN.
    pub router: Option<Matrix>,
    /// Biases of the Q, K and V projections (`attn_q.bias`, ...; `qwen2`), `[heads * head_dim]`,
    /// `[kv_heads * head_dim]` twice; `None` where the architecture has none.
    pub qkv_bias: Option<[Vec<f32>; 3]>,
    /// Per-head RMSNorm gains of queries and keys before RoPE (`attn_q_norm`, `attn_k_norm`;
    /// `qwen3`), `[head_dim]` each; `None` where the architecture has none.
    pub qk_norm: Option<[Vec<f32>; 2]>,
    /// The shared expert beside the routed ones (`qwen2moe`); `None` where the architecture
    /// has none.
    pub shared: Option<SharedExpert>,
}

/// A layer's shared expert (`qwen2moe`'s `ffn_*_shexp`): a dense SwiGLU FFN every token runs,
/// its output scaled by `sigmoid(gate_inp . x)` and added to the routed experts'.
#[derive(Clone, Debug)]
pub struct SharedExpert {
    /// `ffn_gate_inp_shexp`, `[hidden]`: the shared expert's own gate.
    pub gate_inp: Vec<f32>,
    /// `ffn_gate_shexp`, `[ffn][hidden]`.
    pub gate: Matrix,
    /// `ffn_up_shexp`, `[ffn][hidden]`.
    pub up: Matrix,
    /// `ffn_down_shexp`, `[hidden][ffn]`.
    pub down: Matrix,
}

/// Every weight of a dense Llama model.
#[derive(Clone, Debug)]
pub struct LlamaWeights {
    /// The hyper-parameters the tensors were checked against.
    pub config: LlamaConfig,
    /// `[vocab][hidden]`: row `t` is token `t`'s embedding.
    pub token_embd: Matrix,
    /// The transformer blocks, `block_count` of them, in order.
    pub layers: Vec<LayerWeights>,
    /// The final RMSNorm gain, `[hidden]`.
    pub output_norm: Vec<f32>,
    /// `[vocab][hidden]`; `None` when the LM head is tied to [`LlamaWeights::token_embd`].
    pub output: Option<Matrix>,
}

impl LlamaWeights {
    /// Loads everything (f32 and stored bytes).
    pub fn from_gguf(g: &Gguf<'_>, config: &LlamaConfig) -> Result<Self> {
        Self::from_gguf_with(g, config, LoadOptions::default())
    }

    /// Loads the tensors of a Llama forward pass, checking each one's shape against `config`:
    /// a dense FFN, or a Mixture-of-Experts file's router and stacked experts (see
    /// [`LayerWeights::gate`]).
    pub fn from_gguf_with(g: &Gguf<'_>, config: &LlamaConfig, opts: LoadOptions) -> Result<Self> {
        config.check_tensors(g)?;
        let c = config;
        let (h, f, v) = (c.embedding_length as usize, c.feed_forward_length as usize, c.vocab_size as usize);
        let q = (c.head_count * c.head_dim) as usize;
        let kv = (c.head_count_kv * c.head_dim) as usize;
        let mut layers = Vec::with_capacity(c.block_count as usize);
        for l in 0..c.block_count {
            let m = |name: &str, rows, cols| Matrix::load(g, &format!("blk.{l}.{name}.weight"), rows, cols, opts);
            let (gate, up, down, router) = if c.expert_count == 0 {
                (m("ffn_gate", f, h)?, m("ffn_up", f, h)?, m("ffn_down", h, f)?, None)
            } else {
                let e = c.expert_count as usize;
                let dims = |a: usize, b: usize| [a as u64, b as u64, e as u64];
                let x = |name: &str, d: &[u64], o: LoadOptions| Matrix::load_dims(g, &format!("blk.{l}.{name}.weight"), d, o);
                let down = x("ffn_down_exps", &dims(f, h), LoadOptions { f32: true, raw: false })?;
                (
                    x("ffn_gate_exps", &dims(h, f), opts)?,
                    x("ffn_up_exps", &dims(h, f), opts)?,
                    down_by_neuron(down, e, h, f, opts),
                    Some(m("ffn_gate_inp", e, h)?),
                )
            };
            layers.push(LayerWeights {
                attn_norm: load_vector(g, &format!("blk.{l}.attn_norm.weight"), h)?,
                wq: m("attn_q", q, h)?,
                wk: m("attn_k", kv, h)?,
                wv: m("attn_v", kv, h)?,
                wo: m("attn_output", h, q)?,
                ffn_norm: load_vector(g, &format!("blk.{l}.ffn_norm.weight"), h)?,
                gate,
                up,
                down,
                router,
                qkv_bias: if c.arch.qkv_bias() {
                    let b = |name: &str, n: usize| load_vector(g, &format!("blk.{l}.{name}.bias"), n);
                    Some([b("attn_q", q)?, b("attn_k", kv)?, b("attn_v", kv)?])
                } else {
                    None
                },
                qk_norm: if c.arch.qk_norm() {
                    let n = |name: &str, len: usize| load_vector(g, &format!("blk.{l}.{name}.weight"), len);
                    let (nq, nk) = if c.arch.qk_norm_whole() { (q, kv) } else { (c.head_dim as usize, c.head_dim as usize) };
                    Some([n("attn_q_norm", nq)?, n("attn_k_norm", nk)?])
                } else {
                    None
                },
                shared: if c.arch.shared_expert() {
                    let fs = c.shared_feed_forward_length as usize;
                    Some(SharedExpert {
                        gate_inp: load_vector(g, &format!("blk.{l}.ffn_gate_inp_shexp.weight"), h)?,
                        gate: m("ffn_gate_shexp", fs, h)?,
                        up: m("ffn_up_shexp", fs, h)?,
                        down: m("ffn_down_shexp", h, fs)?,
                    })
                } else {
                    None
                },
            });
        }
        let output = if LlamaConfig::tied_embeddings(g) { None } else { Some(Matrix::load(g, "output.weight", v, h, opts)?) };
        Ok(LlamaWeights {
            config: c.clone(),
            token_embd: Matrix::load(g, "token_embd.weight", v, h, opts)?,
            layers,
            output_norm: load_vector(g, "output_norm.weight", h)?,
            output,
        })
    }

    /// The LM head, `[vocab][hidden]`: `output.weight`, or the token embeddings when tied.
    pub fn lm_head(&self) -> &Matrix {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }

    /// Whether every matrix carries f32 weights (what the CPU forward pass needs).
    pub fn has_f32(&self) -> bool {
        self.matrices().all(|m| m.f32.len() == m.rows * m.cols)
    }

    /// Every matrix: the embeddings, each layer's seven (and a MoE file's router and shared
    /// expert), then the separate LM head if any.
    pub fn matrices(&self) -> impl Iterator<Item = &Matrix> {
        std::iter::once(&self.token_embd)
            .chain(self.layers.iter().flat_map(|l| {
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down]
                    .into_iter()
                    .chain(l.router.iter())
                    .chain(l.shared.iter().flat_map(|s| [&s.gate, &s.up, &s.down]))
            }))
            .chain(self.output.iter())
    }

    /// Whether the file's FFNs are its own experts (a Mixture-of-Experts GGUF).
    pub fn is_moe(&self) -> bool {
        self.config.expert_count > 0
    }
}

/// A MoE file's `ffn_down_exps` (`[E][hidden][ffn]` in f32) as one `[hidden][E * ffn]` matrix:
/// neuron `e * ffn + n`'s output direction is column `e * ffn + n`, as in a dense `ffn_down`. Held
/// as F32 (quantised blocks cannot be re-laid across rows); its raw bytes, when asked for, are
/// those f32.
fn down_by_neuron(m: Matrix, e: usize, h: usize, f: usize, opts: LoadOptions) -> Matrix {
    let out = experts_down_by_neuron(&m.f32, e, h, f);
    let raw = if opts.raw { out.iter().flat_map(|v| v.to_le_bytes()).collect() } else { Vec::new() };
    Matrix { name: m.name, rows: h, cols: e * f, f32: if opts.f32 { out } else { Vec::new() }, ggml_type: GgmlType::F32, raw }
}

/// `[E][hidden][ffn]` (a MoE file's `ffn_down_exps` in f32) re-laid as `[hidden][E * ffn]`; the
/// CPU weights ([`LayerWeights::down`]) and the GPU's expert upload both read it this way.
pub(crate) fn experts_down_by_neuron(down: &[f32], e: usize, h: usize, f: usize) -> Vec<f32> {
    let mut out = vec![0f32; h * e * f];
    for x in 0..e {
        for o in 0..h {
            out[o * e * f + x * f..o * e * f + (x + 1) * f].copy_from_slice(&down[(x * h + o) * f..(x * h + o + 1) * f]);
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::gguf::writer::GgufWriter;
    use crate::gguf::{dequantize, test_model_bytes};
    use std::sync::{Arc, OnceLock};

    /// The real model's weights, loaded once per test binary and shared by the model tests.
    pub(crate) fn test_weights(test: &str) -> Option<Arc<LlamaWeights>> {
        static W: OnceLock<Arc<LlamaWeights>> = OnceLock::new();
        let bytes = test_model_bytes(test)?;
        Some(
            W.get_or_init(|| {
                let t = std::time::Instant::now();
                let g = Gguf::parse(bytes).unwrap();
                let c = LlamaConfig::from_gguf(&g).unwrap();
                let w = LlamaWeights::from_gguf(&g, &c).unwrap();
                eprintln!("weights loaded and dequantised in {:.2} s", t.elapsed().as_secs_f64());
                Arc::new(w)
            })
            .clone(),
        )
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// The metadata of a one-layer model of hidden `h`, FFN `f`, 2 query heads sharing 1 KV head,
    /// and the first `v` byte tokens.
    fn tiny_header(h: u64, f: u64, v: u64) -> GgufWriter {
        let bytes: Vec<String> = crate::tokenizer::byte_to_char().iter().map(char::to_string).collect();
        let tokens: Vec<&str> = bytes.iter().map(String::as_str).take(v as usize).collect();
        let mut w = GgufWriter::new();
        w.str("general.architecture", "llama")
            .u32("llama.block_count", 1)
            .u32("llama.embedding_length", h as u32)
            .u32("llama.feed_forward_length", f as u32)
            .u32("llama.attention.head_count", 2)
            .u32("llama.attention.head_count_kv", 1)
            .f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
            .u32("llama.context_length", 64)
            .strs("tokenizer.ggml.tokens", &tokens);
        w
    }

    /// A one-layer model whose every element encodes where it lies: element `(o, i)` of a matrix
    /// is `1000 o + i` plus a per-tensor offset, stored in ggml order (`i` fastest).
    fn tiny_file(tied: bool) -> Vec<u8> {
        let (h, f, v, heads, kv_heads) = (8u64, 12u64, 5u64, 2u64, 1u64);
        let hd = h / heads;
        let mut w = tiny_header(h, f, v);
        let mut tag = 0.0f32;
        let mut mat = |w: &mut GgufWriter, name: &str, rows: u64, cols: u64| {
            tag += 0.5;
            let data: Vec<f32> = (0..rows).flat_map(|o| (0..cols).map(move |i| (1000 * o + i) as f32 + tag)).collect();
            w.tensor(name, &[cols, rows], GgmlType::F32, f32_bytes(&data));
        };
        mat(&mut w, "token_embd.weight", v, h);
        if !tied {
            mat(&mut w, "output.weight", v, h);
        }
        mat(&mut w, "blk.0.attn_q.weight", heads * hd, h);
        mat(&mut w, "blk.0.attn_k.weight", kv_heads * hd, h);
        mat(&mut w, "blk.0.attn_v.weight", kv_heads * hd, h);
        mat(&mut w, "blk.0.attn_output.weight", h, heads * hd);
        mat(&mut w, "blk.0.ffn_gate.weight", f, h);
        mat(&mut w, "blk.0.ffn_up.weight", f, h);
        mat(&mut w, "blk.0.ffn_down.weight", h, f);
        for name in ["blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"] {
            w.tensor(name, &[h], GgmlType::F32, f32_bytes(&vec![1.0; h as usize]));
        }
        w.finish()
    }

    #[test]
    fn weights_layout_out_by_in_cpu() {
        for tied in [true, false] {
            let file = tiny_file(tied);
            let g = Gguf::parse(&file).unwrap();
            let c = LlamaConfig::from_gguf(&g).unwrap();
            let w = LlamaWeights::from_gguf(&g, &c).unwrap();
            let l = &w.layers[0];
            // (matrix, rows = out, cols = in, tag) as tiny_file wrote them.
            let tags = if tied { [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0] } else { [1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5] };
            let want = [(&l.wq, 8, 8), (&l.wk, 4, 8), (&l.wv, 4, 8), (&l.wo, 8, 8), (&l.gate, 12, 8), (&l.up, 12, 8), (&l.down, 8, 12)];
            for ((m, rows, cols), tag) in want.into_iter().zip(tags) {
                assert_eq!((m.rows, m.cols), (rows, cols), "{}", m.name);
                for o in 0..rows {
                    for i in 0..cols {
                        assert_eq!(m.at(o, i), (1000 * o + i) as f32 + tag, "{} ({o}, {i})", m.name);
                    }
                    assert_eq!(m.raw_row(o), &f32_bytes(m.row(o))[..], "{} row {o}", m.name);
                }
            }
            assert_eq!(w.token_embd.row(3)[5], 3005.5);
            assert_eq!(w.lm_head().name, if tied { "token_embd.weight" } else { "output.weight" });
            assert_eq!(w.matrices().count(), 8 + usize::from(!tied));
            assert!(w.has_f32());
        }
    }

    /// A one-layer MoE file (3 experts of 4 neurons, hidden 8): element `(x, o, i)` of an expert
    /// tensor is `1e5 x + 1000 o + i + tag`, `x` the expert, in ggml order (`i` fastest).
    /// `legacy`: each expert its own tensor (`ffn_gate.0.weight`, ...), as old conversions wrote.
    fn tiny_moe_file(legacy: bool) -> Vec<u8> {
        let (h, f, e, v) = (8u64, 4u64, 3u64, 5u64);
        let mut w = tiny_header(h, f, v);
        w.u32("llama.expert_count", e as u32).u32("llama.expert_used_count", 2);
        let tagged = |dims: [u64; 3], tag: f32| -> Vec<u8> {
            let [cols, rows, n] = dims;
            let data: Vec<f32> = (0..n)
                .flat_map(|x| (0..rows).flat_map(move |o| (0..cols).map(move |i| (100_000 * x + 1000 * o + i) as f32 + tag)))
                .collect();
            f32_bytes(&data)
        };
        w.tensor("token_embd.weight", &[h, v], GgmlType::F32, tagged([h, v, 1], 0.5));
        for (name, rows, cols) in [("attn_q", 8, h), ("attn_k", 4, h), ("attn_v", 4, h), ("attn_output", h, 8)] {
            w.tensor(&format!("blk.0.{name}.weight"), &[cols, rows], GgmlType::F32, tagged([cols, rows, 1], 0.0));
        }
        w.tensor("blk.0.ffn_gate_inp.weight", &[h, e], GgmlType::F32, tagged([h, e, 1], 0.25));
        if legacy {
            for x in 0..e {
                w.tensor(&format!("blk.0.ffn_gate.{x}.weight"), &[h, f], GgmlType::F32, tagged([h, f, 1], 0.5));
            }
        } else {
            w.tensor("blk.0.ffn_gate_exps.weight", &[h, f, e], GgmlType::F32, tagged([h, f, e], 0.5));
            w.tensor("blk.0.ffn_up_exps.weight", &[h, f, e], GgmlType::F32, tagged([h, f, e], 0.75));
            w.tensor("blk.0.ffn_down_exps.weight", &[f, h, e], GgmlType::F32, tagged([f, h, e], 0.125));
        }
        for name in ["blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"] {
            w.tensor(name, &[h], GgmlType::F32, f32_bytes(&vec![1.0; h as usize]));
        }
        w.finish()
    }

    /// A MoE file's experts read as `E * ffn` neurons: gate and up rows expert after expert, down
    /// re-laid so that column `x * ffn + n` is expert `x`'s neuron `n`, and the router as `[E][hidden]`.
    #[test]
    fn weights_moe_file_layout_cpu() {
        let file = tiny_moe_file(false);
        let g = Gguf::parse(&file).unwrap();
        let c = LlamaConfig::from_gguf(&g).unwrap();
        assert_eq!((c.expert_count, c.expert_used_count), (3, 2));
        let w = LlamaWeights::from_gguf(&g, &c).unwrap();
        assert!(w.is_moe());
        let l = &w.layers[0];
        let router = l.router.as_ref().unwrap();
        assert_eq!((router.rows, router.cols, l.gate.rows, l.gate.cols, l.down.rows, l.down.cols), (3, 8, 12, 8, 8, 12));
        for x in 0..3 {
            for n in 0..4 {
                for i in 0..8 {
                    let at = (100_000 * x + 1000 * n + i) as f32;
                    assert_eq!(l.gate.at(x * 4 + n, i), at + 0.5, "gate expert {x} neuron {n} input {i}");
                    assert_eq!(l.up.at(x * 4 + n, i), at + 0.75, "up expert {x} neuron {n} input {i}");
                    // ffn_down_exps[x] is [hidden][ffn]: output `i` of neuron `n` is (x, i, n).
                    assert_eq!(
                        l.down.at(i, x * 4 + n),
                        (100_000 * x + 1000 * i + n) as f32 + 0.125,
                        "down expert {x} neuron {n} output {i}"
                    );
                }
            }
            assert_eq!(router.at(x, 5), (1000 * x + 5) as f32 + 0.25);
        }
        assert_eq!(l.down.raw_row(3), &f32_bytes(l.down.row(3))[..], "down's raw bytes are its re-laid f32");
        assert_eq!(w.matrices().count(), 1 + 8);
        // Shapes are checked against the metadata, and the old per-expert layout is named.
        let mut bad = c.clone();
        bad.expert_count = 4;
        let e = LlamaWeights::from_gguf(&g, &bad).unwrap_err().to_string();
        assert!(e.contains("ffn_gate_inp") && e.contains("expected"), "{e}");
        let legacy = tiny_moe_file(true);
        let g = Gguf::parse(&legacy).unwrap();
        let e = LlamaWeights::from_gguf(&g, &LlamaConfig::from_gguf(&g).unwrap()).unwrap_err().to_string();
        assert!(e.contains("ffn_gate.0") && e.contains("convert it again"), "{e}");
    }

    #[test]
    fn weights_options_and_errors_cpu() {
        let file = tiny_file(true);
        let g = Gguf::parse(&file).unwrap();
        let c = LlamaConfig::from_gguf(&g).unwrap();
        let raw_only = LlamaWeights::from_gguf_with(&g, &c, LoadOptions { f32: false, raw: true }).unwrap();
        assert!(!raw_only.has_f32() && raw_only.layers[0].gate.raw.len() == 12 * 8 * 4);
        let mut bad = c.clone();
        bad.feed_forward_length = 16;
        let e = LlamaWeights::from_gguf(&g, &bad).unwrap_err().to_string();
        assert!(e.contains("blk.0.ffn_gate.weight") && e.contains("expected"), "{e}");
        // Metadata that claims experts the file does not have: the router is missing.
        let mut moe = c.clone();
        moe.expert_count = 4;
        assert!(LlamaWeights::from_gguf(&g, &moe).unwrap_err().to_string().contains("blk.0.ffn_gate_inp.weight` is missing"));
    }

    /// A few elements of the real weights against gguf.rs's dequantisation of the whole tensor
    /// (ggml order) and of the single stored row.
    #[test]
    fn weights_smollm2_layout_matches_gguf_real() {
        let Some(w) = test_weights("weights_smollm2_layout_matches_gguf_real") else { return };
        let g = Gguf::parse(test_model_bytes("weights_smollm2_layout_matches_gguf_real").unwrap()).unwrap();
        let c = &w.config;
        assert_eq!((w.layers.len(), w.output.is_none()), (30, true));
        let l7 = &w.layers[7];
        for (m, name) in [(&l7.wq, "blk.7.attn_q.weight"), (&l7.down, "blk.7.ffn_down.weight"), (&w.token_embd, "token_embd.weight")] {
            let t = g.tensor(name).unwrap();
            assert_eq!(t.dims(), [m.cols as u64, m.rows as u64], "{name}");
            let whole = g.tensor_f32(name).unwrap();
            for (o, i) in [(0, 0), (1, 0), (0, 1), (m.rows - 1, m.cols - 1), (m.rows / 3, m.cols / 2 + 5)] {
                assert_eq!(m.at(o, i), whole[o * m.cols + i], "{name} ({o}, {i})");
                let mut row = vec![0f32; m.cols];
                dequantize(m.ggml_type, m.raw_row(o), &mut row).unwrap();
                assert_eq!(m.at(o, i), row[i], "{name} ({o}, {i}) from its stored row");
            }
            assert_eq!(m.raw, g.data(t).unwrap(), "{name}");
        }
        assert_eq!(l7.gate.rows, c.feed_forward_length as usize);
        assert_eq!(w.layers[29].wv.at(191, 575), *g.tensor_f32("blk.29.attn_v.weight").unwrap().last().unwrap());
    }
}
