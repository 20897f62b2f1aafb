#!/usr/bin/env bash
# The b1 x 131072 quantised attention's 2x swing between calls (0.256 ms alone, 0.497 ms right
# after the b8 x 32768 runs): the same b1 runs three times, then b8, then b1 three times again,
# then with three codecs in one process and with PyTorch's SDPA beside it (as the swinging
# call ran it), the SM clock logged read-only, in one call.
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=.bin/expertkv
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem --format=csv,noheader -lms 50 > "$OUT/clk_b1.csv" & CLK=$!
run() { echo "== $(date +%T.%N | cut -c1-12) $*"; $B bench attend --json --reps 20 "$@" 2>/dev/null | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l)
    if r['kernel']=='copy': continue
    print(r['shape'][-22:], 'ms', round(r['median_ms'],4), 'codec', round(r.get('codec_split_ms',0),4), r['variant'][-40:])
"; }
B1="--batch 1 --tokens 131072 --codecs int4"
for i in 1 2 3; do run $B1; done
run --batch 8 --tokens 32768 --codecs int4
for i in 1 2 3; do run $B1; done
# What the swinging call also had: three codecs in one process, and PyTorch's SDPA beside it.
run --batch 1 --tokens 131072 --codecs none,int4,int8
run $B1 --torch
run --batch 1 --tokens 131072 --codecs none,int4,int8 --torch
run --batch 1 --tokens 131072 --codecs none,int4 --torch
run --batch 1 --tokens 131072 --codecs int4,int8 --torch
# int4 at group 64 did not gain in the call that ran it fourth beside PyTorch: alone here.
run --batch 8 --tokens 32768 --codecs int4:group=64
kill $CLK
