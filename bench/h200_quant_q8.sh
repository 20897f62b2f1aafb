#!/usr/bin/env bash
# The fast quantised kernel with int8 page-folded queries for int4 keys (dot4I8Packed), on the
# lent H200: b8 x 32768 and b1 x 131072, PyTorch SDPA with the f16 pool in its own process
# first (SDPA in the same process slows the codec kernels: BENCHMARKS.md, "The swing, probed"),
# then the codecs alone; the prefetch block (EXPERTKV_QUANT_PREFETCH, default 4 slots) and 8
# lanes per token.
. bench/lib.sh
h200_setup
B=.bin/expertkv
run() { $B bench attend --json --reps 20 "$@" 2>/dev/null | attend_rows "pf=${EXPERTKV_QUANT_PREFETCH:-default} $*"; }
S="--batch 8 --tokens 32768"
run $S --codecs none --torch
run $S --codecs int4,int8,int4:group=64
for pf in 2 8; do EXPERTKV_QUANT_PREFETCH=$pf run $S --codecs int4; done
for pf in 2 4; do EXPERTKV_QUANT_PREFETCH=$pf run $S --codecs int4 --variant subgroup --lanes 8; done
run $S --codecs int4 --page-size 64
run --batch 1 --tokens 131072 --codecs none --torch
run --batch 1 --tokens 131072 --codecs int4,int8
