#!/usr/bin/env bash
# One batched run on the lent H200 (see BENCHMARKS.md): the release binary is carried in .bin/,
# the Vulkan loader in .gl/. Results go to $OUT (JSON lines) and the end of stdout.
set -u
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=.bin/expertkv
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
$B info --json > "$OUT/info.json" 2>&1; head -c 600 "$OUT/info.json"; echo
python3 bench/torch_baseline.py --copy --json --batch 8 --tokens 32768 | tee "$OUT/torch.jsonl"
python3 bench/torch_baseline.py --json --batch 1 --tokens 131072 | tee -a "$OUT/torch.jsonl"
for c in 8 16 32; do
  $B bench attend --json --chunk-pages $c ${1:+$1} | tee -a "$OUT/attend.jsonl"
done
$B bench attend --json --variant tiled | tee -a "$OUT/attend.jsonl"
$B bench attend --json --checked | tee -a "$OUT/attend.jsonl"
$B bench attend --json --torch | tee -a "$OUT/attend.jsonl"
$B demo --seqs 8 --layers 4 --prompt 4096 --steps 8 --head-dim 128 --kv-heads 8 | tee "$OUT/demo.txt"
python3 - "$OUT/attend.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    if not l.startswith('{'): continue
    r = json.loads(l)
    if r['kernel'] != 'attend_decode': continue
    print(f"{r['shape']:<36} {r['variant']:<26} {r['shader_checks']:<24} {r['median_ms']:.4f} ms {r['gbps']:8.1f} GB/s copy {r['copy_gbps']:7.1f} ratio {r['ratio_to_copy']:.3f}", r.get('ratio_to_torch', ''))
PY
