//! The model kernels (matrix-vector products over block-format weights dequantised in-kernel,
//! RMSNorm, RoPE, SwiGLU, embedding rows) against their f64 CPU references, on random weights in
//! every format and, when the model file is there, on a real SmolLM2 matrix.

use expertkv_core::rng::Rng;
use expertkv_core::runtime::Runtime;
use expertkv_model::ops::{GpuMatrix, MATMUL_TILE, MATVEC_MAX_TOKENS, ModelKernels, MoeFfn, MoeGroups, WeightFormat};
use expertkv_model::reference::ops as cpu;

use crate::common::{POISON_F32, case_index, fixed_seeds, pick, rt, seeds};

/// File bytes of a random `rows x cols` matrix in `format` (finite scales, every code drawn;
/// one block in eight takes its format's extremes: the largest codes, and with `huge` F16's and
/// BF16's largest magnitudes, which products through an FFN would overflow).
fn random_blocks(rng: &mut Rng, format: WeightFormat, rows: u32, cols: u32, huge: bool) -> Vec<u8> {
    let big = |rng: &mut Rng, max: f64| if huge { max * (rng.uniform() - 0.5) } else { 8.0 * (rng.uniform() - 0.5) };
    let blocks = rows as usize * cols as usize / format.block_weights();
    let f16 = |v: f64| half::f16::from_f64(v).to_le_bytes();
    let mut out = Vec::with_capacity(blocks * format.file_block_bytes());
    for _ in 0..blocks {
        let edge = rng.below(8) == 0;
        let bytes = |n: usize, rng: &mut Rng| -> Vec<u8> { (0..n).map(|_| if edge { 255 } else { rng.below(256) as u8 }).collect() };
        match format {
            WeightFormat::F32 => {
                for _ in 0..32 {
                    out.extend((rng.normal() as f32).to_le_bytes());
                }
            }
            WeightFormat::F16 => {
                for _ in 0..32 {
                    out.extend(f16(if edge { big(rng, 65504.0) } else { rng.normal() }));
                }
            }
            WeightFormat::BF16 => {
                for _ in 0..32 {
                    out.extend(half::bf16::from_f64(if edge { big(rng, 1e30) } else { rng.normal() }).to_le_bytes());
                }
            }
            WeightFormat::Q8_0 => {
                out.extend(f16(rng.range(0.001, 0.05)));
                out.extend(bytes(32, rng));
            }
            WeightFormat::Q4_1 => {
                out.extend(f16(rng.range(0.001, 0.1)));
                out.extend(f16(rng.range(-0.5, 0.1)));
                out.extend(bytes(16, rng));
            }
            WeightFormat::Q4_0 => {
                out.extend(f16(rng.range(0.001, 0.1)));
                out.extend(bytes(16, rng));
            }
            WeightFormat::Q4K | WeightFormat::Q5K => {
                out.extend(f16(rng.range(0.0001, 0.01)));
                out.extend(f16(rng.range(0.0001, 0.01)));
                // 12 bytes of 6-bit scales and mins, then (Q5_K) 32 bytes of fifth bits, the codes.
                out.extend(bytes(12, rng));
                if format == WeightFormat::Q5K {
                    out.extend(bytes(32, rng));
                }
                out.extend(bytes(128, rng));
            }
            WeightFormat::Q6K => {
                out.extend(bytes(128 + 64 + 16, rng));
                out.extend(f16(rng.range(0.0001, 0.01)));
            }
        }
    }
    out
}

fn normals(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.normal() as f32).collect()
}

fn run(rt: &Runtime, label: &str, f: impl FnOnce(&mut wgpu::ComputePass<'_>)) {
    let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(label) });
    {
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some(label), timestamp_writes: None });
        f(&mut pass);
    }
    rt.queue.submit([enc.finish()]);
    rt.check(label).expect("no GPU error");
}

fn close(got: &[f32], want: &[f64], scale: &[f64], tol: f64, ctx: &str) {
    assert_eq!(got.len(), want.len(), "{ctx}: lengths");
    for (i, ((g, w), s)) in got.iter().zip(want).zip(scale).enumerate() {
        assert!(g.is_finite() && (f64::from(*g) - w).abs() <= tol * (s + 1e-3), "{ctx}: element {i}: {g} vs {w} (scale {s})");
    }
}

#[test]
fn matvec_and_embed_match_cpu_in_every_weight_format() {
    let rt = rt();
    let k = pollster::block_on(ModelKernels::new(rt, &WeightFormat::ALL)).expect("kernels");
    let prefill = pollster::block_on(k.for_prefill(rt)).expect("the prefill's kernels");
    let (mut formats_seen, mut kernels_seen) = ([0u32; WeightFormat::ALL.len()], [0u32; 2]);
    for seed in seeds("model_matvec", 18) {
        let mut rng = Rng::new(seed);
        let format = pick(seed, &WeightFormat::ALL);
        formats_seen[format.define() as usize] += 1;
        let rows = 1 + rng.below(300);
        let bw = format.block_weights() as u32;
        let cols = bw * (1 + rng.below(384 / bw + 1));
        // Both kernels: the matrix-vector one past one group of MATVEC_MAX_TOKENS (a decode
        // batch), and the prefill's tiled one past two tiles of tokens (its rows: up to 300,
        // past four tiles).
        let tiled = rng.below(2) == 1;
        let n = if tiled { 1 + rng.below(2 * MATMUL_TILE + 8) } else { 1 + rng.below(3 * MATVEC_MAX_TOKENS) };
        kernels_seen[usize::from(tiled)] += 1;
        let k = if tiled { &prefill } else { &k };
        let ctx = format!("seed {seed}: {format:?} {rows} x {cols}, {n} tokens, tiled {tiled}");
        let bytes = random_blocks(&mut rng, format, rows, cols, true);
        let w = GpuMatrix::upload(rt, "w", format, rows, cols, &bytes).expect("upload");
        let wf = cpu::dequant_matrix(format, rows, cols, &bytes).expect("dequant");
        let x = normals(&mut rng, (n * cols) as usize);
        let xb = rt.storage_init("x", &x);
        let y = rt.storage("y", u64::from(n * rows) * 4);
        rt.fill_u32(&y, POISON_F32);
        run(rt, "matvec", |p| k.matvec(rt, p, &w, &xb, &y, n).expect("matvec"));
        let got: Vec<f32> = pollster::block_on(rt.read_all(&y)).expect("read");
        let want = cpu::matvec(&wf, rows as usize, cols as usize, &x, n as usize);
        let scale: Vec<f64> = (0..(n * rows) as usize)
            .map(|i| {
                let (b, o) = (i / rows as usize, i % rows as usize);
                (0..cols as usize).map(|c| (f64::from(wf[o * cols as usize + c]) * f64::from(x[b * cols as usize + c])).abs()).sum()
            })
            .collect();
        close(&got, &want, &scale, 1e-5, &ctx);
        // Tiled, a token's products do not depend on the chunk it came in: the same tokens in
        // calls of a random size give the same bits.
        if tiled && n > 1 {
            let size = 1 + rng.below(n - 1);
            let mut parts: Vec<f32> = Vec::new();
            for part in x.chunks(size as usize * cols as usize) {
                let m = (part.len() / cols as usize) as u32;
                let (xp, yp) = (rt.storage_init("x part", part), rt.storage("y part", u64::from(m * rows) * 4));
                rt.fill_u32(&yp, POISON_F32);
                run(rt, "matvec part", |p| k.matvec(rt, p, &w, &xp, &yp, m).expect("matvec"));
                parts.extend(pollster::block_on(rt.read_all::<f32>(&yp)).expect("read"));
            }
            let same = got.len() == parts.len() && got.iter().zip(&parts).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{ctx}: tiled in calls of {size} tokens, the products differ");
        }
        // Not tiled, a token alone (the one-token kernel, a decode step at batch 1) gives the
        // bits it got among its group: the same sums in the same order.
        if !tiled {
            let b = rng.below(n) as usize;
            let one = &x[b * cols as usize..(b + 1) * cols as usize];
            let (xo, yo) = (rt.storage_init("x one", one), rt.storage("y one", u64::from(rows) * 4));
            rt.fill_u32(&yo, POISON_F32);
            run(rt, "matvec one", |p| k.matvec(rt, p, &w, &xo, &yo, 1).expect("matvec"));
            let alone: Vec<f32> = pollster::block_on(rt.read_all(&yo)).expect("read");
            let among = &got[b * rows as usize..(b + 1) * rows as usize];
            let same = alone.iter().zip(among).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{ctx}: token {b} alone differs from its products among {n} tokens");
        }
        // The same product added to what y holds (the residual stream).
        let y0 = normals(&mut rng, (n * rows) as usize);
        rt.queue.write_buffer(&y, 0, bytemuck::cast_slice(&y0));
        run(rt, "matvec_add", |p| k.matvec_add(rt, p, &w, &xb, &y, n).expect("matvec_add"));
        let got: Vec<f32> = pollster::block_on(rt.read_all(&y)).expect("read");
        let want_add: Vec<f64> = want.iter().zip(&y0).map(|(a, b)| a + f64::from(*b)).collect();
        let scale_add: Vec<f64> = scale.iter().zip(&y0).map(|(a, b)| a + f64::from(b.abs())).collect();
        close(&got, &want_add, &scale_add, 1e-5, &format!("{ctx}, accumulated"));
        // The norm before the product folded in, the rows split over one to three outputs (a
        // stacked [Wq; Wk; Wv]), each poisoned first.
        let g: Vec<f32> = (0..cols).map(|_| rng.range(0.5, 1.5) as f32).collect();
        let gb = rt.storage_init("g", &g);
        let parts = 1 + rng.below(rows.min(3));
        let mut splits: Vec<u32> = (1..parts).map(|_| 1 + rng.below(rows - 1)).collect();
        splits.sort_unstable();
        splits.dedup();
        let bounds: Vec<u32> = std::iter::once(0).chain(splits).chain(std::iter::once(rows)).collect();
        let outs: Vec<(wgpu::Buffer, u32)> = bounds
            .windows(2)
            .map(|r| {
                let b = rt.storage("out", u64::from(n * (r[1] - r[0])) * 4);
                rt.fill_u32(&b, POISON_F32);
                (b, r[1] - r[0])
            })
            .collect();
        let out_refs: Vec<(&wgpu::Buffer, u32)> = outs.iter().map(|(b, r)| (b, *r)).collect();
        run(rt, "matvec_norm", |p| k.matvec_norm(rt, p, &w, &xb, &gb, 1e-5, &out_refs, n).expect("matvec_norm"));
        let want = cpu::matvec_norm(&wf, rows as usize, cols as usize, &x, &g, 1e-5, n as usize);
        let xn = cpu::rmsnorm(&x, &g, cols as usize, 1e-5);
        for (part, ((b, r), lo)) in outs.iter().zip(&bounds).enumerate() {
            let got: Vec<f32> = pollster::block_on(rt.read_all(b)).expect("read");
            let (lo, r) = (*lo as usize, *r as usize);
            let pick = |v: &[f64]| -> Vec<f64> {
                (0..n as usize).flat_map(|t| v[t * rows as usize + lo..t * rows as usize + lo + r].to_vec()).collect()
            };
            let scale: Vec<f64> = (0..n as usize)
                .flat_map(|t| {
                    let xn = &xn;
                    let wf = &wf;
                    (lo..lo + r).map(move |o| {
                        (0..cols as usize).map(|c| (f64::from(wf[o * cols as usize + c]) * xn[t * cols as usize + c]).abs()).sum()
                    })
                })
                .collect();
            close(&got, &pick(&want), &scale, 1e-5, &format!("{ctx}: matvec_norm output {part} of {}", outs.len()));
        }
        // SwiGLU before the product folded in, added to the residual.
        let gu = normals(&mut rng, (2 * n * cols) as usize);
        let gub = rt.storage_init("gu", &gu);
        rt.queue.write_buffer(&y, 0, bytemuck::cast_slice(&y0));
        run(rt, "matvec_swiglu_add", |p| k.matvec_swiglu_add(rt, p, &w, &gub, &y, n).expect("matvec_swiglu_add"));
        let got: Vec<f32> = pollster::block_on(rt.read_all(&y)).expect("read");
        let act = cpu::swiglu(&gu, cols as usize);
        let want: Vec<f64> = cpu::matvec_swiglu(&wf, rows as usize, cols as usize, &gu, n as usize)
            .iter()
            .zip(&y0)
            .map(|(a, b)| a + f64::from(*b))
            .collect();
        let scale: Vec<f64> = (0..(n * rows) as usize)
            .map(|i| {
                let (b, o) = (i / rows as usize, i % rows as usize);
                f64::from(y0[i].abs())
                    + (0..cols as usize).map(|c| (f64::from(wf[o * cols as usize + c]) * act[b * cols as usize + c]).abs()).sum::<f64>()
            })
            .collect();
        close(&got, &want, &scale, 1e-5, &format!("{ctx}: matvec_swiglu_add"));
        // Embedding rows of the same matrix.
        let tokens: Vec<u32> = (0..n).map(|_| rng.below(rows)).collect();
        let tb = rt.storage_init("tokens", &tokens);
        let e = rt.storage("e", u64::from(n * cols) * 4);
        rt.fill_u32(&e, POISON_F32);
        run(rt, "embed", |p| k.embed(rt, p, &w, &tb, &e, n).expect("embed"));
        let got: Vec<f32> = pollster::block_on(rt.read_all(&e)).expect("read");
        let want: Vec<f32> = tokens.iter().flat_map(|&t| wf[(t * cols) as usize..((t + 1) * cols) as usize].to_vec()).collect();
        assert_eq!(got, want, "{ctx}: embedding rows are exact");
    }
    if fixed_seeds() {
        assert!(formats_seen.iter().all(|&c| c > 0), "every format drawn: {formats_seen:?}");
        assert!(kernels_seen.iter().all(|&c| c > 0), "both kernels drawn: {kernels_seen:?}");
    }
    // Bad shapes are refused with a message, not a panic.
    assert!(GpuMatrix::upload(rt, "w", WeightFormat::Q4_1, 2, 33, &[0; 40]).is_err());
    assert!(GpuMatrix::upload(rt, "w", WeightFormat::Q4_1, 2, 32, &[0; 39]).is_err());
}

/// The expert FFN (only the chosen experts' neurons, over permuted weights, each expert scaled
/// by its weight) against its f64 reference on random weights in every format, random expert
/// sizes (some empty), choices and weights (all 1, as MoEfied, in one draw of three).
#[test]
fn moe_ffn_matches_cpu_in_every_weight_format() {
    let rt = rt();
    let k = pollster::block_on(ModelKernels::new(rt, &WeightFormat::ALL)).expect("kernels");
    let mut formats_seen = [0u32; WeightFormat::ALL.len()];
    for seed in seeds("model_moe_ffn", 18) {
        let mut rng = Rng::new(seed);
        let format = pick(seed, &WeightFormat::ALL);
        formats_seen[format.define() as usize] += 1;
        // Up to 24 blocks of 32 per row: more than one per invocation of a neuron (16).
        let bw = format.block_weights() as u32;
        let hidden = bw * (1 + rng.below(768 / bw));
        let ffn = 8 + rng.below(200);
        let experts = 1 + rng.below(ffn.min(12));
        let top_k = 1 + rng.below(experts);
        let n = 1 + rng.below(MATVEC_MAX_TOKENS);
        let ctx = format!("seed {seed}: {format:?} hidden {hidden}, ffn {ffn}, top-{top_k} of {experts}, {n} tokens");
        // A random partition: a shuffled neuron order cut at random points (empty experts allowed).
        let mut neurons: Vec<u32> = (0..ffn).collect();
        for i in (1..neurons.len()).rev() {
            neurons.swap(i, rng.below(i as u32 + 1) as usize);
        }
        let mut cuts: Vec<u32> = (0..experts - 1).map(|_| rng.below(ffn + 1)).collect();
        cuts.sort_unstable();
        let offsets: Vec<u32> = std::iter::once(0).chain(cuts).chain(std::iter::once(ffn)).collect();
        let gate = random_blocks(&mut rng, format, ffn, hidden, false);
        let up = random_blocks(&mut rng, format, ffn, hidden, false);
        let down: Vec<f32> = normals(&mut rng, (hidden * ffn) as usize).iter().map(|v| v * 0.1).collect();
        let m = MoeFfn::upload(rt, "moe", format, hidden, &gate, &up, &down, &neurons, &offsets).expect("upload");
        assert!(!m.groupable(), "{ctx}: MoEfied experts run per token in a prefill");
        // The reference over the same permutation, from the file's bytes.
        let gf = cpu::dequant_matrix(format, ffn, hidden, &gate).expect("gate");
        let uf = cpu::dequant_matrix(format, ffn, hidden, &up).expect("up");
        let (h, f) = (hidden as usize, ffn as usize);
        let mut gate_up = Vec::with_capacity(2 * f * h);
        for src in [&gf, &uf] {
            for &nn in &neurons {
                gate_up.extend_from_slice(&src[nn as usize * h..(nn as usize + 1) * h]);
            }
        }
        let down_t: Vec<f32> = neurons.iter().flat_map(|&nn| (0..h).map(|o| down[o * f + nn as usize]).collect::<Vec<_>>()).collect();
        let x: Vec<f32> = normals(&mut rng, (n * hidden) as usize).iter().map(|v| v * 0.2).collect();
        // Distinct experts per token, as a router picks them.
        let mut sel = Vec::new();
        for _ in 0..n {
            let mut all: Vec<u32> = (0..experts).collect();
            for j in 0..top_k as usize {
                let pick = j + rng.below(experts - j as u32) as usize;
                all.swap(j, pick);
            }
            sel.extend_from_slice(&all[..top_k as usize]);
        }
        let unit = rng.below(3) == 0;
        let wts: Vec<f32> = (0..n * top_k).map(|_| if unit { 1.0 } else { rng.range(0.05, 1.0) as f32 }).collect();
        let xb = rt.storage_init("x", &x);
        let sb = rt.storage_init("sel", &sel);
        let wb = rt.storage_init("wts", &wts);
        let act = rt.storage("act", u64::from(n * top_k * m.max_size.max(1)) * 4);
        let y = rt.storage("y", u64::from(n * hidden) * 4);
        rt.fill_u32(&act, POISON_F32);
        rt.fill_u32(&y, POISON_F32);
        run(rt, "moe", |p| k.moe_ffn(rt, p, &m, &xb, &sb, &wb, &act, &y, n, top_k, false).expect("moe_ffn"));
        let got: Vec<f32> = pollster::block_on(rt.read_all(&y)).expect("read");
        let want = cpu::moe_ffn(&gate_up, &down_t, &offsets, h, &x, &sel, &wts, top_k as usize, n as usize);
        // Added to a residual stream instead: the same sums plus what was there.
        let resid: Vec<f32> = normals(&mut rng, (n * hidden) as usize);
        let yr = rt.storage_init("residual", &resid);
        rt.fill_u32(&act, POISON_F32);
        run(rt, "moe", |p| k.moe_ffn(rt, p, &m, &xb, &sb, &wb, &act, &yr, n, top_k, true).expect("moe_ffn accumulate"));
        let got_acc: Vec<f32> = pollster::block_on(rt.read_all(&yr)).expect("read");
        let want_acc: Vec<f64> = want.iter().zip(&resid).map(|(w, r)| w + f64::from(*r)).collect();
        // Scale: the sum of |terms| of each output.
        let scale: Vec<f64> = (0..(n * hidden) as usize)
            .map(|i| {
                let (b, o) = (i / h, i % h);
                let mut s = 0.0;
                let chosen = b * top_k as usize..(b + 1) * top_k as usize;
                for (&e, &w) in sel[chosen.clone()].iter().zip(&wts[chosen]) {
                    for r in offsets[e as usize] as usize..offsets[e as usize + 1] as usize {
                        let dot = |row: usize| -> f64 { (0..h).map(|c| f64::from(gate_up[row * h + c]) * f64::from(x[b * h + c])).sum() };
                        let g = dot(r);
                        let a = g / (1.0 + (-g).exp()) * dot(f + r) * f64::from(w);
                        s += (a * f64::from(down_t[r * h + o])).abs();
                    }
                }
                s
            })
            .collect();
        close(&got, &want, &scale, 1e-4, &ctx);
        let scale_acc: Vec<f64> = scale.iter().zip(&resid).map(|(s, r)| s + f64::from(r.abs())).collect();
        close(&got_acc, &want_acc, &scale_acc, 1e-4, &format!("{ctx}, added to a residual"));
    }
    if fixed_seeds() {
        assert!(formats_seen.iter().all(|&c| c > 0), "every format drawn: {formats_seen:?}");
    }
    // A partition that is not one is refused.
    let g = [0u8; 2 * 2 * 20];
    assert!(MoeFfn::upload(rt, "bad", WeightFormat::Q4_1, 32, &g[..40], &g[..40], &[0.0; 64], &[0, 0], &[0, 2]).is_err());
    assert!(MoeFfn::upload(rt, "bad", WeightFormat::Q4_1, 32, &g[..40], &g[..40], &[0.0; 64], &[0, 1], &[0, 1]).is_err());
}

/// A MoE file's own experts (`MoeFfn::upload_experts`): gate/up and Wdown as the file stores
/// them, Wdown in a format of its own (as K-quant mixes keep it), dequantised in-kernel by
/// `moe_down_q`; against the CPU reference on the dequantised matrices.
#[test]
fn moe_file_experts_match_cpu_in_every_weight_format() {
    let rt = rt();
    let k = pollster::block_on(ModelKernels::new(rt, &WeightFormat::ALL)).expect("kernels");
    let kp = pollster::block_on(k.for_prefill(rt)).expect("the prefill's kernels");
    let mut formats_seen = [0u32; WeightFormat::ALL.len()];
    for seed in seeds("model_moe_file_experts", 18) {
        let i = case_index(seed) as usize;
        let mut rng = Rng::new(seed);
        let format = pick(seed, &WeightFormat::ALL);
        // Every down format twice, each beside a random gate/up format.
        let down_format = WeightFormat::ALL[(4 * i + 1) % WeightFormat::ALL.len()];
        formats_seen[down_format.define() as usize] += 1;
        let hidden = format.block_weights() as u32 * (1 + rng.below(512 / format.block_weights() as u32));
        let f = down_format.block_weights() as u32 * (1 + rng.below(320 / down_format.block_weights() as u32));
        let experts = 1 + rng.below(6);
        let top_k = 1 + rng.below(experts);
        // Every other case grouped by expert as a prefill chunk is (moe_ffn_grouped), over up to
        // two tiles of 64 pairs per expert.
        let grouped = i % 2 == 1;
        let n = if grouped { 1 + rng.below(2 * MATMUL_TILE + 8) } else { 1 + rng.below(2 * MATVEC_MAX_TOKENS) };
        let ctx = format!(
            "seed {seed}: gate/up {format:?}, down {down_format:?}, hidden {hidden}, {experts} experts of {f}, top-{top_k}, {n} tokens, grouped {grouped}"
        );
        let gate = random_blocks(&mut rng, format, experts * f, hidden, false);
        let up = random_blocks(&mut rng, format, experts * f, hidden, false);
        let down = random_blocks(&mut rng, down_format, experts * hidden, f, false);
        let m = MoeFfn::upload_experts(rt, "experts", (format, &gate, &up), (down_format, &down), hidden, experts, f).expect("upload");
        let (h, fu) = (hidden as usize, f as usize);
        let mut gate_up = cpu::dequant_matrix(format, experts * f, hidden, &gate).expect("gate");
        gate_up.extend(cpu::dequant_matrix(format, experts * f, hidden, &up).expect("up"));
        let df = cpu::dequant_matrix(down_format, experts * hidden, f, &down).expect("down");
        // down_t[e f + s][o] = Wdown_e[o][s], scaled down as a trained FFN's is.
        let mut down_t = vec![0f32; experts as usize * fu * h];
        for e in 0..experts as usize {
            for o in 0..h {
                for s in 0..fu {
                    down_t[(e * fu + s) * h + o] = df[(e * h + o) * fu + s];
                }
            }
        }
        let offsets: Vec<u32> = (0..=experts).map(|e| e * f).collect();
        let x: Vec<f32> = normals(&mut rng, (n * hidden) as usize).iter().map(|v| v * 0.2).collect();
        let mut sel = Vec::new();
        for _ in 0..n {
            let mut all: Vec<u32> = (0..experts).collect();
            for j in 0..top_k as usize {
                all.swap(j, j + rng.below(experts - j as u32) as usize);
            }
            sel.extend_from_slice(&all[..top_k as usize]);
        }
        let wts: Vec<f32> = (0..n * top_k).map(|_| rng.range(0.05, 1.0) as f32).collect();
        let (xb, sb, wb) = (rt.storage_init("x", &x), rt.storage_init("sel", &sel), rt.storage_init("wts", &wts));
        let act = rt.storage("act", u64::from(n * top_k * f) * 4);
        let resid: Vec<f32> = normals(&mut rng, (n * hidden) as usize);
        let y = rt.storage_init("y", &resid);
        rt.fill_u32(&act, POISON_F32);
        let groups = MoeGroups::new(rt, n, experts, top_k, hidden);
        rt.fill_u32(&groups.out, POISON_F32);
        run(rt, "moe experts", |p| {
            if grouped {
                assert!(m.groupable(), "{ctx}: a MoE file's experts group");
                kp.moe_ffn_grouped(rt, p, &m, (&xb, &sb, &wb, &act, &y), &groups, n, top_k, true).expect("moe_ffn_grouped");
            } else {
                k.moe_ffn(rt, p, &m, &xb, &sb, &wb, &act, &y, n, top_k, true).expect("moe_ffn");
            }
        });
        let got: Vec<f32> = pollster::block_on(rt.read_all(&y)).expect("read");
        // Grouped, a token's output does not depend on the tokens beside it: the same tokens in
        // calls of a random size give the same bits.
        if grouped && n > 1 {
            let size = 1 + rng.below(n - 1) as usize;
            let mut parts: Vec<f32> = Vec::new();
            for (c, xs) in x.chunks(size * h).enumerate() {
                let m_n = (xs.len() / h) as u32;
                let r = (c * size * top_k as usize)..((c * size + m_n as usize) * top_k as usize);
                let (xp, sp, wp) = (rt.storage_init("x", xs), rt.storage_init("sel", &sel[r.clone()]), rt.storage_init("wts", &wts[r]));
                let yp = rt.storage_init("y", &resid[c * size * h..c * size * h + xs.len()]);
                let (ap, gp) = (rt.storage("act", u64::from(m_n * top_k * f) * 4), MoeGroups::new(rt, m_n, experts, top_k, hidden));
                run(rt, "moe part", |p| {
                    kp.moe_ffn_grouped(rt, p, &m, (&xp, &sp, &wp, &ap, &yp), &gp, m_n, top_k, true).expect("moe_ffn_grouped");
                });
                parts.extend(pollster::block_on(rt.read_all::<f32>(&yp)).expect("read"));
            }
            let first = parts.iter().zip(&got).position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(
                parts.len() == got.len() && first.is_none(),
                "{ctx}: grouped in calls of {size} tokens, the outputs differ from {first:?}"
            );
        }
        let want: Vec<f64> = cpu::moe_ffn(&gate_up, &down_t, &offsets, h, &x, &sel, &wts, top_k as usize, n as usize)
            .iter()
            .zip(&resid)
            .map(|(w, r)| w + f64::from(*r))
            .collect();
        // Scale: the sum of |terms| of each output, plus the residual.
        let dot = |row: usize, b: usize| -> f64 { (0..h).map(|c| f64::from(gate_up[row * h + c]) * f64::from(x[b * h + c])).sum() };
        let acts: Vec<f64> = (0..n as usize * top_k as usize)
            .flat_map(|bj| {
                let (b, e) = (bj / top_k as usize, sel[bj] as usize);
                (0..fu).map(move |s| (b, e * fu + s, bj))
            })
            .map(|(b, r, bj)| {
                let g = dot(r, b);
                g / (1.0 + (-g).exp()) * dot(experts as usize * fu + r, b) * f64::from(wts[bj])
            })
            .collect();
        let scale: Vec<f64> = (0..(n * hidden) as usize)
            .map(|i| {
                let (b, o) = (i / h, i % h);
                let mut s = f64::from(resid[i].abs());
                for j in 0..top_k as usize {
                    let e = sel[b * top_k as usize + j] as usize;
                    for sl in 0..fu {
                        s += (acts[(b * top_k as usize + j) * fu + sl] * f64::from(down_t[(e * fu + sl) * h + o])).abs();
                    }
                }
                s
            })
            .collect();
        close(&got, &want, &scale, 1e-4, &ctx);
    }
    if fixed_seeds() {
        assert!(formats_seen.iter().all(|&c| c > 0), "every down format drawn: {formats_seen:?}");
    }
    // Experts that are not whole blocks of the down format, or gate/up of the wrong size, are refused.
    let g = [0u8; 4 * 20];
    match MoeFfn::upload_experts(rt, "bad", (WeightFormat::Q4_1, &g, &g), (WeightFormat::Q4K, &g), 32, 2, 2) {
        Err(e) => assert!(e.to_string().contains("not whole"), "{e}"),
        Ok(_) => panic!("2 neurons per expert as Q4_K blocks were accepted"),
    }
    assert!(MoeFfn::upload_experts(rt, "bad", (WeightFormat::Q4_1, &g[..40], &g), (WeightFormat::Q4_1, &g), 32, 2, 32).is_err());
}

#[test]
fn rmsnorm_rope_swiglu_gated_residual_match_cpu() {
    let rt = rt();
    let k = pollster::block_on(ModelKernels::new(rt, &WeightFormat::ALL)).expect("kernels");
    for seed in seeds("model_elementwise", 6) {
        let mut rng = Rng::new(seed);
        let n = 1 + rng.below(8);
        let heads = 1 + rng.below(9);
        let head_dim = 2 * (1 + rng.below(64));
        let dim = heads * head_dim;
        let ctx = format!("seed {seed}: {n} tokens, {heads} heads x {head_dim}");
        // RMSNorm.
        let x = normals(&mut rng, (n * dim) as usize);
        let g: Vec<f32> = (0..dim).map(|_| rng.range(0.5, 1.5) as f32).collect();
        let (xb, gb) = (rt.storage_init("x", &x), rt.storage_init("g", &g));
        let y = rt.storage("y", u64::from(n * dim) * 4);
        rt.fill_u32(&y, POISON_F32);
        run(rt, "rmsnorm", |p| k.rmsnorm(rt, p, &xb, &gb, &y, n, dim, 1e-5));
        let got: Vec<f32> = pollster::block_on(rt.read_all(&y)).expect("read");
        let want = cpu::rmsnorm(&x, &g, dim as usize, 1e-5);
        close(&got, &want, &want.iter().map(|w| w.abs()).collect::<Vec<_>>(), 1e-5, &format!("{ctx}: rmsnorm"));
        // RoPE, in place, at positions up to 8K.
        let positions: Vec<u32> = (0..n).map(|_| rng.below(8192)).collect();
        let pb = rt.storage_init("positions", &positions);
        // Adjacent pairs (llama) and pairs half a head apart (NeoX: qwen2, qwen3); the queries
        // and the keys (fewer heads) in one dispatch.
        for neox in [false, true] {
            let want = cpu::rope(&x, &positions, heads as usize, head_dim as usize, 100_000.0, neox);
            let kv_heads = 1 + rng.below(heads);
            let kx = normals(&mut rng, (n * kv_heads * head_dim) as usize);
            let (qb, kb) = (rt.storage_init("q", &x), rt.storage_init("k", &kx));
            run(rt, "rope_qk", |p| k.rope_qk(rt, p, &qb, &kb, &pb, n, (heads, kv_heads), head_dim, 100_000.0, neox));
            let got_q: Vec<f32> = pollster::block_on(rt.read_all(&qb)).expect("read");
            let got_k: Vec<f32> = pollster::block_on(rt.read_all(&kb)).expect("read");
            // f32 angles at position p carry a few times p x 2^-24 rad of error (the angle's own
            // rounding is half an ulp of p, 2^-11 rad at 8K, and sin and cos add theirs); a
            // rotated element a cos - b sin moves by (|a| + |b|) times that, so each element's
            // scale is twice its head's largest input (at least 1) and the tolerance 2e-3, four
            // half ulps at 8K.
            let head_scale = |v: &[f32]| -> Vec<f64> {
                v.chunks(head_dim as usize)
                    .flat_map(|h| {
                        let m = h.iter().fold(0f64, |a, &x| a.max(f64::from(x.abs())));
                        std::iter::repeat_n((2.0 * m).max(1.0), h.len())
                    })
                    .collect()
            };
            close(&got_q, &want, &head_scale(&x), 2e-3, &format!("{ctx}: rope_qk queries (neox {neox})"));
            let want_k = cpu::rope(&kx, &positions, kv_heads as usize, head_dim as usize, 100_000.0, neox);
            close(&got_k, &want_k, &head_scale(&kx), 2e-3, &format!("{ctx}: rope_qk keys (neox {neox})"));
        }
        let gu = normals(&mut rng, (2 * n * dim) as usize);
        let gub = rt.storage_init("gu", &gu);
        // SwiGLU scaled by the sigmoid of a gate logit per token (a shared expert's).
        let gate: Vec<f32> = (0..n).map(|_| rng.range(-4.0, 4.0) as f32).collect();
        let gb = rt.storage_init("gate", &gate);
        let sg = rt.storage("sg", u64::from(n * dim) * 4);
        rt.fill_u32(&sg, POISON_F32);
        run(rt, "swiglu_gated", |p| k.swiglu_gated(rt, p, &gub, &gb, &sg, n, dim));
        let got: Vec<f32> = pollster::block_on(rt.read_all(&sg)).expect("read");
        let want = cpu::swiglu_gated(&gu, &gate, dim as usize);
        close(&got, &want, &want.iter().map(|w| w.abs()).collect::<Vec<_>>(), 1e-5, &format!("{ctx}: swiglu_gated"));
        // Residual add: exact in f32.
        let acc = rt.storage_init("acc", &x);
        run(rt, "residual", |p| k.residual(rt, p, &sg, &acc, n * dim));
        let got: Vec<f32> = pollster::block_on(rt.read_all(&acc)).expect("read");
        let sw: Vec<f32> = pollster::block_on(rt.read_all(&sg)).expect("read");
        let want: Vec<f32> = x.iter().zip(&sw).map(|(a, b)| a + b).collect();
        assert_eq!(got, want, "{ctx}: residual");
    }
}

/// A real SmolLM2 matrix (Q4_1) and the Q8_0 embedding through the kernels.
#[test]
fn matvec_on_real_model_weights() {
    let Some(bytes) = crate::common::model_bytes("matvec_on_real_model_weights") else { return };
    let g = expertkv_model::gguf::Gguf::parse(&bytes).expect("gguf");
    let rt = rt();
    let k = pollster::block_on(ModelKernels::new(rt, &WeightFormat::ALL)).expect("kernels");
    let mut rng = Rng::new(5);
    for name in ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "token_embd.weight"] {
        let t = g.tensor(name).unwrap_or_else(|| panic!("{name} in the file"));
        let (cols, rows) = (t.dims()[0] as u32, t.dims()[1] as u32);
        let format = WeightFormat::from_ggml(t.ggml_type()).expect("format");
        let data = g.tensor_data(name).expect("data");
        let w = GpuMatrix::upload(rt, name, format, rows, cols, data).expect("upload");
        let wf = cpu::dequant_matrix(format, rows, cols, data).expect("dequant");
        let n = 3;
        let x = normals(&mut rng, (n * cols) as usize);
        let xb = rt.storage_init("x", &x);
        let y = rt.storage("y", u64::from(n * rows) * 4);
        rt.fill_u32(&y, POISON_F32);
        run(rt, "matvec", |p| k.matvec(rt, p, &w, &xb, &y, n).expect("matvec"));
        let got: Vec<f32> = pollster::block_on(rt.read_all(&y)).expect("read");
        let want = cpu::matvec(&wf, rows as usize, cols as usize, &x, n as usize);
        let scale: Vec<f64> = want.iter().map(|_| (cols as f64).sqrt() * 0.1).collect();
        close(&got, &want, &scale, 1e-4, &format!("{name} ({format:?} {rows} x {cols})"));
    }
}

#[test]
fn kv_pack_matches_encode_values_bit_for_bit() {
    use expertkv_core::append::format::encode_values;
    use expertkv_core::config::KvDtype;
    let rt = rt();
    let k = pollster::block_on(ModelKernels::new(rt, &WeightFormat::ALL)).expect("kernels");
    for seed in seeds("model_kv_pack", 8) {
        let mut rng = Rng::new(seed);
        let f16 = seed % 2 == 0;
        let n = 1 + rng.below(MATVEC_MAX_TOKENS);
        let floats = 2 * (1 + rng.below(200));
        let ctx = format!("seed {seed}: {n} tokens of {floats}, f16 {f16}");
        // Magnitudes from f16's subnormals (2^-24..2^-14) to its top binade, so every rounding
        // path is taken; the values stay inside f16's range (beyond it the kernel clamps).
        let mut draw = |len: usize| -> Vec<f32> {
            (0..len).map(|_| (rng.normal() * 2f64.powf(rng.range(-22.0, 14.0))).clamp(-65_000.0, 65_000.0) as f32).collect()
        };
        let (kv_k, kv_v) = (draw((n * floats) as usize), draw((n * floats) as usize));
        let (kb, vb) = (rt.storage_init("k", &kv_k), rt.storage_init("v", &kv_v));
        let per = if f16 { floats / 2 } else { floats };
        let words = rt.storage("words", u64::from(n * 2 * per) * 4);
        rt.fill_u32(&words, POISON_F32);
        run(rt, "kv_pack", |p| k.kv_pack(rt, p, &kb, &vb, &words, n, floats, f16).expect("kv_pack"));
        let got: Vec<u32> = pollster::block_on(rt.read_all(&words)).expect("read");
        let dtype = if f16 { KvDtype::F16 } else { KvDtype::F32 };
        let mut want = Vec::new();
        for b in 0..n as usize {
            let r = b * floats as usize..(b + 1) * floats as usize;
            encode_values(&kv_k[r.clone()], dtype, &mut want);
            encode_values(&kv_v[r], dtype, &mut want);
        }
        assert_eq!(got.len(), want.len(), "{ctx}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{ctx}: word {i}: {g:#010x} vs {w:#010x}");
        }
    }
}

#[test]
fn moe_topk_and_weights_match_the_cpu_with_ties_and_signed_zeros() {
    use expertkv_model::moe::{softmax_share_weights, softmax_weights, top_k};
    let rt = rt();
    let k = pollster::block_on(ModelKernels::new(rt, &WeightFormat::ALL)).expect("kernels");
    for seed in seeds("model_moe_topk", 10) {
        let mut rng = Rng::new(seed);
        let n = 1 + rng.below(MATVEC_MAX_TOKENS);
        let e = 1 + rng.below(40);
        let top = 1 + rng.below(e);
        let layer = rng.below(4);
        let ctx = format!("seed {seed}: {n} tokens, top-{top} of {e}, layer slot {layer}");
        // Few distinct values, so ties are common; -0.0 and 0.0 differ in f32's total order.
        let pool = [-1.5f32, -0.0, 0.0, 0.25, 0.25, 3.0, -7.0];
        let scores: Vec<f32> =
            (0..n * e).map(|_| if rng.below(2) == 0 { pool[rng.below(pool.len() as u32) as usize] } else { rng.normal() as f32 }).collect();
        let sb = rt.storage_init("scores", &scores);
        let sel = rt.storage("sel", u64::from(n * top) * 4);
        let log = rt.storage("log", u64::from(4 * n * top) * 4);
        rt.fill_u32(&sel, POISON_F32);
        rt.fill_u32(&log, POISON_F32);
        run(rt, "moe_topk", |p| k.moe_topk(rt, p, &sb, &sel, &log, layer * n * top, n, e, top).expect("moe_topk"));
        let got: Vec<u32> = pollster::block_on(rt.read_all(&sel)).expect("read");
        let logged: Vec<u32> = pollster::block_on(rt.read_all(&log)).expect("read");
        let want: Vec<u32> = scores.chunks(e as usize).flat_map(|s| top_k(s, top as usize)).map(|x| x as u32).collect();
        assert_eq!(got, want, "{ctx}");
        let at = (layer * n * top) as usize;
        assert_eq!(&logged[at..at + want.len()], &want[..], "{ctx}: the log");
        assert!(logged[..at].iter().chain(&logged[at + want.len()..]).all(|&w| w == POISON_F32), "{ctx}: the log outside its slot");
        // A MoE file's weights of those choices: the softmax of the chosen scores (Mixtral), or
        // each one's share of the softmax over all experts (OLMoE, Qwen2-MoE).
        for share in [false, true] {
            let wts = rt.storage("wts", u64::from(n * top) * 4);
            rt.fill_u32(&wts, POISON_F32);
            run(rt, "moe_weights", |p| k.moe_weights(rt, p, &sb, &sel, &wts, n, e, top, share).expect("moe_weights"));
            let got_w: Vec<f32> = pollster::block_on(rt.read_all(&wts)).expect("read");
            let chosen: Vec<usize> = want.iter().map(|&x| x as usize).collect();
            for (b, (s, c)) in scores.chunks(e as usize).zip(chosen.chunks(top as usize)).enumerate() {
                let want_w = if share { softmax_share_weights(s, c) } else { softmax_weights(s, c) };
                let got_b = &got_w[b * top as usize..(b + 1) * top as usize];
                for (j, (g, w)) in got_b.iter().zip(&want_w).enumerate() {
                    assert!((g - w).abs() <= 1e-6 + 1e-5 * w.abs(), "{ctx} share {share}: token {b}, weight {j}: {g} vs {w}");
                }
                let sum: f32 = got_b.iter().sum();
                // The top k's shares of the whole softmax sum to 1 only when k = E.
                let whole = !share || top == e;
                assert!(!whole || (sum - 1.0).abs() < 1e-5, "{ctx} share {share}: token {b}: weights sum to {sum}");
                assert!(sum <= 1.0 + 1e-5, "{ctx} share {share}: token {b}: weights sum to {sum}");
            }
        }
    }
}
