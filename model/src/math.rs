//! The CPU building blocks of the reference forward pass and of MoEfication: dot products,
//! matrix-vector products (split over threads by rows on native targets), RMSNorm, SiLU, RoPE,
//! argmax and the negative log-likelihood.

use crate::matrix::Matrix;

/// `dot(a, b)` with eight partial sums (vectorisable; a fixed order, so deterministic), then the
/// tail. The slices must have equal lengths.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let (ac, at) = a.as_chunks::<8>();
    let (bc, bt) = b.as_chunks::<8>();
    let mut acc = [0f32; 8];
    for (x, y) in ac.iter().zip(bc) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut tail = 0f32;
    for (x, y) in at.iter().zip(bt) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `y += a * x`.
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Products smaller than this many weights stay on one thread (spawning costs more).
#[cfg(not(target_arch = "wasm32"))]
const PAR_MIN_WEIGHTS: usize = 1 << 19;

/// `y = M x` for `M` of `[rows][cols]`, over up to `threads` threads.
pub fn matvec(m: &Matrix, x: &[f32], y: &mut [f32], threads: usize) {
    assert!(
        x.len() == m.cols && y.len() == m.rows && m.f32.len() == m.rows * m.cols,
        "matvec {}: [{}][{}] by {} into {} (f32 loaded: {})",
        m.name,
        m.rows,
        m.cols,
        x.len(),
        y.len(),
        m.f32.len()
    );
    let rows_into = |first: usize, y: &mut [f32]| {
        for (o, y) in y.iter_mut().enumerate() {
            *y = dot(m.row(first + o), x);
        }
    };
    #[cfg(not(target_arch = "wasm32"))]
    if threads > 1 && m.rows * m.cols >= PAR_MIN_WEIGHTS {
        let chunk = m.rows.div_ceil(threads);
        std::thread::scope(|s| {
            let mut parts = y.chunks_mut(chunk).enumerate();
            let first = parts.next();
            for (t, part) in parts {
                s.spawn(move || rows_into(t * chunk, part));
            }
            if let Some((_, part)) = first {
                rows_into(0, part);
            }
        });
        return;
    }
    let _ = threads;
    rows_into(0, y);
}

/// `out = x / sqrt(mean(x^2) + eps) * gain` (the mean in f64, as ggml sums).
pub fn rms_norm(x: &[f32], gain: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let scale = (1.0 / (ss / x.len() as f64 + f64::from(eps)).sqrt()) as f32;
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(gain) {
        *o = v * scale * g;
    }
}

/// `silu(g) = g * sigmoid(g)`.
pub fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// llama.cpp's "normal" RoPE (`LLAMA_ROPE_TYPE_NORM`, what `LLM_ARCH_LLAMA` uses), in place on
/// `x` of `[heads][head_dim]`: within each head, the adjacent pair `(x[2i], x[2i+1])` for
/// `2i < rope_dims` is rotated by `position * base^(-2i / rope_dims)`; dimensions past `rope_dims`
/// are left alone. The GGUF converter permutes the rows of `Wq` and `Wk` so that this, on the
/// stored weights, equals Hugging Face's `rotate_half` (NeoX-style) on the original ones.
pub fn rope_norm(x: &mut [f32], head_dim: usize, rope_dims: usize, position: u32, base: f32) {
    let pairs = rope_dims / 2;
    for head in x.chunks_exact_mut(head_dim) {
        for i in 0..pairs {
            let theta = f64::from(position) * f64::from(base).powf(-2.0 * i as f64 / rope_dims as f64);
            let (s, c) = (theta.sin() as f32, theta.cos() as f32);
            let (x0, x1) = (head[2 * i], head[2 * i + 1]);
            head[2 * i] = x0 * c - x1 * s;
            head[2 * i + 1] = x0 * s + x1 * c;
        }
    }
}

/// llama.cpp's NeoX RoPE (`LLAMA_ROPE_TYPE_NEOX`: Qwen2, Qwen3), in place on `[heads][head_dim]`:
/// pair `(x[i], x[i + rope_dims / 2])` of each head, `i < rope_dims / 2`, is rotated by
/// `position * base^(-2i / rope_dims)`; dimensions past `rope_dims` are left alone.
pub fn rope_neox(x: &mut [f32], head_dim: usize, rope_dims: usize, position: u32, base: f32) {
    let pairs = rope_dims / 2;
    for head in x.chunks_exact_mut(head_dim) {
        for i in 0..pairs {
            let theta = f64::from(position) * f64::from(base).powf(-2.0 * i as f64 / rope_dims as f64);
            let (s, c) = (theta.sin() as f32, theta.cos() as f32);
            let (x0, x1) = (head[i], head[i + pairs]);
            head[i] = x0 * c - x1 * s;
            head[i + pairs] = x0 * s + x1 * c;
        }
    }
}

/// The index of the largest value; the lowest index wins ties (and NaNs are never chosen over a
/// number).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] || v[best].is_nan() && !x.is_nan() {
            best = i;
        }
    }
    best as u32
}

/// `-log softmax(logits)[target]`, in f64.
pub fn nll(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let sum: f64 = logits.iter().map(|&x| f64::from(x - max).exp()).sum();
    sum.ln() - f64::from(logits[target as usize] - max)
}
