#!/usr/bin/env bash
# Every headline in one call on the lent H200: `expertkv bench suite --torch`, twice with
# different order seeds (a line that differs by more than 5% between the two runs is not a
# result). The release binary is carried in .bin/, the Vulkan loader in .gl/, the model in
# models/ when present. JSON lines go to $OUT.
set -u
. bench/lib.sh
h200_setup
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=.bin/expertkv
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee "$OUT/gpu.txt"
for seed in ${SEEDS:-1 2}; do
  $B bench suite --torch --seed "$seed" ${ROUNDS:+--rounds $ROUNDS} | tee "$OUT/suite_$seed.txt"
done
python3 - "$OUT" ${SEEDS:-1 2} <<'PY'
import re, sys
out, seeds = sys.argv[1], sys.argv[2:]
runs = []
for s in seeds:
    rows = {}
    for line in open(f"{out}/suite_{s}.txt"):
        m = re.match(r"(.{40}) median\s+([0-9.]+) ms", line)
        if m:
            rows[m.group(1).strip()] = float(m.group(2))
    runs.append(rows)
if len(runs) >= 2:
    print("\nbetween the runs (seeds %s):" % " and ".join(seeds))
    for k in runs[0]:
        if k in runs[1]:
            a, b = runs[0][k], runs[1][k]
            d = abs(a - b) / min(a, b)
            print(f"{k:<40} {a:9.4f} {b:9.4f} ms  {100*d:5.1f}% {'UNSTABLE' if d > 0.05 else ''}")
PY
