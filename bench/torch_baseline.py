#!/usr/bin/env python3
"""Same-run baseline for `expertkv bench attend --torch`: PyTorch SDPA decode attention
(q_len 1, GQA) over a dense f16/f32 KV cache of the same shape, timed with CUDA events.

Prints one JSON object per line: kernel, shape, median_ms, gbps (bytes of K and V read per
call over the median time), device. `--copy` also measures PyTorch's device copy roofline.
"""

import argparse
import json
import statistics
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=["f16", "f32"], default="f16")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--copy", action="store_true", help="also time a device-to-device copy of 1 GiB")
    ap.add_argument("--route", action="store_true", help="time topk(softmax(logits), k) instead of attention")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--json", action="store_true", help="JSON lines only")
    a = ap.parse_args()

    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("error: PyTorch is not installed (pip install torch)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: no CUDA device for the PyTorch baseline", file=sys.stderr)
        return 2
    if a.q_heads % a.kv_heads:
        print("error: --q-heads must be a multiple of --kv-heads", file=sys.stderr)
        return 2

    dev = torch.device("cuda")
    dt = torch.float16 if a.dtype == "f16" else torch.float32
    g = torch.Generator(device=dev).manual_seed(7)

    if a.route:
        logits = torch.randn(a.tokens, a.experts, device=dev, dtype=torch.float32, generator=g)

        def route():
            probs = torch.softmax(logits, dim=-1)
            w, idx = torch.topk(probs, a.top_k, dim=-1)
            return w / w.sum(dim=-1, keepdim=True), idx

        for _ in range(a.warmup):
            route()
        torch.cuda.synchronize()
        ms = []
        for _ in range(a.reps):
            s = torch.cuda.Event(enable_timing=True)
            e = torch.cuda.Event(enable_timing=True)
            s.record()
            route()
            e.record()
            e.synchronize()
            ms.append(s.elapsed_time(e))
        med = statistics.median(ms)
        print(json.dumps({"kernel": "torch_topk_softmax", "shape": f"t{a.tokens}_e{a.experts}_k{a.top_k}", "median_ms": med,
                          "gbps": a.tokens * a.experts * 4 / (med * 1e-3) / 1e9, "device": torch.cuda.get_device_name(0),
                          "torch": torch.__version__}))
        return 0
    q = torch.randn(a.batch, a.q_heads, 1, a.head_dim, device=dev, dtype=dt, generator=g)
    k = torch.randn(a.batch, a.kv_heads, a.tokens, a.head_dim, device=dev, dtype=dt, generator=g)
    v = torch.randn(a.batch, a.kv_heads, a.tokens, a.head_dim, device=dev, dtype=dt, generator=g)

    def timed(fn):
        for _ in range(a.warmup):
            fn()
        torch.cuda.synchronize()
        ms = []
        for _ in range(a.reps):
            s = torch.cuda.Event(enable_timing=True)
            e = torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ms.append(s.elapsed_time(e))
        return statistics.median(ms)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    # Check once against a float64 computation on a slice, so the baseline is really attention.
    with torch.no_grad():
        out = sdpa()
        rep = a.q_heads // a.kv_heads
        k64 = k[:1].double().repeat_interleave(rep, dim=1)
        v64 = v[:1].double().repeat_interleave(rep, dim=1)
        w = torch.softmax((q[:1].double() @ k64.transpose(-1, -2)) / a.head_dim**0.5, dim=-1)
        ref = w @ v64
        err = ((out[:1].double() - ref).norm() / ref.norm()).item()

    bytes_kv = 2 * a.batch * a.tokens * a.kv_heads * a.head_dim * (2 if a.dtype == "f16" else 4)
    shape = f"b{a.batch}_hq{a.q_heads}_hkv{a.kv_heads}_d{a.head_dim}_t{a.tokens}_{a.dtype}"
    name = torch.cuda.get_device_name(0)
    ms = timed(sdpa)
    lines = [{"kernel": "torch_sdpa", "shape": shape, "median_ms": ms, "gbps": bytes_kv / (ms * 1e-3) / 1e9,
              "bytes": bytes_kv, "rel_err_vs_f64": err, "device": name, "torch": torch.__version__}]
    if a.copy:
        n = (1 << 30) // 4
        src = torch.randn(n, device=dev, dtype=torch.float32, generator=g)
        dst = torch.empty_like(src)
        cms = timed(lambda: dst.copy_(src))
        lines.append({"kernel": "torch_copy", "shape": "1GiB", "median_ms": cms, "gbps": 2 * n * 4 / (cms * 1e-3) / 1e9,
                      "bytes": 2 * n * 4, "device": name, "torch": torch.__version__})
    for line in lines:
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
