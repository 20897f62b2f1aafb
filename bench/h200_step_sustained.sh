#!/usr/bin/env bash
# The full decode step of bench/h200_step.sh at serving clocks: the last 600 of 612 steps run back
# to back (300 to warm the clock up, 300 timed), one submission each, with no step report read
# between them (EXPERTKV_PROBE_STEPS,
# `Pipeline::probe_steps`), so the GPU is busy and leaves its idle clock (345 MHz seen when the
# demo reads a report after every step) for its boost clock (1980 MHz). Per-stage GPU times are
# the last step's; PyTorch's step in the same call. SM clock logged read-only.
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=.bin/expertkv
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=timestamp,clocks.sm,utilization.gpu --format=csv,noheader -lms 50 > "$OUT/clk3.csv" & CLK=$!
S="--seqs 8 --layers 1 --prompt 32768 --head-dim 128 --kv-heads 8 --group 4 --steps 612 --chunk-pages 32 --no-verify --no-reference --json"
export EXPERTKV_PROBE_STEPS=600
for ek in "8 2" "256 8"; do
  set -- $ek
  for extra in "--scheduler none" "--scheduler h2o --budget 25%" "--scheduler none --codec int8" "--scheduler none --codec int4"; do
    echo "== E$1 k$2 $extra"
    $B demo $S --experts $1 --top-k $2 $extra 2>/dev/null | grep '"probe":"steps"'
  done
done
kill $CLK
python3 bench/torch_pikv_step.py --codec none,int8 --budget 0.25,1.0 --sweep-shapes --json 2>&1 | tail -12
