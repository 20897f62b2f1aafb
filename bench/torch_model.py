#!/usr/bin/env python3
"""The PyTorch baseline of `expertkv run`: the same GGUF model (llama, qwen2, qwen3; dense, or
llama with Mixtral-style experts) read from the same file, every weight dequantised to f16 (f32 with --dtype f32 or on the CPU),
attention by SDPA over a static KV cache, greedy decoding.

What it prints (JSON lines):
- `generate`: the greedy tokens after --ids (expertkv's `run --json` `prompt_ids`), to compare
  with expertkv's `generated_ids` (the same file, the same prompt: equal tokens mean the logits
  agree to their ranking), and the last prompt token's top logits.
- with --bench (CUDA): decode tokens/s at --batch sizes, eager and captured in a CUDA graph, and
  the prefill of --prefill tokens in one pass, timed with CUDA events (median of --reps).

The GGUF reader covers the header, metadata, tensor table and the F32, F16, BF16, Q8_0, Q4_0,
Q4_1 and Q4_K blocks (ggml's layouts); another tensor type is refused by name. Experts run as
gpt-fast's MoE layer does: the chosen experts' weights gathered per token (a step CUDA graphs
can capture), weighted by the softmax of their router logits renormalised over the top k.
"""

import argparse
import json
import struct
import sys

GGML = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 30: "BF16"}


def read_gguf(path):
    """(metadata dict, {name: (dims, type, bytes)}) of a GGUF v2/v3 file."""
    data = open(path, "rb").read()
    if data[:4] != b"GGUF":
        raise SystemExit(f"{path}: not a GGUF file")
    pos = 4
    (version,) = struct.unpack_from("<I", data, pos)
    pos += 4
    if version not in (2, 3):
        raise SystemExit(f"{path}: GGUF version {version}; this reader takes 2 and 3")
    n_tensors, n_kv = struct.unpack_from("<QQ", data, pos)
    pos += 16

    def string():
        nonlocal pos
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8
        s = data[pos : pos + n].decode("utf-8", "replace")
        pos += n
        return s

    scalars = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

    def value(t):
        nonlocal pos
        if t in scalars:
            (v,) = struct.unpack_from(scalars[t], data, pos)
            pos += struct.calcsize(scalars[t])
            return v
        if t == 8:
            return string()
        if t == 9:
            (et, n) = struct.unpack_from("<IQ", data, pos)
            pos += 12
            return [value(et) for _ in range(n)]
        raise SystemExit(f"{path}: metadata type {t} unknown")

    meta = {}
    for _ in range(n_kv):
        k = string()
        (t,) = struct.unpack_from("<I", data, pos)
        pos += 4
        meta[k] = value(t)
    infos = []
    for _ in range(n_tensors):
        name = string()
        (nd,) = struct.unpack_from("<I", data, pos)
        pos += 4
        dims = list(struct.unpack_from(f"<{nd}Q", data, pos))
        pos += 8 * nd
        (t, off) = struct.unpack_from("<IQ", data, pos)
        pos += 12
        infos.append((name, dims, t, off))
    align = meta.get("general.alignment", 32)
    base = (pos + align - 1) // align * align
    tensors = {}
    for name, dims, t, off in infos:
        if t not in GGML:
            tensors[name] = (dims, t, None)
            continue
        n = 1
        for d in dims:
            n *= d
        size = {
            "F32": 4 * n, "F16": 2 * n, "BF16": 2 * n, "Q8_0": n // 32 * 34, "Q4_0": n // 32 * 18, "Q4_1": n // 32 * 20,
            "Q4_K": n // 256 * 144,
        }[GGML[t]]
        tensors[name] = (dims, t, data[base + off : base + off + size])
    return meta, tensors


def dequant(np, dims, t, raw, name):
    """The tensor as f32, shaped [dims[-1]]..[dims[0]] (ggml order: the first dim contiguous)."""
    if raw is None:
        raise SystemExit(f"tensor `{name}` has ggml type {t}, which this baseline does not read")
    kind = GGML[t]
    if kind == "F32":
        v = np.frombuffer(raw, dtype="<f4")
    elif kind == "F16":
        v = np.frombuffer(raw, dtype="<f2").astype(np.float32)
    elif kind == "BF16":
        v = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    elif kind == "Q8_0":
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 34)
        d = b[:, :2].copy().view("<f2").astype(np.float32)
        q = b[:, 2:].view(np.int8).astype(np.float32)
        v = (d * q).reshape(-1)
    elif kind in ("Q4_0", "Q4_1"):
        width = 18 if kind == "Q4_0" else 20
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, width)
        d = b[:, :2].copy().view("<f2").astype(np.float32)
        qs = b[:, width - 16 :]
        lo, hi = (qs & 15).astype(np.float32), (qs >> 4).astype(np.float32)
        q = np.concatenate([lo, hi], axis=1)  # value j in the low nibble of byte j, 16 + j in the high
        if kind == "Q4_0":
            v = (d * (q - 8.0)).reshape(-1)
        else:
            m = b[:, 2:4].copy().view("<f2").astype(np.float32)
            v = (d * q + m).reshape(-1)
    elif kind == "Q4_K":
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 144)
        d = b[:, 0:2].copy().view("<f2").astype(np.float32)
        dmin = b[:, 2:4].copy().view("<f2").astype(np.float32)
        sc, qs = b[:, 4:16].astype(np.uint32), b[:, 16:144]
        # ggml's get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and
        # 4-7 (minimums); 4-7 in the nibbles of bytes 8-11 and the top 2 bits of bytes 0-7.
        scale = np.empty((b.shape[0], 8), np.float32)
        mins = np.empty((b.shape[0], 8), np.float32)
        for j in range(4):
            scale[:, j], mins[:, j] = sc[:, j] & 63, sc[:, j + 4] & 63
            scale[:, j + 4] = (sc[:, j + 8] & 15) | ((sc[:, j] >> 6) << 4)
            mins[:, j + 4] = (sc[:, j + 8] >> 4) | ((sc[:, j + 4] >> 6) << 4)
        v = np.empty((b.shape[0], 256), np.float32)
        for j in range(4):
            q = qs[:, 32 * j : 32 * j + 32]
            for half, sub in ((q & 15, 2 * j), (q >> 4, 2 * j + 1)):
                v[:, 32 * sub : 32 * sub + 32] = d * scale[:, sub : sub + 1] * half - dmin * mins[:, sub : sub + 1]
        v = v.reshape(-1)
    return v.reshape(list(reversed(dims)))


class Model:
    def __init__(self, torch, np, path, device, dtype):
        meta, tensors = read_gguf(path)
        arch = meta["general.architecture"]
        if arch not in ("llama", "qwen2", "qwen3"):
            raise SystemExit(f"architecture `{arch}`: this baseline runs llama, qwen2 and qwen3 (dense)")
        self.experts = meta.get(f"{arch}.expert_count", 0)
        self.top_k = meta.get(f"{arch}.expert_used_count", 0)
        if self.experts and arch != "llama":
            raise SystemExit(f"{arch} with experts: this baseline runs llama's (Mixtral-style) experts")
        k = lambda key, default=None: meta.get(f"{arch}.{key}", default)
        self.torch, self.device, self.dtype, self.arch = torch, device, dtype, arch
        self.hidden = k("embedding_length")
        self.heads = k("attention.head_count")
        self.kv_heads = k("attention.head_count_kv", self.heads)
        self.head_dim = k("attention.key_length", self.hidden // self.heads)
        self.layers = k("block_count")
        self.eps = k("attention.layer_norm_rms_epsilon")
        self.base = k("rope.freq_base", 10000.0)
        self.neox = arch != "llama"

        def w(name, f32=False):
            dims, t, raw = tensors[name]
            x = torch.from_numpy(dequant(np, dims, t, raw, name).copy())
            return x.to(device=device, dtype=torch.float32 if f32 else dtype)

        self.embed = w("token_embd.weight")
        self.head = w("output.weight") if "output.weight" in tensors else self.embed
        self.out_norm = w("output_norm.weight", True)
        self.blocks = []
        for l in range(self.layers):
            n = lambda s: f"blk.{l}.{s}"
            b = {
                "attn_norm": w(n("attn_norm.weight"), True),
                "qkv": torch.cat([w(n("attn_q.weight")), w(n("attn_k.weight")), w(n("attn_v.weight"))]),
                "wo": w(n("attn_output.weight")),
                "ffn_norm": w(n("ffn_norm.weight"), True),
            }
            if self.experts:
                # [E, ffn, hidden] gate and up, [E, hidden, ffn] down, [E, hidden] router.
                b["router"] = w(n("ffn_gate_inp.weight"), True)
                b["gate_e"], b["up_e"], b["down_e"] = w(n("ffn_gate_exps.weight")), w(n("ffn_up_exps.weight")), w(n("ffn_down_exps.weight"))
            else:
                b["gate_up"] = torch.cat([w(n("ffn_gate.weight")), w(n("ffn_up.weight"))])
                b["down"] = w(n("ffn_down.weight"))
            if arch == "qwen2":
                b["bias"] = torch.cat([w(n("attn_q.bias")), w(n("attn_k.bias")), w(n("attn_v.bias"))])
            if arch == "qwen3":
                b["q_norm"], b["k_norm"] = w(n("attn_q_norm.weight"), True), w(n("attn_k_norm.weight"), True)
            self.blocks.append(b)
        self.ffn = self.blocks[0]["down_e"].shape[2] if self.experts else self.blocks[0]["down"].shape[1]
        half = self.head_dim // 2
        self.inv_freq = self.base ** (-2.0 * torch.arange(half, device=device, dtype=torch.float32) / self.head_dim)

    def rms(self, x, g):
        xf = x.float()
        return (xf * self.torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * g).to(self.dtype)

    def rope(self, x, pos):
        """x: [B, T, H, D]; pos: [B, T] int."""
        torch = self.torch
        ang = pos.float()[..., None] * self.inv_freq  # [B, T, D/2]
        c, s = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
        xf = x.float()
        if self.neox:
            a, b = xf[..., : self.head_dim // 2], xf[..., self.head_dim // 2 :]
            out = torch.cat([a * c - b * s, a * s + b * c], -1)
        else:
            a, b = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)
        return out.to(self.dtype)

    def moe(self, h, b):
        """The chosen experts of every token: gathered per token for a few tokens (gpt-fast's
        ConditionalFeedForward, what a decode step's CUDA graph captures), else each expert over
        the tokens that chose it (a prefill)."""
        torch, F = self.torch, self.torch.nn.functional
        logits = h.float() @ b["router"].T  # [B, T, E]
        w, idx = torch.topk(logits, self.top_k, dim=-1)
        w = torch.softmax(w, dim=-1).to(self.dtype)  # the top k's softmax, renormalised
        if h.shape[0] * h.shape[1] > 8:
            out = torch.zeros_like(h)
            flat, fidx, fw = h.reshape(-1, h.shape[-1]), idx.reshape(-1, self.top_k), w.reshape(-1, self.top_k)
            acc = out.view(-1, h.shape[-1])
            for e in range(self.experts):
                tok, slot = (fidx == e).nonzero(as_tuple=True)
                if tok.numel() == 0:
                    continue
                x = flat[tok]
                y = (F.silu(x @ b["gate_e"][e].T) * (x @ b["up_e"][e].T)) @ b["down_e"][e].T
                acc.index_add_(0, tok, y * fw[tok, slot, None])
            return out
        g = torch.einsum("btd,btkfd->btkf", h, b["gate_e"][idx])
        u = torch.einsum("btd,btkfd->btkf", h, b["up_e"][idx])
        y = torch.einsum("btkf,btkdf->btkd", F.silu(g) * u, b["down_e"][idx])
        return torch.einsum("btkd,btk->btd", y, w)

    def new_cache(self, batch, ctx):
        shape = (self.layers, batch, self.kv_heads, ctx, self.head_dim)
        return [self.torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(2)]

    def forward(self, ids, pos, cache, last_only=True):
        """ids, pos: [B, T] (positions of each batch row consecutive from pos[:, 0]). Appends
        the K/V at their positions and returns the logits [B, V] of the last token (all tokens
        with last_only=False)."""
        torch, F = self.torch, self.torch.nn.functional
        B, T = ids.shape
        x = self.embed[ids]
        hq, hk, d = self.heads, self.kv_heads, self.head_dim
        kc, vc = cache
        # The whole static cache with a causal mask: no shape or value read back to the host, so
        # a decode step can be captured in a CUDA graph.
        ctx = kc.shape[3]
        mask = (torch.arange(ctx, device=self.device)[None, None, :] <= pos[:, :, None])[:, None]
        for l, b in enumerate(self.blocks):
            h = self.rms(x, b["attn_norm"])
            qkv = h @ b["qkv"].T
            if "bias" in b:
                qkv = qkv + b["bias"]
            q, k, v = qkv.split([hq * d, hk * d, hk * d], -1)
            q, k, v = q.view(B, T, hq, d), k.view(B, T, hk, d), v.view(B, T, hk, d)
            if "q_norm" in b:
                q, k = self.rms(q, b["q_norm"]), self.rms(k, b["k_norm"])
            q, k = self.rope(q, pos), self.rope(k, pos)
            idx = pos[:, None, :, None].expand(B, hk, T, d)
            kc[l].scatter_(2, idx, k.transpose(1, 2))
            vc[l].scatter_(2, idx, v.transpose(1, 2))
            # Causal over the cache: query t (position pos[t]) sees positions <= pos[t].
            att = F.scaled_dot_product_attention(q.transpose(1, 2), kc[l], vc[l], attn_mask=mask, enable_gqa=True)
            x = x + att.transpose(1, 2).reshape(B, T, hq * d) @ b["wo"].T
            h = self.rms(x, b["ffn_norm"])
            if self.experts:
                x = x + self.moe(h, b)
            else:
                g, u = (h @ b["gate_up"].T).split([self.ffn, self.ffn], -1)
                x = x + (F.silu(g) * u) @ b["down"].T
        if last_only:
            x = x[:, -1]
        return (self.rms(x, self.out_norm) @ self.head.T).float()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True, help="prompt token ids, comma-separated (expertkv run --json prompt_ids)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens to generate greedily")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="f16", choices=["f16", "f32"], help="weights and K/V (f32 on the CPU)")
    ap.add_argument("--bench", action="store_true", help="time decode and prefill (CUDA)")
    ap.add_argument("--batch", default="1,32", help="decode batch sizes to time")
    ap.add_argument("--prefill", type=int, default=2048, help="prompt tokens of the timed prefill (0: none)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per timing")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    try:
        import numpy as np
        import torch
    except ImportError:
        print("error: the baseline needs numpy and PyTorch", file=sys.stderr)
        return 2
    if a.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device (use --device cpu to check the tokens)", file=sys.stderr)
        return 2
    dev = torch.device(a.device)
    dtype = torch.float16 if a.dtype == "f16" and a.device == "cuda" else torch.float32
    torch.manual_seed(0)
    m = Model(torch, np, a.model, dev, dtype)
    ids = [int(x) for x in a.ids.split(",") if x.strip()]
    ctx = len(ids) + a.tokens + 1
    with torch.inference_mode():
        cache = m.new_cache(1, ctx)
        t = torch.tensor([ids], device=dev)
        logits = m.forward(t, torch.arange(len(ids), device=dev)[None], cache)
        top = torch.topk(logits[0], 5)
        out = []
        for i in range(a.tokens):
            nxt = int(logits[0].argmax())
            out.append(nxt)
            if i + 1 < a.tokens:
                p = len(ids) + i
                logits = m.forward(torch.tensor([[nxt]], device=dev), torch.tensor([[p]], device=dev), cache)
        print(json.dumps({
            "measure": "generate",
            "arch": m.arch,
            "dtype": str(dtype).replace("torch.", ""),
            "prompt_ids": ids,
            "generated_ids": out,
            "first_top5_ids": top.indices.tolist(),
            "first_top5_logits": [round(v, 4) for v in top.values.tolist()],
        }))
        if not a.bench:
            return 0
        if a.device != "cuda":
            print("error: --bench times on CUDA", file=sys.stderr)
            return 2
        bench(torch, m, a)
    return 0


def timed(torch, fn, reps):
    """Median milliseconds of fn() over reps, CUDA events."""
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def bench(torch, m, a):
    dev = m.device
    name = torch.cuda.get_device_name()
    for batch in [int(b) for b in a.batch.split(",")]:
        ctx = 16 + a.steps + 1
        cache = m.new_cache(batch, ctx)
        tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        pos = torch.full((batch, 1), 16, dtype=torch.long, device=dev)
        m.forward(torch.zeros(batch, 16, dtype=torch.long, device=dev), torch.arange(16, device=dev).expand(batch, 16), cache)

        def eager():
            for s in range(a.steps):
                pos.fill_(16 + s)
                m.forward(tok, pos, cache)

        eager()
        ms = timed(torch, eager, a.reps)
        # One decode step captured in a CUDA graph, replayed a step at a time (the position is
        # a tensor the graph reads, so one graph serves every step).
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                m.forward(tok, pos, cache)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            m.forward(tok, pos, cache)

        def graphed():
            for s in range(a.steps):
                pos.fill_(16 + s)
                graph.replay()

        graphed()
        gms = timed(torch, graphed, a.reps)
        for mode, t in (("eager", ms), ("cuda_graph", gms)):
            print(json.dumps({
                "measure": "decode", "mode": mode, "batch": batch, "steps": a.steps,
                "ms_per_step": t / a.steps, "tokens_per_s": batch * a.steps / (t / 1e3), "device": name,
            }))
    n = a.prefill
    if n == 0:
        return
    cache = m.new_cache(1, n + 1)
    ids = torch.randint(0, m.embed.shape[0], (1, n), device=dev)
    pos = torch.arange(n, device=dev)[None]
    m.forward(ids, pos, cache)
    t = timed(torch, lambda: m.forward(ids, pos, cache), a.reps)
    print(json.dumps({"measure": "prefill", "tokens": n, "ms": t, "tokens_per_s": n / (t / 1e3), "device": name}))


if __name__ == "__main__":
    sys.exit(main())
