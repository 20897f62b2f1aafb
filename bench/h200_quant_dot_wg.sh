#!/usr/bin/env bash
# Runs against a build of commit d87e2db (its EXPERTKV_QUANT_ABLATE / _KERNEL / _WG knobs and the
# integer-key kernel were removed after these measurements; BENCHMARKS.md has the results).
# The integer-key kernel's rounds: 128 or 256 tokens per round (EXPERTKV_QUANT_WG), H200, b8 x 32768.
. bench/lib.sh
h200_setup
B=.bin/expertkv
for wg in 128 256; do for p in 16 64; do for a in 0 7; do
  EXPERTKV_QUANT_ABLATE=$a EXPERTKV_QUANT_WG=$wg $B bench attend --json --reps 20 --batch 8 --tokens 32768 --codecs int4 --page-size $p 2>/dev/null | attend_rows "wg=$wg ablate=$a"
done; done; done
