#!/usr/bin/env python3
"""Draw `expertkv mix --json`'s grid cells (policies cell:SLOTS:PERCENT) as an SVG heat map:
one square per (expert slots, H2O's share of each context), coloured by decode tokens/s over the
requests it served, labelled with tokens/s and the mean KL divergence from the reference's
logits; a cell that refused a request (over the total) is grey. The joint controller's row, if
present, is named under the map. Usage: mix_grid.py MIX_OUTPUT OUT.svg"""
import json
import sys

rows, meta = [], {}
for line in open(sys.argv[1]):
    if line.startswith('{"measure":"mix_policy"'):
        rows.append(json.loads(line)["row"])
    elif line.startswith("{") and '"measure":"mix"' in line:
        meta = json.loads(line)
cells = {}
for r in rows:
    if r["policy"].startswith("cell:"):
        _, s, p = r["policy"].split(":")
        cells[(int(s), float(p))] = r
if not cells:
    sys.exit("mix_grid.py: no cell:SLOTS:PERCENT rows in " + sys.argv[1])
slots = sorted({s for s, _ in cells})
shares = sorted({p for _, p in cells})
served = [c["all"]["tokens_per_s"] for c in cells.values() if c["all"]["refused"] == 0]
lo, hi = (min(served), max(served)) if served else (0, 1)
W, H, X0, Y0 = 110, 60, 90, 60
out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{X0 + W * len(shares) + 40}" height="{Y0 + H * len(slots) + 110}" font-family="sans-serif" font-size="12">']
total = meta.get("gpu_mem", 0) / 2**20
out.append(f'<text x="10" y="20" font-size="14">Decode tokens/s and KL to the whole cache, {total:.0f} MiB for K/V and expert slots</text>')
out.append(f'<text x="10" y="40">requests {meta.get("requests", "?")}, {meta.get("tokens", "?")} tokens each; {meta.get("adapter", "")}</text>')
for i, p in enumerate(shares):
    label = "whole context" if p >= 100 else f"H2O {p:g}%"
    out.append(f'<text x="{X0 + i * W + W / 2}" y="{Y0 + H * len(slots) + 18}" text-anchor="middle">{label}</text>')
for j, s in enumerate(reversed(slots)):
    y = Y0 + j * H
    out.append(f'<text x="{X0 - 8}" y="{y + H / 2 + 4}" text-anchor="end">{s} slots</text>')
    for i, p in enumerate(shares):
        x = X0 + i * W
        c = cells.get((s, p))
        if c is None or c["all"]["refused"] > 0:
            out.append(f'<rect x="{x}" y="{y}" width="{W - 2}" height="{H - 2}" fill="#ddd"/>')
            out.append(f'<text x="{x + W / 2}" y="{y + H / 2 + 4}" text-anchor="middle" fill="#777">over the total</text>')
            continue
        a = c["all"]
        t = (a["tokens_per_s"] - lo) / max(hi - lo, 1e-9)
        fill = f"rgb({int(240 - 170 * t)},{int(240 - 90 * t)},{int(255 - 40 * t)})"
        out.append(f'<rect x="{x}" y="{y}" width="{W - 2}" height="{H - 2}" fill="{fill}"/>')
        out.append(f'<text x="{x + W / 2}" y="{y + 24}" text-anchor="middle">{a["tokens_per_s"]:.1f} tok/s</text>')
        out.append(f'<text x="{x + W / 2}" y="{y + 42}" text-anchor="middle" font-size="11">KL {a["mean_kl"]:.2g}</text>')
joint = next((r for r in rows if r["policy"] == "joint"), None)
if joint:
    splits = ", ".join(f'{q["prompt"]} tokens: {q["split"]["slots"]} slots, ' + ("whole" if q["split"]["h2o_budget"] is None else f'H2O {q["split"]["h2o_budget"]}')
                       for q in joint["requests"] if q.get("split"))
    out.append(f'<text x="10" y="{Y0 + H * len(slots) + 48}">joint controller: {joint["all"]["tokens_per_s"]:.1f} tok/s, KL {joint["all"]["mean_kl"]:.2g}</text>')
    out.append(f'<text x="10" y="{Y0 + H * len(slots) + 68}" font-size="11">({splits})</text>')
out.append("</svg>")
open(sys.argv[2], "w").write("\n".join(out))
print(f"wrote {sys.argv[2]}: {len(cells)} cells")
