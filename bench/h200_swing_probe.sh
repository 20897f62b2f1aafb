#!/usr/bin/env bash
# The b8 swing (#32): the same attention benchmark in fresh processes, before and after a
# separate PyTorch process (as the slow call began), alone and after an f16 pool in the same
# process, with the SM/memory clocks and the GPU's framebuffer use logged. One call, ~2 min.
set -u
. bench/lib.sh
h200_setup
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=.bin/expertkv
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,memory.used,temperature.gpu,power.draw --format=csv,noheader -lms 100 > "$OUT/clocks.csv" & CLK=$!
row() { python3 -c '
import json, sys
tag = sys.argv[1]
for l in sys.stdin:
    r = json.loads(l)
    if r["kernel"] == "copy": continue
    print(f"{tag:<28}", r["shape"][-24:], "ms", round(r["median_ms"], 4), "min", round(r.get("min_ms", 0), 4), r["variant"][-30:])
' "$1"; }
F16="--batch 8 --tokens 32768 --page-size 16"
I4="--batch 8 --tokens 32768 --page-size 64 --codecs int4:group=64"
BOTH="--batch 8 --tokens 32768 --page-size 64 --codecs none,int4:group=64"
probe() {
  echo "== $1 $(date +%T)"
  $B bench attend --json --reps 30 $F16 2>/dev/null | row "$1 f16 alone"
  $B bench attend --json --reps 30 $I4 2>/dev/null | row "$1 int4 alone"
  $B bench attend --json --reps 30 $BOTH 2>/dev/null | row "$1 f16 then int4"
}
probe fresh
probe fresh-again
echo "== pytorch process (2 GiB copy + SDPA at three shapes) $(date +%T)"
for s in "1 131072" "8 32768" "32 8192"; do set -- $s; python3 bench/torch_baseline.py --json --copy --batch $1 --tokens $2 --reps 30 | tail -1; done
probe after-torch
probe after-torch-again
kill $CLK
