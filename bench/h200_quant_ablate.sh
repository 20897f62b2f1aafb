#!/usr/bin/env bash
# Runs against a build of commit d87e2db (its EXPERTKV_QUANT_ABLATE / _KERNEL / _WG knobs and the
# integer-key kernel were removed after these measurements; BENCHMARKS.md has the results).
# Where the quantised attention kernel's time goes, on the lent H200 (b8 x 32768): the codec
# kernel with its key arithmetic (ABLATE 1), its value arithmetic (2) or both (3) replaced by a
# one-bit use of the loaded words, so the loads, the softmax and the merge stay; and page sizes
# 32 and 64 (fewer per-channel key parameter bytes per token).
. bench/lib.sh
h200_setup
B=.bin/expertkv
run() { $B bench attend --json --reps 20 "$@" 2>/dev/null | attend_rows "ablate=${EXPERTKV_QUANT_ABLATE:-0} $*"; }
S="--batch 8 --tokens 32768"
run $S --codecs none,int4 --torch
for a in 1 2 3; do EXPERTKV_QUANT_ABLATE=$a run $S --codecs int4,int8; done
run $S --codecs int8
for p in 32 64; do run $S --codecs int4 --page-size $p; EXPERTKV_QUANT_ABLATE=3 run $S --codecs int4 --page-size $p; done
