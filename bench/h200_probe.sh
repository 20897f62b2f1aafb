#!/usr/bin/env bash
# Diagnostic and knob runs of the subgroup attention kernel on the lent H200 (see BENCHMARKS.md).
set -u
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig >/dev/null
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=.bin/expertkv
show() { python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l)
    if r['kernel']=='attend_decode': print(f\"{r['shape']:<36} {r['variant']:<48} {r['median_ms']:.4f} split {r['split_ms']:.4f} {r['gbps']:7.1f} GB/s ratio {r['ratio_to_copy']:.3f}\")"; }
for u in 2 4; do for c in 32; do
  $B bench attend --json --chunk-pages $c --tokens-in-flight $u | tee -a $OUT/probe.jsonl | show
done; done
for hq in 16; do
  $B bench attend --json --batch 8 --tokens 32768 --chunk-pages 32 --q-heads $hq | tee -a $OUT/probe.jsonl | show
done
