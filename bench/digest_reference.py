#!/usr/bin/env python3
"""An independent numpy reference of the recall tier's page choice on a real model: do one-bit key
digests find the pages a query needs, as the true q.k does?

Inputs: the GGUF (SmolLM2-135M by default) and the retrieval cases `expertkv eval --write-cases`
writes (the same token ids `eval` feeds). For each case whose first turn asks (a fact at a depth,
the first question of the several-fact case), the prompt runs through the model with full
attention (numpy, f32, weights dequantised as bench/torch_model.py reads them); then the answer
is decoded greedily, each answer token's attention at every layer restricted to:

- `resident`: the sinks (4) and the most recent tokens of the budget, the answer's own tokens;
- `+true`: those and, per (layer, KV head), the R tier pages (16 tokens, in position order) whose
  best true score (max over the group's query heads of q.k) is highest;
- `+recall`: those and the R pages attend/recall.wgsl chooses: the key digests nominate the C
  pages (--candidates) with the best digest scores (a key's bit i is k_i >= centre_i, the centre
  and spread, the mean absolute deviation, calibrated on the tier's first 64 tokens; a token's
  score q.centre + sum_i q_i spread_i (+1 or -1 by bit i), a page's its best token's over the
  group), and the nominees' true scores choose R;
- `+digest=KIND`: the digests alone choosing, to compare designs (see `Digest`);
- `full`: every token.

The tier is every prompt token not resident. The prompt's own K/V come from the full-attention
pass (as if compressed after a full prefill), so this measures the choice, not H2O's dynamics.
Reported per case and budget: whether each variant's answer holds the number, and how many of
the true best pages the choosing variants chose (the share of the true top R, and of the true
best page) over every answer token, layer and KV head.

Usage: expertkv eval --needle-filler 2000 --needle-depth 10%,50%,90% --needles 3 \
           --write-cases /tmp/cases.json
       python3 bench/digest_reference.py --cases /tmp/cases.json [--budgets 128,32 --pages 4]
Needs numpy (pip install numpy).
"""

import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_model import dequant, read_gguf  # noqa: E402

PAGE = 16
SINKS = 4
CALIB = 64


class Model:
    def __init__(self, path):
        meta, tensors = read_gguf(path)
        arch = meta["general.architecture"]
        if arch != "llama":
            raise SystemExit(f"architecture `{arch}`: this reference runs llama (SmolLM2)")
        k = lambda key, default=None: meta.get(f"{arch}.{key}", default)
        self.hidden, self.heads = k("embedding_length"), k("attention.head_count")
        self.kv_heads = k("attention.head_count_kv", self.heads)
        self.d = k("attention.key_length", self.hidden // self.heads)
        self.layers, self.eps = k("block_count"), k("attention.layer_norm_rms_epsilon")
        self.base = k("rope.freq_base", 10000.0)
        self.tokens = meta.get("tokenizer.ggml.tokens")

        def w(name):
            dims, t, raw = tensors[name]
            return dequant(np, dims, t, raw, name).astype(np.float32)

        self.embed = w("token_embd.weight")
        self.head = w("output.weight") if "output.weight" in tensors else self.embed
        self.out_norm = w("output_norm.weight")
        self.blocks = []
        for l in range(self.layers):
            n = lambda s: f"blk.{l}.{s}"
            self.blocks.append(
                {
                    "attn_norm": w(n("attn_norm.weight")),
                    "qkv": np.concatenate([w(n("attn_q.weight")), w(n("attn_k.weight")), w(n("attn_v.weight"))]).T.copy(),
                    "wo": w(n("attn_output.weight")).T.copy(),
                    "ffn_norm": w(n("ffn_norm.weight")),
                    "gate_up": np.concatenate([w(n("ffn_gate.weight")), w(n("ffn_up.weight"))]).T.copy(),
                    "down": w(n("ffn_down.weight")).T.copy(),
                }
            )
        self.ffn = self.blocks[0]["down"].shape[0]
        self.inv_freq = self.base ** (-2.0 * np.arange(self.d // 2, dtype=np.float64) / self.d)

    def rms(self, x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * g

    def rope(self, x, pos):
        """x: [T, H, D] (llama's interleaved pairs)."""
        ang = pos[:, None].astype(np.float64) * self.inv_freq  # [T, D/2]
        c, s = np.cos(ang)[:, None, :].astype(np.float32), np.sin(ang)[:, None, :].astype(np.float32)
        a, b = x[..., 0::2], x[..., 1::2]
        return np.stack([a * c - b * s, a * s + b * c], -1).reshape(x.shape)

    def qkv(self, l, x, pos):
        b = self.blocks[l]
        h = self.rms(x, b["attn_norm"]) @ b["qkv"]
        hq, hk, d = self.heads, self.kv_heads, self.d
        q, k, v = np.split(h, [hq * d, hq * d + hk * d], -1)
        q = self.rope(q.reshape(-1, hq, d), pos)
        k = self.rope(k.reshape(-1, hk, d), pos)
        return q, k, v.reshape(-1, hk, d)

    def finish(self, l, x, att):
        b = self.blocks[l]
        x = x + att.reshape(x.shape[0], -1) @ b["wo"]
        g, u = np.split(self.rms(x, b["ffn_norm"]) @ b["gate_up"], [self.ffn], -1)
        return x + (g / (1.0 + np.exp(-g)) * u) @ b["down"]

    def prompt(self, ids):
        """Full causal attention over the prompt: every layer's K and V [T, Hk, D]."""
        T = len(ids)
        pos = np.arange(T)
        x = self.embed[ids]
        ks, vs = [], []
        group = self.heads // self.kv_heads
        mask = np.triu(np.full((T, T), -np.inf, np.float32), 1)
        for l in range(self.layers):
            q, k, v = self.qkv(l, x, pos)
            ks.append(k)
            vs.append(v)
            att = np.empty_like(q)
            for h in range(self.heads):
                s = q[:, h] @ k[:, h // group].T / math.sqrt(self.d) + mask
                s = np.exp(s - s.max(-1, keepdims=True))
                att[:, h] = (s / s.sum(-1, keepdims=True)) @ v[:, h // group]
            x = self.finish(l, x, att)
        return ks, vs

    def logits(self, x):
        return self.rms(x, self.out_norm) @ self.head.T

    def text(self, ids):
        return "".join(self.tokens[i] for i in ids).replace("\u0120", " ").replace("\u010a", "\n")


class Digest:
    """One (layer, KV head)'s digests of the tier keys `k` [n, D], as `kind` says:
    `1bit` (attend/recall.wgsl's: centre and spread from the first CALIB tokens), `1bit-all`
    (calibrated on every tier token), `int4` (a scale a token, round to nearest), each scoring
    tokens for the page choice; `two-stage:C` takes the 1bit digests' best C pages and chooses
    among them by the true scores (the keys of C pages read from the tier)."""

    def __init__(self, k, kind):
        self.kind, self.k = kind, k
        cal = k if kind == "1bit-all" else k[:CALIB]
        self.centre = cal.mean(0)
        self.spread = np.abs(cal - self.centre).mean(0)
        self.bits = k >= self.centre
        if kind == "int4":
            sc = np.abs(k).max(1, keepdims=True) / 7
            self.kh = np.round(k / sc) * sc
        if kind.startswith("bound"):
            # Per page and dimension, the keys' max rounded up and min rounded down to B bits
            # on the list's calibrated grid (centre +- 3 spreads, clamped to its ends).
            b = int(kind.split(":")[-1])
            n_pages = (len(k) + PAGE - 1) // PAGE
            pad = np.full((n_pages * PAGE, k.shape[1]), np.nan, np.float32)
            pad[: len(k)] = k
            pages = pad.reshape(n_pages, PAGE, -1)
            hi, lo = np.nanmax(pages, 1), np.nanmin(pages, 1)
            base, step = self.centre - 3 * self.spread, 6 * self.spread / (2**b - 1)
            top_lv = 2**b - 1
            self.hi = base + np.clip(np.ceil((hi - base) / step), 0, top_lv) * step
            self.lo = base + np.clip(np.floor((lo - base) / step), 0, top_lv) * step

    def scores(self, q):
        """q [G, D] -> [n], the best over the group."""
        if self.kind == "int4":
            return (self.kh @ q.T).max(1)
        signed = np.where(self.bits[None], self.spread, -self.spread)  # [1, n, D]
        return ((self.centre[None, None] + signed) * q[:, None, :]).sum(-1).max(0)

    def page_scores(self, q, n_pages):
        """q [G, D] -> [n_pages]: a bound kind's page upper bound (best over the group), else
        the page's best token score."""
        if self.kind.startswith("bound"):
            return np.maximum(q[:, None, :] * self.hi[None], q[:, None, :] * self.lo[None]).sum(-1).max(0)
        return page_best(self.scores(q), n_pages)

    def choose(self, q, n_pages, pages):
        est = self.page_scores(q, n_pages)
        if not (self.kind.startswith("two-stage:") or self.kind.startswith("bound-two:")):
            return top(est, pages)
        cand = top(est, int(self.kind.split(":")[1]))
        true = page_best((q @ self.k.T).max(0), n_pages)
        return sorted(cand, key=lambda p: (-true[p], p))[:pages]


def page_best(scores, n_pages):
    out = np.full(n_pages, -np.inf)
    np.maximum.at(out, np.arange(len(scores)) // PAGE, scores)
    return out


def top(scores, r):
    order = sorted(range(len(scores)), key=lambda p: (-scores[p], p))
    return order[:r]


def answer(m, ks, vs, first, feed_len, generate, budget, pages, candidates, variant, stats):
    """Greedy answer tokens after the prompt, attention restricted as `variant` says."""
    group = m.heads // m.kv_heads
    recent = budget - SINKS
    tier = np.arange(SINKS, max(SINKS, feed_len - recent))  # positions in the tier
    n_pages = (len(tier) + PAGE - 1) // PAGE
    kind = variant.split("=", 1)[1] if variant.startswith("+digest=") else f"two-stage:{candidates}"
    chooses = variant == "+recall" or variant.startswith("+digest")
    digests = [[Digest(ks[l][tier, h], kind) for h in range(m.kv_heads)] for l in range(m.layers)] if chooses else None
    ks = [k.copy() for k in ks]
    vs = [v.copy() for v in vs]
    tok, out = first, []
    for step in range(generate):
        p = feed_len + step
        x = m.embed[[tok]]
        for l in range(m.layers):
            q, k, v = m.qkv(l, x, np.array([p]))
            ks[l] = np.concatenate([ks[l], k])
            vs[l] = np.concatenate([vs[l], v])
            att = np.empty_like(q)
            for h in range(m.kv_heads):
                if variant == "full":
                    keep = np.arange(p + 1)
                else:
                    keep = list(range(min(SINKS, p + 1))) + list(range(max(SINKS, feed_len - recent), p + 1))
                    if (variant == "+true" or chooses) and n_pages:
                        qg = q[0, h * group : (h + 1) * group]
                        true = page_best((qg @ ks[l][tier, h].T).max(0), n_pages)
                        want = top(true, pages)
                        if variant == "+true":
                            chosen = want
                        else:
                            chosen = digests[l][h].choose(qg, n_pages, pages)
                            stats["want"] += len(want)
                            stats["hits"] += len(set(want) & set(chosen))
                            stats["passes"] += 1
                            stats["top"] += int(want[0] in chosen)
                        keep += [int(tier[j]) for c in chosen for j in range(c * PAGE, min((c + 1) * PAGE, len(tier)))]
                    keep = np.array(sorted(set(keep)))
                kk, vv = ks[l][keep, h], vs[l][keep, h]
                for g in range(group):
                    s = kk @ q[0, h * group + g] / math.sqrt(m.d)
                    s = np.exp(s - s.max())
                    att[0, h * group + g] = (s / s.sum()) @ vv
            x = m.finish(l, x, att)
        out.append(tok)
        tok = int(np.argmax(m.logits(x)[0]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--cases", required=True, help="expertkv eval --write-cases FILE")
    ap.add_argument("--budgets", default="128,32", help="resident tokens a (layer, KV head), comma-separated")
    ap.add_argument("--pages", type=int, default=4, help="tier pages recalled a (layer, KV head)")
    ap.add_argument("--candidates", type=int, default=32, help="pages the digests nominate (+recall)")
    ap.add_argument(
        "--variants",
        default="resident,+true,+recall,+digest=1bit,full",
        help="resident, +true, +recall, +digest=KIND (1bit, 1bit-all, int4, two-stage:C, bound:B, bound-two:C:B), full",
    )
    a = ap.parse_args()
    m = Model(a.model)
    doc = json.load(open(a.cases))
    budgets = [int(b) for b in a.budgets.split(",")]
    variants = a.variants.split(",")
    print(f"| case | budget | {' | '.join(variants)} | true best pages chosen (best {a.pages} / best 1) |")
    print("|---|---|" + "---|" * len(variants) + "---|")
    for case in doc["cases"]:
        turn = case["turns"][0]
        if not turn.get("expect"):
            continue  # the two-turn case asks only in its second turn
        feed = turn["feed"]
        ks, vs = m.prompt(feed[:-1])
        last = feed[-1]
        for budget in budgets:
            cells, stats = [], {"want": 0, "hits": 0, "passes": 0, "top": 0}
            # (the recall column sums over every choosing variant: +recall and +digest=KIND)
            for variant in variants:
                # The prompt's last token is decoded under the variant too (its query is the
                # first to ask), then the answer.
                ids = answer(m, ks, vs, last, len(feed) - 1, turn["generate"] + 1, budget, a.pages, a.candidates, variant, stats)[1:]
                said = m.text(ids)
                cells.append(("found" if turn["expect"] in said else "MISSED") + f" {said.strip()!r}")
            rec = f"{100 * stats['hits'] / max(1, stats['want']):.1f}% / {100 * stats['top'] / max(1, stats['passes']):.1f}%"
            print(f"| {case['name']} | {budget} + {a.pages} pages | {' | '.join(cells)} | {rec} |", flush=True)


if __name__ == "__main__":
    main()
