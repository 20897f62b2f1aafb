#!/usr/bin/env bash
# Runs against a build of commit d87e2db (its EXPERTKV_QUANT_ABLATE / _KERNEL / _WG knobs and the
# integer-key kernel were removed after these measurements; BENCHMARKS.md has the results).
# Where the integer-key kernel's time goes (H200, b8 x 32768 int4): EXPERTKV_QUANT_ABLATE bits
# 1 (key dot products), 2 (value accumulation), 4 (query folding), 8 (dot4I8Packed replaced by
# bitwise operations) replace that part by a one-word use of its loads.
. bench/lib.sh
h200_setup
B=.bin/expertkv
for a in 0 1 2 4 7; do
  EXPERTKV_QUANT_ABLATE=$a $B bench attend --json --reps 20 --batch 8 --tokens 32768 --codecs int4 2>/dev/null | attend_rows "ablate=$a"
done
