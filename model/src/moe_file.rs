//! A MoEfied dense model written as a MoE file (`expertkv moefy`): the layout llama.cpp uses for
//! Mixtral (`ffn_gate_inp`, `ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`), so the expert
//! cache, the joint memory budget and every MoE-file path run on a trained model's MoEfied
//! routing instead of a synthetic one.
//!
//! What the file holds, and why:
//! - **Gate and up rows** are the dense file's block rows copied in expert order (expert `e`'s
//!   neurons are [`crate::MoeLayer::expert`]`(e)`): no requantisation, so the experts compute what the
//!   MoEfied model's do.
//! - **Down** splits the dense `Wdown` by *columns* (a neuron is a column), which breaks the
//!   file's quantised blocks: it is dequantised and written in `down` ([`WeightFormat::F32`]
//!   exact; [`WeightFormat::F16`], `moefy`'s default, with which SmolLM2 at E = 8, k = 4
//!   decodes the MoEfied model's greedy text; or [`WeightFormat::Q8_0`] when an expert's neurons
//!   are whole blocks of 32, about half of F16's bytes, which changed that text).
//! - **The router** `ffn_gate_inp` is the MoEfication's (centroids or fitted router). Its top k
//!   over the raw logits `W x` is the top k over the cosines the MoEfied model ranks by (the two
//!   differ by the positive factor `1 / |x|`).
//! - **The chosen experts weigh 1** (the groups partition one FFN): the file says so with
//!   `expertkv.expert_gating = unit` ([`crate::config::UNIT_GATING_KEY`]). A reader that does not
//!   know the key (llama.cpp) would weight them by a softmax, which this model was never run
//!   with: the file is for expertkv.
//! - Every expert has the same size (balanced MoEfication only), as the format requires.
//! - Everything else (metadata, attention, embeddings, norms) is copied as it is, with
//!   `llama.expert_count`, `llama.expert_used_count`, `llama.feed_forward_length` (an expert's
//!   neurons) and the provenance key `expertkv.moefied_from` set.

use crate::config::{Arch, LlamaConfig, UNIT_GATING_KEY};
use crate::gguf::writer::{GgufWriter, array, string};
use crate::gguf::{GgmlType, Gguf, Value, ValueType};
use crate::moe::Moefication;
use crate::ops::WeightFormat;
use crate::{Error, Result};

/// The metadata key naming what the file was MoEfied from (the source's `general.name` or
/// file, `E`, `k`, the router).
pub const MOEFIED_FROM_KEY: &str = "expertkv.moefied_from";

/// `g`, a dense llama-architecture model, with `moe`'s experts and routers as a MoE file's own,
/// every expert's down projection in `down` (F32, F16 or Q8_0). `from` is recorded under
/// [`MOEFIED_FROM_KEY`]. Returns the file's bytes.
pub fn write_moefied(g: &Gguf<'_>, moe: &Moefication, down: WeightFormat, from: &str) -> Result<Vec<u8>> {
    let c = LlamaConfig::from_gguf(g)?;
    if c.expert_count > 0 || moe.is_native() {
        return Err(Error::Input(format!(
            "the model is already a MoE file ({} experts per layer): MoEfication splits a dense model's FFNs",
            c.expert_count
        )));
    }
    if c.arch != Arch::Llama {
        return Err(Error::Input(format!(
            "{} models have no MoE form here: a MoEfied file is written as a llama (Mixtral-layout) file",
            c.arch.name()
        )));
    }
    let (hidden, ffn) = (c.embedding_length as usize, c.feed_forward_length as usize);
    let (e, k) = (moe.config.experts, moe.config.top_k);
    if moe.layers.len() != c.block_count as usize {
        return Err(Error::Input(format!("{} MoEfied layers for a model of {}", moe.layers.len(), c.block_count)));
    }
    if !ffn.is_multiple_of(e) {
        return Err(Error::Input(format!("{ffn} neurons do not split into {e} experts of one size: a MoE file's experts are equal")));
    }
    let f = ffn / e;
    let down_ty = match down {
        WeightFormat::F32 => GgmlType::F32,
        WeightFormat::F16 => GgmlType::F16,
        WeightFormat::Q8_0 if f.is_multiple_of(32) => GgmlType::Q8_0,
        WeightFormat::Q8_0 => {
            return Err(Error::Input(format!("an expert of {f} neurons is not whole Q8_0 blocks of 32: write its down projection as f16")));
        }
        other => return Err(Error::Input(format!("the down projection is written as f32, f16 or q8_0, not {other:?}"))),
    };

    let mut w = GgufWriter::new();
    let arch = c.arch.name();
    let replaced = [format!("{arch}.expert_count"), format!("{arch}.expert_used_count"), format!("{arch}.feed_forward_length")];
    for (key, value) in g.metadata() {
        if key == "general.alignment" || key == UNIT_GATING_KEY || key == MOEFIED_FROM_KEY || replaced.iter().any(|r| r == key) {
            continue;
        }
        let (ty, payload) = encode(value)?;
        w.raw(key, ty, &payload);
    }
    if g.get("general.alignment").is_some() {
        let a = u32::try_from(g.alignment()).map_err(|_| Error::Input(format!("alignment {} too large", g.alignment())))?;
        w.alignment(a);
    }
    w.u32(&replaced[0], e as u32).u32(&replaced[1], k as u32).u32(&replaced[2], f as u32);
    w.str(UNIT_GATING_KEY, "unit").str(MOEFIED_FROM_KEY, from);

    let ffn_tensor = |name: &str| ["ffn_gate", "ffn_up", "ffn_down"].iter().any(|s| name.ends_with(&format!(".{s}.weight")));
    let mut written = vec![false; c.block_count as usize];
    for t in g.tensors() {
        if !ffn_tensor(t.name()) {
            w.tensor(t.name(), t.dims(), t.ggml_type(), g.tensor_data(t.name())?.to_vec());
            continue;
        }
        // The layer's experts go where its first FFN tensor stood.
        let Some(l) = t.name().strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|l| l.parse::<usize>().ok()) else {
            return Err(Error::Input(format!("tensor `{}` is no layer's", t.name())));
        };
        match written.get_mut(l) {
            None => return Err(Error::Input(format!("tensor `{}`: no layer {l} in a model of {}", t.name(), c.block_count))),
            Some(true) => continue,
            Some(done) => *done = true,
        }
        let ml = &moe.layers[l];
        if ml.neurons.len() != ffn
            || ml.neurons.iter().any(|&neuron| neuron as usize >= ffn)
            || ml.centroids.len() != e * hidden
            || ml.offsets.len() != e + 1
            || (0..e).any(|x| ml.expert(x).len() != f)
        {
            return Err(Error::Input(format!(
                "layer {l}: the experts are not {e} groups of {f} neurons over {hidden} features (a balanced MoEfication is needed)"
            )));
        }
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        w.tensor(
            &n("ffn_gate_inp"),
            &[hidden as u64, e as u64],
            GgmlType::F32,
            ml.centroids.iter().flat_map(|v| v.to_le_bytes()).collect(),
        );
        for (dense, exps) in [("ffn_gate", "ffn_gate_exps"), ("ffn_up", "ffn_up_exps")] {
            let info = g.tensor(&n(dense)).ok_or_else(|| Error::Input(format!("no tensor `{}`", n(dense))))?;
            let bytes = g.tensor_data(&n(dense))?;
            if info.n_rows() != ffn as u64 || info.row_len() != hidden as u64 {
                return Err(Error::Input(format!("`{}` is not [{ffn}][{hidden}]", n(dense))));
            }
            let row = bytes.len() / ffn;
            let mut out = Vec::with_capacity(bytes.len());
            for &neuron in &ml.neurons {
                out.extend_from_slice(&bytes[neuron as usize * row..(neuron as usize + 1) * row]);
            }
            w.tensor(&n(exps), &[hidden as u64, f as u64, e as u64], info.ggml_type(), out);
        }
        // Wdown is [hidden][ffn]: expert x's rows are [hidden][f], its neurons' columns.
        let wd = g.tensor_f32(&n("ffn_down"))?;
        if wd.len() != hidden * ffn {
            return Err(Error::Input(format!("`{}` is not [{hidden}][{ffn}]", n("ffn_down"))));
        }
        let mut split = Vec::with_capacity(hidden * ffn);
        for x in 0..e {
            for o in 0..hidden {
                split.extend(ml.expert(x).iter().map(|&neuron| wd[o * ffn + neuron as usize]));
            }
        }
        let bytes = match down_ty {
            GgmlType::F16 => split.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
            ty => crate::synthetic::quantize(ty, &split),
        };
        w.tensor(&n("ffn_down_exps"), &[f as u64, hidden as u64, e as u64], down_ty, bytes);
    }
    if let Some(l) = written.iter().position(|&w| !w) {
        return Err(Error::Input(format!("layer {l} has no FFN tensors")));
    }
    Ok(w.finish())
}

/// A parsed value's type and payload, as [`GgufWriter::raw`] takes them.
fn encode(v: &Value<'_>) -> Result<(ValueType, Vec<u8>)> {
    let payload = match *v {
        Value::U8(x) => vec![x],
        Value::I8(x) => x.to_le_bytes().to_vec(),
        Value::U16(x) => x.to_le_bytes().to_vec(),
        Value::I16(x) => x.to_le_bytes().to_vec(),
        Value::U32(x) => x.to_le_bytes().to_vec(),
        Value::I32(x) => x.to_le_bytes().to_vec(),
        Value::U64(x) => x.to_le_bytes().to_vec(),
        Value::I64(x) => x.to_le_bytes().to_vec(),
        Value::F32(x) => x.to_le_bytes().to_vec(),
        Value::F64(x) => x.to_le_bytes().to_vec(),
        Value::Bool(x) => vec![u8::from(x)],
        Value::String(s) => string(s),
        Value::Array(a) => {
            let items = a.iter().map(|item| item.and_then(|i| encode(&i)).map(|(_, p)| p)).collect::<Result<Vec<_>>>()?;
            array(a.elem_type(), &items)
        }
    };
    Ok((v.value_type(), payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::SyntheticModel;
    use crate::{CpuModel, LlamaWeights, MoeConfig};
    use expertkv_core::rng::Rng;
    use std::sync::Arc;

    fn weights(g: &Gguf<'_>) -> Arc<LlamaWeights> {
        let c = LlamaConfig::from_gguf(g).expect("config");
        Arc::new(LlamaWeights::from_gguf(g, &c).expect("weights"))
    }

    /// Every position's logits of `tokens` run one by one.
    fn logits(m: &CpuModel, tokens: &[u32]) -> Vec<f32> {
        let mut cache = m.new_cache();
        tokens.iter().enumerate().flat_map(|(p, &t)| m.forward(t, p as u32, &mut cache).expect("forward")).collect()
    }

    /// A dense synthetic model, MoEfied, written as a MoE file: the file's own experts compute
    /// what the MoEfication of the dense model does (down in f32: to rounding; q8_0: to its
    /// quantisation), and with k = E what the dense model does.
    #[test]
    fn moefied_file_computes_the_moefied_model() {
        let cases = [
            (11u64, 4, 2, GgmlType::F32, WeightFormat::F32, 1e-5f32),
            (12, 2, 2, GgmlType::Q8_0, WeightFormat::F32, 1e-5),
            (13, 2, 1, GgmlType::Q4_1, WeightFormat::Q8_0, 1e-2),
            (14, 4, 1, GgmlType::Q8_0, WeightFormat::F16, 2e-3),
        ];
        for (seed, experts, top_k, file_ty, down, tol) in cases {
            let sm = SyntheticModel { ffn: 64, ..SyntheticModel::dense(seed).with_weights(file_ty) };
            let bytes = sm.gguf();
            let g = Gguf::parse(&bytes).expect("synthetic file");
            let w = weights(&g);
            let moe = Arc::new(Moefication::from_weights(&w, &MoeConfig::new(experts, top_k)).expect("moefy"));
            let file = write_moefied(&g, &moe, down, "test").unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            let g2 = Gguf::parse(&file).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            let c2 = LlamaConfig::from_gguf(&g2).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            assert_eq!((c2.expert_count as usize, c2.expert_used_count as usize), (experts, top_k), "seed {seed}");
            assert!(c2.unit_expert_weights && c2.feed_forward_length as usize == 64 / experts, "seed {seed}: {c2:?}");
            assert_eq!(g2.get_str(MOEFIED_FROM_KEY).ok(), Some("test"));
            assert_eq!(g2.get_str("tokenizer.ggml.model").ok(), g.get_str("tokenizer.ggml.model").ok(), "seed {seed}: metadata copied");
            let moe_file = CpuModel::new(weights(&g2)).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            let dense = CpuModel::new(w).expect("dense");
            let moefied = dense.with_moe(Some(moe)).expect("moefied");
            let mut rng = Rng::new(seed);
            let tokens: Vec<u32> = (0..6).map(|_| rng.below(c2.vocab_size)).collect();
            let (a, b, d) = (logits(&moe_file, &tokens), logits(&moefied, &tokens), logits(&dense, &tokens));
            let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(scale > 0.1, "seed {seed}: logits near zero");
            let diff = |x: &[f32], y: &[f32]| x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / scale;
            println!("seed {seed}: file vs MoEfied {:.2e}, MoEfied vs dense {:.2e}", diff(&a, &b), diff(&b, &d));
            assert!(diff(&a, &b) < tol, "seed {seed}: MoE file vs MoEfied {} (tolerance {tol})", diff(&a, &b));
            if top_k == experts {
                assert!(diff(&a, &d) < tol, "seed {seed}: k = E vs dense {}", diff(&a, &d));
            } else {
                assert!(diff(&b, &d) > 10.0 * tol, "seed {seed}: MoEfied at k < E is within the tolerance of dense: the check cannot tell");
            }
        }
    }

    /// Tensors stored in any order (SmolLM2's file lists `blk.10` before `blk.2`): every layer
    /// is written once, and the file equals the one from the ordered source tensor for tensor.
    #[test]
    fn moefied_file_takes_the_layers_in_any_order() {
        let sm = SyntheticModel { layers: 3, ffn: 64, ..SyntheticModel::dense(21) };
        let bytes = sm.gguf();
        let g = Gguf::parse(&bytes).expect("synthetic file");
        let mut w = GgufWriter::new();
        for (key, value) in g.metadata() {
            let (ty, payload) = encode(value).expect("encode");
            w.raw(key, ty, &payload);
        }
        for t in g.tensors().iter().rev() {
            w.tensor(t.name(), t.dims(), t.ggml_type(), g.tensor_data(t.name()).expect("data").to_vec());
        }
        let reversed = w.finish();
        let gr = Gguf::parse(&reversed).expect("reversed file");
        let moe = Moefication::from_weights(&weights(&g), &MoeConfig::new(2, 1)).expect("moefy");
        // A written file's tensors by name, with their bytes.
        let tensors = |file: Vec<u8>| {
            let f = Gguf::parse(&file).expect("parse");
            let mut t: Vec<(String, Vec<u8>)> =
                f.tensors().iter().map(|t| (t.name().to_string(), f.tensor_data(t.name()).expect("data").to_vec())).collect();
            t.sort();
            t
        };
        let a = tensors(write_moefied(&g, &moe, WeightFormat::F16, "t").expect("ordered"));
        let b = tensors(write_moefied(&gr, &moe, WeightFormat::F16, "t").expect("reversed"));
        assert_eq!(a.len(), 2 + 3 * 10, "embeddings, output norm, and per layer two norms, four attention and four expert tensors");
        assert!(a == b, "the reversed source gives other tensors");
    }

    #[test]
    fn moefied_file_refuses_what_it_cannot_write() {
        let sm = SyntheticModel { ffn: 48, ..SyntheticModel::dense(3) };
        let bytes = sm.gguf();
        let g = Gguf::parse(&bytes).expect("synthetic file");
        let w = weights(&g);
        let moe = Moefication::from_weights(&w, &MoeConfig::new(3, 1)).expect("moefy");
        // 16 neurons an expert: not whole Q8_0 blocks.
        let e = write_moefied(&g, &moe, WeightFormat::Q8_0, "t").expect_err("q8_0 of 16 columns");
        assert!(e.to_string().contains("not whole Q8_0 blocks"), "{e}");
        let e = write_moefied(&g, &moe, WeightFormat::Q4_1, "t").expect_err("q4_1 down");
        assert!(e.to_string().contains("f32, f16 or q8_0"), "{e}");
        let mut unbalanced = MoeConfig::new(3, 1);
        unbalanced.balanced = false;
        let moe = Moefication::from_weights(&w, &unbalanced).expect("moefy");
        if (0..3).any(|x| moe.layers[0].expert(x).len() != 16) {
            let e = write_moefied(&g, &moe, WeightFormat::F16, "t").expect_err("unequal experts");
            assert!(e.to_string().contains("balanced"), "{e}");
        }
        let other = SyntheticModel { layers: 3, ..SyntheticModel::dense(3) }.gguf();
        let moe3 = Moefication::from_weights(&weights(&Gguf::parse(&other).expect("file")), &MoeConfig::new(2, 1)).expect("moefy");
        let e = write_moefied(&g, &moe3, WeightFormat::F16, "t").expect_err("another shape");
        assert!(e.to_string().contains("3 MoEfied layers for a model of 2"), "{e}");
        let bytes = SyntheticModel::moe(4, 4, 2).gguf();
        let g = Gguf::parse(&bytes).expect("synthetic MoE file");
        let moe = Moefication::native(&weights(&g)).expect("own experts");
        let e = write_moefied(&g, &moe, WeightFormat::F16, "t").expect_err("a MoE file");
        assert!(e.to_string().contains("already a MoE file"), "{e}");
    }
}
