#!/usr/bin/env bash
# Knob sweep of the subgroup attention kernel on the lent H200 (see BENCHMARKS.md).
set -u
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig >/dev/null
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=.bin/expertkv
for lanes in 16 8; do for u in 4 8; do for c in 32 64; do
  $B bench attend --json --variant subgroup --lanes $lanes --chunk-pages $c --tokens-in-flight $u | tee -a $OUT/sweep.jsonl | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l)
    if r['kernel']=='attend_decode': print(f\"{r['shape']:<36} {r['variant']:<48} {r['median_ms']:.4f} split {r['split_ms']:.4f} {r['gbps']:7.1f} GB/s ratio {r['ratio_to_copy']:.3f}\")"
done; done; done
