#!/usr/bin/env bash
# Runs against a build of commit d87e2db (its EXPERTKV_QUANT_ABLATE / _KERNEL / _WG knobs and the
# integer-key kernel were removed after these measurements; BENCHMARKS.md has the results).
# The integer-key quantised attention kernel (attend/split_quant_dot.wgsl) against the slot-block
# kernel (EXPERTKV_QUANT_KERNEL=slots) and PyTorch SDPA on the lent H200, b8 x 32768 and
# b1 x 131072, pages of 16, 32 and 64 slots.
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=.bin/expertkv
run() { $B bench attend --json --reps 20 "$@" 2>/dev/null | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l)
    if r['kernel']=='copy': continue
    print('${EXPERTKV_QUANT_KERNEL:-auto}', '$*', r['shape'][-26:], 'ms', round(r['median_ms'],4), 'codec', round(r.get('codec_split_ms',0),4), 'sdpa', round(r.get('torch_ms',0),4), 'x', round(r.get('speedup_vs_torch',0),2), 'rho', round(r.get('rho',1),2))
"; }
S="--batch 8 --tokens 32768"
run $S --codecs none --torch
for p in 16 32 64; do run $S --codecs int4,int8 --page-size $p; done
EXPERTKV_QUANT_KERNEL=slots run $S --codecs int4,int8
run --batch 1 --tokens 131072 --codecs int4,int8
EXPERTKV_QUANT_KERNEL=slots run --batch 1 --tokens 131072 --codecs int4
run --batch 1 --tokens 131072 --codecs none --torch
