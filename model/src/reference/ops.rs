//! CPU references of the model kernels (`shaders/wgsl/model/*.wgsl`), in f64.

use crate::Result;
use crate::gguf::dequantize;
use crate::ops::WeightFormat;

/// The f32 weights of a `rows x cols` block-format matrix (ggml's dequantisation).
pub fn dequant_matrix(format: WeightFormat, rows: u32, cols: u32, bytes: &[u8]) -> Result<Vec<f32>> {
    let ty = format.ggml();
    let mut out = vec![0f32; rows as usize * cols as usize];
    dequantize(ty, bytes, &mut out)?;
    Ok(out)
}

/// `y[b][o] = sum_i w[o][i] x[b][i]`.
pub fn matvec(w: &[f32], rows: usize, cols: usize, x: &[f32], n_tokens: usize) -> Vec<f64> {
    let mut y = vec![0f64; n_tokens * rows];
    for b in 0..n_tokens {
        for o in 0..rows {
            y[b * rows + o] = (0..cols).map(|i| f64::from(w[o * cols + i]) * f64::from(x[b * cols + i])).sum();
        }
    }
    y
}

/// `y[b] = W x'[b]` in f64 for an f64 input `x'` (`[n_tokens][cols]`).
fn matvec_f64(w: &[f32], rows: usize, cols: usize, x: &[f64], n_tokens: usize) -> Vec<f64> {
    let mut y = vec![0f64; n_tokens * rows];
    for b in 0..n_tokens {
        for o in 0..rows {
            y[b * rows + o] = (0..cols).map(|i| f64::from(w[o * cols + i]) * x[b * cols + i]).sum();
        }
    }
    y
}

/// `y[b] = W (rmsnorm(x[b]) * g)`: the product with the norm before it folded in
/// (`model/matvec.wgsl`, input 1), `[n_tokens][rows]`.
pub fn matvec_norm(w: &[f32], rows: usize, cols: usize, x: &[f32], g: &[f32], eps: f32, n_tokens: usize) -> Vec<f64> {
    matvec_f64(w, rows, cols, &rmsnorm(x, g, cols, eps), n_tokens)
}

/// `y[b] = W (silu(gate[b]) * up[b])` with `gu` = `[n_tokens][2][cols]` (`model/matvec.wgsl`,
/// input 2).
pub fn matvec_swiglu(w: &[f32], rows: usize, cols: usize, gu: &[f32], n_tokens: usize) -> Vec<f64> {
    matvec_f64(w, rows, cols, &swiglu(gu, cols), n_tokens)
}

/// `y[b][i] = x[b][i] / sqrt(mean_i x[b][i]^2 + eps) * g[i]` over each token's `dim` features (`x`
/// is `[n_tokens][dim]`).
pub fn rmsnorm(x: &[f32], g: &[f32], dim: usize, eps: f32) -> Vec<f64> {
    let mut y = vec![0f64; x.len()];
    for (xb, yb) in x.chunks(dim).zip(y.chunks_mut(dim)) {
        let ms = xb.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / dim as f64;
        let s = 1.0 / (ms + f64::from(eps)).sqrt();
        for i in 0..dim {
            yb[i] = f64::from(xb[i]) * s * f64::from(g[i]);
        }
    }
    y
}

/// Pairs of every head rotated by position x base^(-2i / head_dim): adjacent pairs `(2i, 2i+1)`,
/// or with `neox` pairs half a head apart `(i, i + head_dim/2)`.
pub fn rope(x: &[f32], positions: &[u32], n_heads: usize, head_dim: usize, base: f32, neox: bool) -> Vec<f64> {
    let mut y: Vec<f64> = x.iter().map(|v| f64::from(*v)).collect();
    let half = head_dim / 2;
    for (b, &pos) in positions.iter().enumerate() {
        for h in 0..n_heads {
            for i in 0..half {
                let theta = f64::from(pos) * f64::from(base).powf(-2.0 * i as f64 / head_dim as f64);
                let head = (b * n_heads + h) * head_dim;
                let (o0, o1) = if neox { (head + i, head + i + half) } else { (head + 2 * i, head + 2 * i + 1) };
                let (x0, x1) = (y[o0], y[o1]);
                y[o0] = x0 * theta.cos() - x1 * theta.sin();
                y[o1] = x0 * theta.sin() + x1 * theta.cos();
            }
        }
    }
    y
}

/// `silu(g) * u` with g and u side by side per token (`[b][2][n]`).
pub fn swiglu(gu: &[f32], n: usize) -> Vec<f64> {
    gu.chunks(2 * n)
        .flat_map(|c| {
            (0..n).map(move |i| {
                let g = f64::from(c[i]);
                g / (1.0 + (-g).exp()) * f64::from(c[n + i])
            })
        })
        .collect()
}

/// `silu(g) * u * sigmoid(gate[b])` with g and u side by side per token (`[b][2][n]`) and one
/// gate logit per token: a shared expert's activations scaled by its gate.
pub fn swiglu_gated(gu: &[f32], gate: &[f32], n: usize) -> Vec<f64> {
    let plain = swiglu(gu, n);
    plain.chunks(n).zip(gate).flat_map(|(c, &s)| c.iter().map(move |v| v / (1.0 + (-f64::from(s)).exp()))).collect()
}

/// The expert FFN over permuted weights (`model/moe.wgsl`): `gate_up` is `[2 * ffn][hidden]`
/// (gate rows, then up rows, in expert order), `down_t` is `[ffn][hidden]`, expert `e` owns rows
/// `offsets[e]..offsets[e + 1]`, `sel` and `wts` are `[n_tokens][top_k]`. Returns
/// `y[b] = sum_j wts[b][j] sum_{n in e_j} silu(gate[n] x[b]) (up[n] x[b]) down_t[n]`.
#[allow(clippy::too_many_arguments)]
pub fn moe_ffn(
    gate_up: &[f32],
    down_t: &[f32],
    offsets: &[u32],
    hidden: usize,
    x: &[f32],
    sel: &[u32],
    wts: &[f32],
    top_k: usize,
    n_tokens: usize,
) -> Vec<f64> {
    let ffn = down_t.len() / hidden;
    let dot =
        |row: usize, b: usize| -> f64 { (0..hidden).map(|i| f64::from(gate_up[row * hidden + i]) * f64::from(x[b * hidden + i])).sum() };
    let mut y = vec![0f64; n_tokens * hidden];
    for b in 0..n_tokens {
        for (&e, &w) in sel[b * top_k..(b + 1) * top_k].iter().zip(&wts[b * top_k..(b + 1) * top_k]) {
            for n in offsets[e as usize] as usize..offsets[e as usize + 1] as usize {
                let g = dot(n, b);
                let a = g / (1.0 + (-g).exp()) * dot(ffn + n, b) * f64::from(w);
                for h in 0..hidden {
                    y[b * hidden + h] += a * f64::from(down_t[n * hidden + h]);
                }
            }
        }
    }
    y
}
