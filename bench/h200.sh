#!/usr/bin/env bash
# One batched run on the lent H200 (see BENCHMARKS.md): the release binary is carried in .bin/,
# the Vulkan loader in .gl/. JSON lines go to $OUT, a summary to stdout.
set -u
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=.bin/expertkv
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$B bench route --json --torch > "$OUT/route.jsonl"
$B bench attend --json --torch > "$OUT/attend.jsonl"
python3 - "$OUT" <<'PY'
import json, sys, os
d = sys.argv[1]
for name in ["route.jsonl", "attend.jsonl"]:
    for l in open(os.path.join(d, name)):
        if not l.startswith('{'): continue
        r = json.loads(l)
        if r['kernel'] == 'copy': print(f"copy {r['gbps']:.0f} GB/s"); continue
        extra = r.get('speedup_vs_torch', r.get('ratio_to_torch', ''))
        print(f"{r['kernel']:<14} {r['shape']:<36} {r['variant']:<46} {r['median_ms']:.4f} ms {r['gbps']:8.1f} GB/s ratio {r['ratio_to_copy']:.3f} torch {r.get('torch_ms','')} {extra}")
PY
$B sweep --schedulers h2o,streaming-llm,lru,lru-plus,adakv,duo,quest,flexgen --budgets 50%,25%,10% \
  --prompt 2048 --steps 8 --seqs 8 --layers 2 --head-dim 128 2>&1 | tee "$OUT/sweep.md"
