#!/usr/bin/env python3
"""`expertkv eval` with H2O and the recall tier, written again in numpy: an independent reference
of what the GPU eval measures, token by token, for SmolLM2-135M on this machine's CPU.

Every configuration is fed the same tokens one at a time, as `eval` feeds the GPU model (so the
scheduler acts while the prompt goes in): the scored text (perplexity and greedy agreement with
the full cache) and every retrieval case `expertkv eval --write-cases` wrote (a case is found when
every asked answer holds its number). Per (layer, KV head) list, as core's H2O does: after each
token, the list keeps its `budget` tokens, the 4 sinks and the most recent half of the budget
protected, the rest by attention mass accumulated over the group's query heads (resident tokens'
shares of the whole softmax); a victim goes to the list's tier (capture order). With `+recallR`,
each layer's attention also takes R tier pages of 16 (capture order), chosen as
`attend/recall.wgsl` chooses: one-bit key digests (centre and spread calibrated once, on the tier's
tokens when it first holds 64) nominate the 32 best pages, their true q.k choose R.

Configurations (--configs): `full`, `h2o@B` and `h2o@B+recallR` (`h2o@B+recallR/C`: C pages
nominated, 1024 for every tier page, the true scores alone; `h2o@B+recallR/C:bound`: nominated by
each page's exact per-dimension key bounds, Quest's, instead of the one-bit digests; `:union`:
half the candidates by the bounds, the rest by the digests); `eval --bytes 10%` of a 2,048-token
context is h2o@192 alone and h2o@128+recall4 with the digests' bytes taken out, 5% h2o@96 and
h2o@32+recall4.

Usage: expertkv eval --needle-filler 2000 --needle-depth 10%,50%,90% --needles 3 --two-turns true \
           --text bench/data/harbour_town.txt --tokens 2048 --write-cases /tmp/cases.json
       python3 bench/eval_reference.py --cases /tmp/cases.json
Needs numpy. The configurations run side by side (one matrix product per layer for all of them).
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digest_reference import Model  # noqa: E402

PAGE, SINKS, CALIB, CANDIDATES = 16, 4, 64, 32


class List:
    """One (layer, KV head) list of one configuration: resident tokens and the tier, in arrays
    grown by doubling."""

    def __init__(self, d):
        self.d = d
        self.n, self.k, self.v = 0, np.zeros((64, d), np.float32), np.zeros((64, d), np.float32)
        self.pos, self.mass = np.zeros(64, np.int64), np.zeros(64, np.float64)
        self.tn, self.tk, self.tv = 0, np.zeros((64, d), np.float32), np.zeros((64, d), np.float32)
        self.signs = np.zeros((64, d), np.float32)  # +1 / -1 per digest bit
        self.centre, self.spread = np.zeros(d, np.float32), np.ones(d, np.float32)
        self.calibrated = False

    @staticmethod
    def grow(a, n):
        if n <= len(a):
            return a
        out = np.zeros((max(n, 2 * len(a)),) + a.shape[1:], a.dtype)
        out[: len(a)] = a
        return out

    def append(self, k, v, p):
        n = self.n + 1
        self.k, self.v = self.grow(self.k, n), self.grow(self.v, n)
        self.pos, self.mass = self.grow(self.pos, n), self.grow(self.mass, n)
        self.k[self.n], self.v[self.n], self.pos[self.n], self.mass[self.n] = k, v, p, 0.0
        self.n = n

    def capture(self, idx):
        m = self.tn + len(idx)
        self.tk, self.tv, self.signs = self.grow(self.tk, m), self.grow(self.tv, m), self.grow(self.signs, m)
        self.tk[self.tn : m], self.tv[self.tn : m] = self.k[idx], self.v[idx]
        if not self.calibrated and m >= CALIB:
            self.centre = self.tk[:m].mean(0)
            self.spread = np.abs(self.tk[:m] - self.centre).mean(0)
            self.calibrated = True
            self.signs[:m] = np.where(self.tk[:m] >= self.centre, 1.0, -1.0)
        else:
            self.signs[self.tn : m] = np.where(self.k[idx] >= self.centre, 1.0, -1.0)
        self.tn = m
        keep = np.ones(self.n, bool)
        keep[idx] = False
        r = int(keep.sum())
        self.k[:r], self.v[:r] = self.k[: self.n][keep], self.v[: self.n][keep]
        self.pos[:r], self.mass[:r] = self.pos[: self.n][keep], self.mass[: self.n][keep]
        self.n = r

    def recalled(self, q, pages, candidates=CANDIDATES, nominate="1bit"):
        """Tier rows of the pages chosen for the group's queries q [G, D]; `nominate`: the
        one-bit digests (`1bit`) or each page's exact key bounds (`bound`, Quest's upper bound
        of q.k from the per-dimension max and min)."""
        n = self.tn
        if n == 0 or pages == 0:
            return np.zeros(0, np.int64)
        n_pages = (n + PAGE - 1) // PAGE
        def by_bound():
            pad = np.full((n_pages * PAGE, self.d), np.nan, np.float32)
            pad[:n] = self.tk[:n]
            pg = pad.reshape(n_pages, PAGE, self.d)
            hi, lo = np.nanmax(pg, 1), np.nanmin(pg, 1)
            return np.maximum(q[:, None, :] * hi[None], q[:, None, :] * lo[None]).sum(-1).max(0)

        def by_digest():
            est = ((q @ self.centre)[None, :] + self.signs[:n] @ (q * self.spread).T).max(1)
            pad = np.full(n_pages * PAGE, -np.inf)
            pad[:n] = est
            return pad.reshape(n_pages, PAGE).max(1)

        def top(best, k):
            return np.lexsort((np.arange(n_pages), -best))[:k]

        if nominate == "bound":
            cand = top(by_bound(), candidates)
        elif nominate == "union":
            # Half the candidates by each, the bounds' first, then the digests' best not taken.
            a = list(top(by_bound(), (candidates + 1) // 2))
            b = [p for p in top(by_digest(), candidates) if p not in set(a)]
            cand = np.array(a + b[: candidates - len(a)], np.int64)
        else:
            cand = top(by_digest(), candidates)
        rows = np.concatenate([np.arange(c * PAGE, min((c + 1) * PAGE, n)) for c in cand])
        true = (self.tk[rows] @ q.T).max(1)
        page_true = {}
        for r, s in zip(rows, true):
            page_true[r // PAGE] = max(page_true.get(r // PAGE, -np.inf), s)
        chosen = sorted(page_true, key=lambda p: (-page_true[p], p))[:pages]
        return np.concatenate([np.arange(c * PAGE, min((c + 1) * PAGE, n)) for c in chosen])


class Config:
    def __init__(self, spec, m):
        self.name = spec
        self.budget, self.pages, self.candidates, self.nominate = None, 0, CANDIDATES, "1bit"
        if spec != "full":
            body = spec.split("@", 1)[1]
            b, _, r = body.partition("+recall")
            r, _, c = r.partition("/")
            c, _, self.nominate = c.partition(":")
            self.nominate = self.nominate or "1bit"
            self.budget, self.pages = int(b), int(r or 0)
            self.candidates = int(c) if c else CANDIDATES
        self.lists = [[List(m.d) for _ in range(m.kv_heads)] for _ in range(m.layers)]


def step(m, configs, tok, p):
    """Feed token `tok` at position `p` to every configuration; their logits [C, V]."""
    group = m.heads // m.kv_heads
    x = np.repeat(m.embed[[tok]], len(configs), 0)
    pos = np.full(len(configs), p)
    scale = 1.0 / math.sqrt(m.d)
    for l in range(m.layers):
        q, k, v = m.qkv(l, x, pos)  # [C, H, D]
        att = np.empty_like(q)
        for ci, c in enumerate(configs):
            for h in range(m.kv_heads):
                L = c.lists[l][h]
                L.append(k[ci, h], v[ci, h], p)
                qg = q[ci, h * group : (h + 1) * group]
                rows = L.recalled(qg, c.pages, c.candidates, c.nominate)
                n = L.n
                s = (qg @ L.k[:n].T) * scale  # [G, n]
                if len(rows):
                    s = np.concatenate([s, (qg @ L.tk[rows].T) * scale], 1)
                w = np.exp(s - s.max(1, keepdims=True))
                w /= w.sum(1, keepdims=True)
                out = w[:, :n] @ L.v[:n]
                if len(rows):
                    out += w[:, n:] @ L.tv[rows]
                att[ci, h * group : (h + 1) * group] = out
                L.mass[:n] += w[:, :n].sum(0)
        x = m.finish(l, x, att)
    # H2O after the step: each list down to its budget.
    for c in configs:
        if c.budget is None:
            continue
        window = c.budget // 2
        for layer in c.lists:
            for L in layer:
                over = L.n - c.budget
                if over <= 0:
                    continue
                pos, mass = L.pos[: L.n], L.mass[: L.n]
                free = np.nonzero((pos >= SINKS) & (pos <= p - window))[0]
                order = free[np.lexsort((pos[free], mass[free]))]
                L.capture(np.sort(order[:over]))
    return m.logits(x)


def feed(m, specs, ids, on_logits=None):
    configs = [Config(s, m) for s in specs]
    for i, t in enumerate(ids):
        lg = step(m, configs, t, i)
        if on_logits:
            on_logits(i, lg)
    return configs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--cases", required=True, help="expertkv eval --write-cases FILE")
    ap.add_argument("--configs", default="full,h2o@192,h2o@128+recall4,h2o@96,h2o@32+recall4")
    ap.add_argument("--text-tokens", type=int, default=2048, help="tokens of the scored text (0: none)")
    ap.add_argument("--only", default="", help="case names to run, separated by | (default: all)")
    a = ap.parse_args()
    m = Model(a.model)
    doc = json.load(open(a.cases))
    specs = a.configs.split(",")
    t0 = time.time()
    if a.text_tokens:
        ids = doc["text_ids"][: a.text_tokens]
        nll = np.zeros(len(specs))
        greedy = [[] for _ in specs]

        def on(i, lg):
            for ci in range(len(specs)):
                greedy[ci].append(int(np.argmax(lg[ci])))
                if i + 1 < len(ids):
                    z = lg[ci].astype(np.float64)
                    mx = z.max()
                    nll[ci] += mx + math.log(np.exp(z - mx).sum()) - z[ids[i + 1]]

        feed(m, specs, ids, on)
        ppl = np.exp(nll / (len(ids) - 1))
        print(f"text ({len(ids)} tokens, {time.time() - t0:.0f} s):", flush=True)
        for ci, s in enumerate(specs):
            agree = np.mean([g == r for g, r in zip(greedy[ci], greedy[0])])
            print(f"  {s}: perplexity {ppl[ci]:.4f} ({100 * (ppl[ci] / ppl[0] - 1):+.2f}% against {specs[0]}), greedy agreement {100 * agree:.1f}%", flush=True)
    only = [o.strip() for o in a.only.split("|") if o.strip()]
    for case in doc["cases"]:
        if only and case["name"] not in only:
            continue
        configs = [Config(s, m) for s in specs]
        p = 0
        answers = [[] for _ in specs]
        lg = None
        for ti, turn in enumerate(case["turns"]):
            for t in turn["feed"]:
                lg = step(m, configs, t, p)
                p += 1
            outs = [[] for _ in specs]
            toks = [int(np.argmax(lg[ci])) for ci in range(len(specs))]
            for i in range(turn["generate"]):
                for ci in range(len(specs)):
                    outs[ci].append(toks[ci])
                if i + 1 < turn["generate"] or ti + 1 < len(case["turns"]):
                    # Each configuration feeds its own answer: one step a configuration.
                    nxt = []
                    for ci, c in enumerate(configs):
                        lgc = step(m, [c], toks[ci], p)
                        nxt.append(int(np.argmax(lgc[0])))
                    toks = nxt
                    p += 1
            if turn.get("expect"):
                for ci in range(len(specs)):
                    answers[ci].append((m.text(outs[ci]), turn["expect"]))
        cells = []
        for ci, s in enumerate(specs):
            found = all(e in t for t, e in answers[ci])
            cells.append(f"{s}: {'found' if found else 'MISSED'} {[t.strip() for t, _ in answers[ci]]}")
        print(f"{case['name']} ({time.time() - t0:.0f} s): " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
