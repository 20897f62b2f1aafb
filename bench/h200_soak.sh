#!/usr/bin/env bash
# The reliability issue's H200 soak: `expertkv soak` with churn (sequences finishing and joining),
# H2O eviction over int4 pages (every eviction thawing the compressed pages it touches), the
# pool's invariants checked every 50,000 steps, host RSS, GPU memory and steps/s per window.
# STEPS per call (default 400,000: a call is limited to 10 minutes; run it again with another
# SEED to reach 1,000,000 in all). Needs .bin/expertkv and the Vulkan loader in .gl/.
set -u
. bench/lib.sh
h200_setup
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 560 .bin/expertkv soak --steps "${STEPS:-400000}" --check-every 50000 --layers 2 --seqs 8 \
  --scheduler h2o --budget 64 --codec int4 --seed "${SEED:-1}" 2>&1 | tee "$OUT/soak_${SEED:-1}.txt"
