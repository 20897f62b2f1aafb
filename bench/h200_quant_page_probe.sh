#!/usr/bin/env bash
# The page-at-a-time kernel was measured slower and removed: run this at commit d916e06.
# Probes of the page-at-a-time quantised kernel on the lent H200, b8 x 32768 int4 and int8, the
# codec kernel's time: value slots loaded with the keys (EXPERTKV_QUANT_PAGE_PREFETCH 16, 4, 1)
# and 64-invocation workgroups (EXPERTKV_QUANT_PAGE_WG=64), against the slot-block kernel.
. bench/lib.sh
h200_setup
B=.bin/expertkv
run() { $B bench attend --json --reps 20 "$@" 2>/dev/null | attend_rows "${EXPERTKV_QUANT_KERNEL:-page} pf=${EXPERTKV_QUANT_PAGE_PREFETCH:-16} wg=${EXPERTKV_QUANT_PAGE_WG:-128} $*"; }
S="--batch 8 --tokens 32768"
for codec in int4 int8; do
  EXPERTKV_QUANT_KERNEL=slot run $S --codecs $codec
  for pf in 16 4 1; do EXPERTKV_QUANT_PAGE_PREFETCH=$pf run $S --codecs $codec; done
  EXPERTKV_QUANT_PAGE_PREFETCH=1 EXPERTKV_QUANT_PAGE_WG=64 run $S --codecs $codec
  EXPERTKV_QUANT_PAGE_WG=64 run $S --codecs $codec
done
