// Shared by the model's products (model/matvec.wgsl, the decode step's; model/matmul.wgsl, the
// prefill's tiled ones): their parameters and bindings, W's words for common/quant.wgsl, and
// where an output row goes.

// must match `MatVecParams` in model/src/gpu_data.rs
struct MatVecParams {
    rows: u32,       // output features (all outputs together)
    cols: u32,       // input features (a multiple of the format's block: 32, or 256)
    n_tokens: u32,   // tokens b: matvec's groups of MAX_TOKENS, matmul's tiles of TILE (workgroup z)
    accumulate: u32, // 1: y += W x', 0: y = W x'
    input: u32,      // 0: x, 1: rmsnorm(x) * g, 2: swiglu(x)
    split1: u32,     // rows of the first output
    split2: u32,     // rows of the second output (the rest go to the third)
    eps: f32,        // input 1: added to the mean square
}

@group(0) @binding(0) var<uniform> params: MatVecParams;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;        // [n_tokens][cols] ([n_tokens][2][cols] for swiglu)
@group(0) @binding(3) var<storage, read_write> y: array<f32>;  // [n_tokens][split1]
@group(0) @binding(4) var<storage, read> g: array<f32>;        // input 1: the norm's gain, [cols]
@group(0) @binding(5) var<storage, read_write> y2: array<f32>; // [n_tokens][split2]
@group(0) @binding(6) var<storage, read_write> y3: array<f32>; // [n_tokens][rows - split1 - split2]

fn weight_word(i: u32) -> u32 {
    return w[i];
}

// Output `row` of token b: to y, y2 or y3 by the splits, added to what is there with `accumulate`.
fn store_output(b: u32, row: u32, v: f32) {
    let s1 = params.split1;
    let s2 = params.split2;
    if (row < s1) {
        let o = b * s1 + row;
        y[o] = select(v, y[o] + v, params.accumulate != 0u);
    } else if (row < s1 + s2) {
        let o = b * s2 + row - s1;
        y2[o] = select(v, y2[o] + v, params.accumulate != 0u);
    } else {
        let s3 = params.rows - s1 - s2;
        let o = b * s3 + row - s1 - s2;
        y3[o] = select(v, y3[o] + v, params.accumulate != 0u);
    }
}
