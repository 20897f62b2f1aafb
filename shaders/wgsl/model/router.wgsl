// model: the MoEfied router's choice on the GPU: per token the top_k of its n_experts scores,
// highest first, ties to the lower index, in f32's total order (as expertkv_model::moe::top_k, which
// sorts with f32::total_cmp). Written to `sel` (read by model/moe.wgsl) and to `log` at
// `log_offset` (a step's choices of every layer, read back once per step). One invocation per
// token; top_k * n_experts * top_k steps, small next to the experts it chooses.
//
// moe_weights: a MoE file's weights of the chosen experts (whoever chose them), the softmax of
// their scores: wts[b][j] = exp(s_j - m) / sum_i exp(s_i - m), s_j = scores[b][sel[b][j]], m the
// largest, the sum over the chosen (as expertkv_model::moe::softmax_weights: Mixtral, Qwen3-MoE);
// with `share` set, m and the sum over all n_experts scores, so each chosen expert keeps its
// share of the whole softmax (as expertkv_model::moe::softmax_share_weights: OLMoE, Qwen2-MoE).

// must match `MoeTopkParams` in model/src/gpu_data.rs
struct MoeTopkParams {
    n_tokens: u32,
    n_experts: u32,
    top_k: u32,
    log_offset: u32,
    share: u32,      // moe_weights: 1 normalises over all experts, 0 over the chosen
    _pad1: u32,
    _pad2: u32,
    _pad3: u32,
}

@group(0) @binding(0) var<uniform> params: MoeTopkParams;
@group(0) @binding(1) var<storage, read> scores: array<f32>;
@group(0) @binding(2) var<storage, read_write> sel: array<u32>;
@group(0) @binding(3) var<storage, read_write> log: array<u32>;
@group(0) @binding(4) var<storage, read_write> wts: array<f32>;

// Bits of x as an unsigned key in f32's total order (-NaN < -inf < ... < -0 < +0 < ... < +NaN).
fn total_key(x: f32) -> u32 {
    let u = bitcast<u32>(x);
    return select(u | 0x80000000u, ~u, (u >> 31u) != 0u);
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let b = gid.x;
    if (b >= params.n_tokens) {
        return;
    }
    let k = params.top_k;
    let e_n = params.n_experts;
    for (var j = 0u; j < k; j++) {
        var best = 0xffffffffu;
        var best_key = 0u;
        for (var e = 0u; e < e_n; e++) {
            var taken = false;
            for (var i = 0u; i < j; i++) {
                taken = taken || sel[b * k + i] == e;
            }
            let key = total_key(scores[b * e_n + e]);
            if (!taken && (best == 0xffffffffu || key > best_key)) {
                best = e;
                best_key = key;
            }
        }
        sel[b * k + j] = best;
        log[params.log_offset + b * k + j] = best;
    }
}

@compute @workgroup_size(64)
fn moe_weights(@builtin(global_invocation_id) gid: vec3<u32>) {
    let b = gid.x;
    if (b >= params.n_tokens) {
        return;
    }
    let k = params.top_k;
    let e_n = params.n_experts;
    var m = bitcast<f32>(0xff7fffffu); // -f32::MAX (a decimal literal of it rounds past the range in Tint)
    var sum = 0.0;
    if (params.share == 1u) {
        for (var e = 0u; e < e_n; e++) {
            m = max(m, scores[b * e_n + e]);
        }
        for (var e = 0u; e < e_n; e++) {
            sum += exp(scores[b * e_n + e] - m);
        }
        for (var j = 0u; j < k; j++) {
            wts[b * k + j] = exp(scores[b * e_n + min(sel[b * k + j], e_n - 1u)] - m);
        }
    } else {
        for (var j = 0u; j < k; j++) {
            m = max(m, scores[b * e_n + min(sel[b * k + j], e_n - 1u)]);
        }
        for (var j = 0u; j < k; j++) {
            let w = exp(scores[b * e_n + min(sel[b * k + j], e_n - 1u)] - m);
            wts[b * k + j] = w;
            sum += w;
        }
    }
    for (var j = 0u; j < k; j++) {
        wts[b * k + j] = wts[b * k + j] / sum;
    }
}
