#!/usr/bin/env bash
# The page-at-a-time kernel was measured slower and removed: run this at commit d916e06.
# The quantised attention a page at a time (split_quant_page.wgsl, the default) against the
# slot-block kernel (EXPERTKV_QUANT_KERNEL=slot) on the lent H200: b8 x 32768 and b1 x 131072,
# int4 and int8, each configuration alone in its process (PyTorch and the f16 pool in the same
# process move the compressed pool's timings: BENCHMARKS.md), then beside PyTorch's SDPA for the
# ratio, in one call.
. bench/lib.sh
h200_setup
B=.bin/expertkv
run() { $B bench attend --json --reps 20 "$@" 2>/dev/null | attend_rows "${EXPERTKV_QUANT_KERNEL:-page} $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for shape in "--batch 8 --tokens 32768" "--batch 1 --tokens 131072"; do
  for codec in int4 int8; do
    run $shape --codecs $codec
    EXPERTKV_QUANT_KERNEL=slot run $shape --codecs $codec
    run $shape --codecs $codec
  done
  run $shape --codecs int4 --torch
  EXPERTKV_QUANT_KERNEL=slot run $shape --codecs int4 --torch
done
