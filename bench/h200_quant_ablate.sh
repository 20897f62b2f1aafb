#!/usr/bin/env bash
# Runs against a build of commit d87e2db (its EXPERTKV_QUANT_ABLATE / _KERNEL / _WG knobs and the
# integer-key kernel were removed after these measurements; BENCHMARKS.md has the results).
# Where the quantised attention kernel's time goes, on the lent H200 (b8 x 32768): the codec
# kernel with its key arithmetic (ABLATE 1), its value arithmetic (2) or both (3) replaced by a
# one-bit use of the loaded words, so the loads, the softmax and the merge stay; and page sizes
# 32 and 64 (fewer per-channel key parameter bytes per token).
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=.bin/expertkv
run() { $B bench attend --json --reps 20 "$@" 2>/dev/null | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l)
    if r['kernel']=='copy': continue
    print('ablate=${EXPERTKV_QUANT_ABLATE:-0}', '$*', r['shape'][-26:], 'ms', round(r['median_ms'],4), 'codec', round(r.get('codec_split_ms',0),4), 'sdpa', round(r.get('torch_ms',0),4), 'x', round(r.get('speedup_vs_torch',0),2), 'rho', round(r.get('rho',1),2))
"; }
S="--batch 8 --tokens 32768"
run $S --codecs none,int4 --torch
for a in 1 2 3; do EXPERTKV_QUANT_ABLATE=$a run $S --codecs int4,int8; done
run $S --codecs int8
for p in 32 64; do run $S --codecs int4 --page-size $p; EXPERTKV_QUANT_ABLATE=3 run $S --codecs int4 --page-size $p; done
