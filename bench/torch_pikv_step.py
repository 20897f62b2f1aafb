#!/usr/bin/env python3
"""Same-run PyTorch baseline of one full MoE decode step (one layer, B sequences), the eager
PyTorch counterpart of an expertkv pipeline step, timed per stage with CUDA events.

Stages (in launch order) and the expertkv stage each one mirrors:
  route   PiKV cache-aware top-k: score = logit - lam * log1p(miss_e), topk, softmax gates over the
          chosen logits, per-expert load EMA via scatter_add_ (route/bias, topk, count, stats).
  append  write the new token's K/V [B, Hkv, d] and its metadata (position, top-1 expert) at slot T
          of a preallocated cache (shard/append_*). With --codec int8 the f16 K goes to the
          full-precision residual of the newest key group (KIVI) and V to a one-token staging row.
  codec   --codec int8 only (KIVI layout): quantise the new token's V per token, re-quantise the
          newest key group of G = --page-size tokens per channel (always the whole group), and
          dequantise every K/V the step reads to f16, because SDPA cannot read int8 (expertkv's
          codec kernels read compressed pages directly, attend/split_codec; no dequant pass).
          Dequant is torch.addcmul(min, codes_u8, scale, out=f16) (the fastest plain form on an
          H200 with torch 2.11), else mul + add where addcmul does not promote uint8.
  attend  SDPA decode, q_len 1, GQA by enable_gqa=True (torch >= 2.5) else repeat_interleave
          (attend/split_* + reduce).
  score   H2O only: SDPA does not return probabilities, so an explicit q @ K^T, softmax (f32) summed
          over the query heads of each KV head, added to the accumulated mass [B, Hkv, T]
          (attend/mass, the attention-mass pass).
  evict   H2O only: torch.topk(largest=False) over the unprotected tokens (4 sinks and the last 32
          protected) picks the victim of every (sequence, KV head); a torch.gather compacts K/V (or
          codes and value scales), mass and metadata into the other buffer of a ping-pong pair, so
          the kept tokens stay contiguous and in order (evict/score, select, compact, move).
          With int8 the compaction shifts tokens across key groups, so K is gathered in f16 (the
          codec stage's dequantised copy) and re-quantised per channel: a full re-encode per step.
          (expertkv itself runs codecs with the full cache only, so int8 + H2O has no expertkv
          counterpart yet.)
Not mirrored: expertkv's page-list gather (a dense cache needs none) and miss recount (miss_e is a
fixed random tensor here).

Steady state: the cache holds T = budget * context kept tokens (rounded down to a multiple of
--page-size) of random K/V, i.e. what H2O kept; every step appends 1 token at slot T, attention
reads T + 1 tokens, and H2O evicts 1 per (sequence, KV head), back to T. The slot is the same every
rep so shapes stay constant (the written position still advances). --budget 1.0: full cache
(T = context), no score or evict stage. Capacity: T + one page (the newest key group always fits).

Timed: only the stages above, eager PyTorch, no torch.compile, no CUDA graphs. Two passes of --reps
steps after --warmup steps (and one untimed first step that runs the checks): one with an event
between stages (stages_ms, medians), one with events around the whole step only (step_ms, median);
wall_ms_per_step is host wall time of the second pass per step. By default each rep synchronises
after its end event (outside the timed window), so every step starts on an idle GPU and host
launch gaps count, as in one eager decode step (route and append are launch-bound: ~0.1-0.2 ms
with syncs, ~0.03 ms with --no-sync, which queues reps back to back).
Checks (untimed, in the JSON): attn_rel_err (SDPA against f32 attention with the score stage's
head grouping, sequence 0), codec_rel_err (int8 round trip of the initial cache), compaction_ok.
Not timed: producing q / new K,V / router logits (projections, router GEMM), RoPE, the expert
FFNs, sampling, setup and the checks. K/V are f16. Prints one JSON object per configuration
(--codec and --budget take comma lists; --sweep-shapes runs E=8 k=2 and E=256 k=8), then a table
unless --json.
"""

import argparse
import gc
import json
import statistics
import sys
import time

SINKS, RECENT = 4, 32
STAGES = ("route", "append", "codec", "attend", "score", "evict")


def run_config(torch, F, a, gqa, mixed_addcmul, E, K, codec, budget):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(7)
    B, Hq, H, d, P = a.batch, a.q_heads, a.kv_heads, a.head_dim, a.page_size
    rep, f16, i32, u8 = Hq // H, torch.float16, torch.int32, torch.uint8
    evicting = budget < 1.0
    T = (int(budget * a.context) if evicting else a.context) // P * P
    if T < SINKS + RECENT + 2 * P:
        raise ValueError(f"kept tokens {T} too few (need >= {SINKS + RECENT + 2 * P})")
    n, cap, gi = T + 1, T + P, T // P  # tokens read per step; capacity; newest key group
    scale = d ** -0.5

    def rnd(*shape, dtype=f16):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=g)

    def zeros(*shape, dtype=f16):
        return torch.zeros(*shape, device=dev, dtype=dtype)

    # Step inputs (outputs of the projections and the router GEMM; not timed).
    q, k_new, v_new = rnd(B, Hq, 1, d), rnd(B, H, d), rnd(B, H, d)
    logits = rnd(B, E, dtype=torch.float32)
    miss = torch.rand(E, device=dev, generator=g)
    load, cnt = torch.full((E,), 1.0 / E, device=dev), zeros(E, dtype=torch.float32)
    ones = torch.ones(B * K, device=dev)
    seq_pos = torch.full((B,), a.context, device=dev, dtype=i32)

    def new_set():
        s = {"pos": zeros(B, H, cap, dtype=i32), "exp": zeros(B, H, cap, dtype=i32)}
        if evicting:
            s["mass"] = zeros(B, H, cap, dtype=torch.float32)
        if codec == "none":
            s["k"], s["v"] = zeros(B, H, cap, d), zeros(B, H, cap, d)
        else:
            s["kq"], s["vq"] = zeros(B, H, cap, d, dtype=u8), zeros(B, H, cap, d, dtype=u8)
            s["kmin"], s["kscale"] = zeros(B, H, cap // P, d), zeros(B, H, cap // P, d)
            s["vmin"], s["vscale"] = zeros(B, H, cap, 1), zeros(B, H, cap, 1)
        return s

    bufs = [new_set()] + ([new_set()] if evicting else [])  # [current, next] (ping-pong)
    c0 = bufs[0]
    c0["pos"][:, :, :T] = torch.arange(T, device=dev, dtype=i32)
    c0["exp"][:, :, :T] = torch.randint(0, E, (B, H, T), device=dev, dtype=i32, generator=g)
    if evicting:
        c0["mass"][:, :, :T] = torch.rand(B, H, T, device=dev, generator=g)

    def q5(t):  # [B, H, cap, d] as key groups [B, H, cap / P, P, d]
        return t.view(B, H, cap // P, P, d)

    def quant(x, dim, codes, mn_out, sc_out):  # asymmetric 8-bit over `dim`, min/scale in f16
        mn, mx = torch.aminmax(x, dim=dim, keepdim=True)
        sc = ((mx - mn) * (1.0 / 255)).clamp_min_(1e-3)
        inv = sc.reciprocal()
        codes.copy_(torch.addcmul(-mn * inv, x, inv).round_().clamp_(0, 255))
        mn_out.copy_(mn)
        sc_out.copy_(sc)

    def dequant(codes, sc, mn, out):  # out = mn + codes * sc, one kernel where addcmul promotes u8
        if mixed_addcmul:
            torch.addcmul(mn, codes, sc, out=out)
        else:
            torch.mul(codes, sc, out=out)
            out.add_(mn)

    def rel(x, r):
        return ((x.float() - r.float()).norm() / r.float().norm()).item()

    checks = {}
    if codec == "none":
        c0["k"][:, :, :T].normal_(generator=g)
        c0["v"][:, :, :T].normal_(generator=g)
    else:
        kbuf, vbuf = zeros(B, H, cap, d), zeros(B, H, cap, d)  # f16 copies SDPA reads
        kbuf5, krec, vstage = q5(kbuf), rnd(B, H, P, d), zeros(B, H, 1, d)
        kc = zeros(B, H, T, d) if evicting else None  # compacted f16 keys before re-encoding
        kbuf[:, :, :T].normal_(generator=g)
        vbuf[:, :, :T].normal_(generator=g)
        quant(kbuf5[:, :, :gi], 3, q5(c0["kq"])[:, :, :gi], c0["kmin"][:, :, :gi].unsqueeze(3),
              c0["kscale"][:, :, :gi].unsqueeze(3))
        quant(vbuf[:, :, :T], -1, c0["vq"][:, :, :T], c0["vmin"][:, :, :T], c0["vscale"][:, :, :T])
        kd = q5(c0["kq"])[:1, :, :gi].half() * c0["kscale"][:1, :, :gi].unsqueeze(3)
        kd += c0["kmin"][:1, :, :gi].unsqueeze(3)
        vd = c0["vq"][:1, :, :T].half() * c0["vscale"][:1, :, :T] + c0["vmin"][:1, :, :T]
        checks["codec_rel_err"] = max(rel(kd, kbuf5[:1, :, :gi]), rel(vd, vbuf[:1, :, :T]))
        del kd, vd

    st = {}
    ar_T = torch.arange(T, device=dev)
    nv = n - T  # victims per (sequence, KV head) per step: 1 at steady state
    vic_off = SINKS - torch.arange(nv, device=dev)

    def route():
        score = torch.add(logits, torch.log1p(miss), alpha=-a.lam)
        idx = torch.topk(score, K, dim=-1).indices
        st["gates"] = torch.softmax(logits.gather(1, idx), dim=-1)
        cnt.zero_()
        cnt.scatter_add_(0, idx.view(-1), ones)  # not bincount: it syncs on CUDA
        load.mul_(0.9).add_(cnt, alpha=0.1 / (B * K))
        st["top1"] = idx[:, 0]

    def append():
        c = bufs[0]
        if codec == "none":
            c["k"][:, :, T].copy_(k_new)
            c["v"][:, :, T].copy_(v_new)
        else:
            krec[:, :, T % P].copy_(k_new)
            vstage[:, :, 0].copy_(v_new)
        c["pos"][:, :, T].copy_(seq_pos.unsqueeze(1).expand(B, H))
        c["exp"][:, :, T].copy_(st["top1"].unsqueeze(1).expand(B, H))
        if evicting:
            c["mass"][:, :, T].zero_()
        seq_pos.add_(1)

    def codec_stage():
        c = bufs[0]
        quant(vstage, -1, c["vq"][:, :, T:n], c["vmin"][:, :, T:n], c["vscale"][:, :, T:n])
        quant(krec, 2, c["kq"][:, :, T:T + P], c["kmin"][:, :, gi:gi + 1], c["kscale"][:, :, gi:gi + 1])
        dequant(q5(c["kq"])[:, :, :gi + 1], c["kscale"][:, :, :gi + 1].unsqueeze(3),
                c["kmin"][:, :, :gi + 1].unsqueeze(3), kbuf5[:, :, :gi + 1])
        dequant(c["vq"][:, :, :n], c["vscale"][:, :, :n], c["vmin"][:, :, :n], vbuf[:, :, :n])

    def kv():  # the f16 K/V [B, Hkv, n, d] the step reads
        if codec == "none":
            return bufs[0]["k"][:, :, :n], bufs[0]["v"][:, :, :n]
        return kbuf[:, :, :n], vbuf[:, :, :n]

    def attend():
        k, v = kv()
        if gqa:
            st["out"] = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        else:
            st["out"] = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))

    def score():
        k, _ = kv()
        s = torch.matmul(q.view(B, H, rep, d) * scale, k.transpose(-1, -2))  # [B, Hkv, rep, n]
        bufs[0]["mass"][:, :, :n].add_(torch.softmax(s, dim=-1, dtype=torch.float32).sum(2))

    def evict():
        c, o = bufs
        vic = torch.topk(c["mass"][:, :, SINKS:n - RECENT], nv, dim=-1, largest=False, sorted=False).indices
        # The j-th kept token is slot j + #{victims v_i (sorted, i-th) with v_i - i <= j}.
        thr = (vic.sort(dim=-1).values if nv > 1 else vic) + vic_off
        keep = ar_T + (thr.unsqueeze(-2) <= ar_T.view(T, 1)).sum(-1)  # [B, Hkv, T], increasing
        st["keep"] = keep
        k1 = keep.unsqueeze(-1)
        k4 = k1.expand(B, H, T, d)
        for name in ("mass", "pos", "exp"):
            torch.gather(c[name][:, :, :n], 2, keep, out=o[name][:, :, :T])
        if codec == "none":
            for name in ("k", "v"):
                torch.gather(c[name][:, :, :n], 2, k4, out=o[name][:, :, :T])
        else:
            torch.gather(c["vq"][:, :, :n], 2, k4, out=o["vq"][:, :, :T])
            for name in ("vmin", "vscale"):
                torch.gather(c[name][:, :, :n], 2, k1, out=o[name][:, :, :T])
            torch.gather(kbuf[:, :, :n], 2, k4, out=kc)
            quant(kc.view(B, H, gi, P, d), 3, q5(o["kq"])[:, :, :gi], o["kmin"][:, :, :gi].unsqueeze(3),
                  o["kscale"][:, :, :gi].unsqueeze(3))
        bufs.reverse()

    active = [("route", route), ("append", append)]
    if codec == "int8":
        active.append(("codec", codec_stage))
    active.append(("attend", attend))
    if evicting:
        active += [("score", score), ("evict", evict)]

    # First step, untimed, with checks: SDPA against an f32 attention on sequence 0 (same GQA
    # grouping as the score stage), and that compaction kept sinks, recent window and order.
    for name, f in active:
        f()
        if name == "attend":
            k, v = kv()
            w = torch.softmax(q[:1].view(1, H, rep, d).float() @ k[:1].float().transpose(-1, -2) * scale, dim=-1)
            checks["attn_rel_err"] = rel(st["out"][:1].reshape(1, H, rep, d), w @ v[:1].float())
            del k, v, w
    if evicting:
        kp = st["keep"]
        ok = (kp[..., 1:] > kp[..., :-1]).all() & (kp[..., :SINKS] == ar_T[:SINKS]).all()
        checks["compaction_ok"] = bool((ok & (kp[..., -RECENT:] == ar_T[-RECENT:] + 1).all()).item())

    for _ in range(a.warmup):
        for _, f in active:
            f()
    torch.cuda.synchronize()

    def event():
        return torch.cuda.Event(enable_timing=True)

    rows = []
    for _ in range(a.reps):
        ev = [event() for _ in range(len(active) + 1)]
        ev[0].record()
        for i, (_, f) in enumerate(active):
            f()
            ev[i + 1].record()
        if not a.no_sync:
            ev[-1].synchronize()
        rows.append(ev)
    torch.cuda.synchronize()
    stage = {name: statistics.median([r[i].elapsed_time(r[i + 1]) for r in rows]) for i, (name, _) in enumerate(active)}

    pairs = []
    t0 = time.perf_counter()
    for _ in range(a.reps):
        s, e = event(), event()
        s.record()
        for _, f in active:
            f()
        e.record()
        if not a.no_sync:
            e.synchronize()
        pairs.append((s, e))
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / a.reps
    step = statistics.median([s.elapsed_time(e) for s, e in pairs])

    return {"kernel": "torch_pikv_step", "batch": B, "q_heads": Hq, "kv_heads": H, "head_dim": d,
            "context": a.context, "kept_tokens": T, "read_tokens": n, "experts": E, "top_k": K,
            "codec": codec, "budget": budget, "page_size": P, "lam": a.lam,
            "stages_ms": {s: stage.get(s) for s in STAGES}, "stages_sum_ms": sum(stage.values()),
            "step_ms": step, "wall_ms_per_step": wall, "sync_each": not a.no_sync,
            "gqa": "enable_gqa" if gqa else "repeat_interleave", "reps": a.reps, "warmup": a.warmup,
            **checks, "device": torch.cuda.get_device_name(0), "torch": torch.__version__}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--budget", default="0.25", help="share(s) of the context H2O keeps, comma list; 1.0: full cache")
    ap.add_argument("--codec", default="none", help="int8 and/or none, comma list")
    ap.add_argument("--page-size", type=int, default=16, help="key quantisation group G (tokens)")
    ap.add_argument("--lam", type=float, default=1.0, help="cache-aware router strength lambda")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--sweep-shapes", action="store_true", help="run E=8 k=2 and E=256 k=8")
    ap.add_argument("--no-sync", action="store_true", help="queue reps back to back (no sync after each)")
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
    try:
        codecs = [c.strip() for c in a.codec.split(",") if c.strip()]
        budgets = [float(b) for b in a.budget.split(",") if b.strip()]
    except ValueError:
        print(f"error: --budget takes numbers in (0, 1]: {a.budget}", file=sys.stderr)
        return 2
    if not codecs or any(c not in ("int8", "none") for c in codecs):
        print(f"error: --codec takes int8 and/or none: {a.codec}", file=sys.stderr)
        return 2
    if not budgets or any(not 0.0 < b <= 1.0 for b in budgets):
        print(f"error: --budget takes numbers in (0, 1]: {a.budget}", file=sys.stderr)
        return 2
    shapes = [(8, 2), (256, 8)] if a.sweep_shapes else [(a.experts, a.top_k)]
    if any(k < 1 or k > e for e, k in shapes) or a.reps < 1 or a.warmup < 0 or a.page_size < 1:
        print("error: need 1 <= --top-k <= --experts, --reps >= 1, --warmup >= 0, --page-size >= 1", file=sys.stderr)
        return 2

    with torch.inference_mode():
        try:  # enable_gqa exists from torch 2.5
            z = torch.zeros(1, 2, 1, 8, device="cuda", dtype=torch.float16)
            F.scaled_dot_product_attention(z, z[:, :1], z[:, :1], enable_gqa=True)
            gqa = True
        except (TypeError, RuntimeError):
            gqa = False
        try:  # the fastest dequant measured on an H200 (torch 2.11): addcmul reading u8 codes
            torch.addcmul(z, z.to(torch.uint8), z, out=torch.empty_like(z))
            mixed_addcmul = True
        except RuntimeError:
            mixed_addcmul = False
        results = []
        for e, k in shapes:
            for codec in codecs:
                for budget in budgets:
                    try:
                        r = run_config(torch, F, a, gqa, mixed_addcmul, e, k, codec, budget)
                    except ValueError as err:
                        print(f"error: {err}", file=sys.stderr)
                        return 2
                    results.append(r)
                    print(json.dumps(r), flush=True)
                    gc.collect()
                    torch.cuda.empty_cache()

    if not a.json:
        r0 = results[0]
        print(f"\nms per decode step, median of {a.reps} reps; b{a.batch} hq{a.q_heads} hkv{a.kv_heads} "
              f"d{a.head_dim} ctx{a.context} f16, {r0['device']}, torch {r0['torch']}, {r0['gqa']}")
        cols = ("E/k", "codec", "budget", "kept") + STAGES + ("sum", "step", "wall")
        print(" ".join(f"{c:>8}" for c in cols))
        for r in results:
            cells = [f"{r['experts']}/{r['top_k']}", r["codec"], f"{r['budget']:g}", str(r["kept_tokens"])]
            cells += ["-" if r["stages_ms"][s] is None else f"{r['stages_ms'][s]:.3f}" for s in STAGES]
            cells += [f"{r['stages_sum_ms']:.3f}", f"{r['step_ms']:.3f}", f"{r['wall_ms_per_step']:.3f}"]
            print(" ".join(f"{c:>8}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
