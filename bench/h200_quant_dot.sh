#!/usr/bin/env bash
# Runs against a build of commit d87e2db (its EXPERTKV_QUANT_ABLATE / _KERNEL / _WG knobs and the
# integer-key kernel were removed after these measurements; BENCHMARKS.md has the results).
# The integer-key quantised attention kernel (attend/split_quant_dot.wgsl) against the slot-block
# kernel (EXPERTKV_QUANT_KERNEL=slots) and PyTorch SDPA on the lent H200, b8 x 32768 and
# b1 x 131072, pages of 16, 32 and 64 slots.
. bench/lib.sh
h200_setup
B=.bin/expertkv
run() { $B bench attend --json --reps 20 "$@" 2>/dev/null | attend_rows "${EXPERTKV_QUANT_KERNEL:-auto} $*"; }
S="--batch 8 --tokens 32768"
run $S --codecs none --torch
for p in 16 32 64; do run $S --codecs int4,int8 --page-size $p; done
EXPERTKV_QUANT_KERNEL=slots run $S --codecs int4,int8
run --batch 1 --tokens 131072 --codecs int4,int8
EXPERTKV_QUANT_KERNEL=slots run --batch 1 --tokens 131072 --codecs int4
run --batch 1 --tokens 131072 --codecs none --torch
