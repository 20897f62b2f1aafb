#!/usr/bin/env bash
# The quantised attention kernel's prefetch block (PF: slots whose code words are loaded before
# any is used) on the lent H200, b8 x 32768 and b1 x 131072, the codec kernel alone and whole.
# EXPERTKV_QUANT_PREFETCH caps the block (2 = one round trip per 2 slots, the old kernel's pace).
. bench/lib.sh
h200_setup
B=.bin/expertkv
run() { $B bench attend --json --reps 20 "$@" 2>/dev/null | attend_rows "pf=${EXPERTKV_QUANT_PREFETCH:-16} $*"; }
S="--batch 8 --tokens 32768"
run $S --codecs none,int4,int8,int4:group=64 --torch
for pf in 2 4 8; do EXPERTKV_QUANT_PREFETCH=$pf run $S --codecs int4; done
run $S --codecs int4 --tokens-in-flight 1
run $S --codecs int4 --chunk-pages 64
run --batch 1 --tokens 131072 --codecs none,int4,int8 --torch
