#!/usr/bin/env bash
# The reliability issue's GPU soak: `expertkv soak` with churn (sequences finishing and joining),
# H2O eviction over int4 pages (every eviction thawing the compressed pages it touches), the
# pool's invariants checked every 50,000 steps, host RSS, GPU memory and steps/s per window;
# then `soak --model` on a one-layer synthetic model (the batch decoder's whole engine).
# STEPS (default 1,000,000: about 8 minutes on an H100 at about 2,000 steps/s; a call is
# limited to 10 minutes, so MODEL_STEPS, default 0, is best run in a second call).
# Needs .bin/expertkv and the Vulkan loader in .gl/.
set -u
. bench/lib.sh
h200_setup
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=.bin/expertkv
timeout 570 $B soak --steps "${STEPS:-1000000}" --check-every 50000 --layers 2 --seqs 8 \
  --scheduler h2o --budget 64 --codec int4 --seed "${SEED:-1}" 2>&1 | tee "$OUT/soak_${SEED:-1}.txt"
if [ "${MODEL_STEPS:-0}" -gt 0 ]; then
  $B synth --untied-output --experts 0 --layers 1 --out /tmp/soak_model.gguf
  timeout 570 $B soak --model /tmp/soak_model.gguf --steps "$MODEL_STEPS" --check-every 40000 --seqs 4 \
    --lengths 8:200 --budget 32 --codec int4 2>&1 | tee "$OUT/soak_model.txt"
fi
