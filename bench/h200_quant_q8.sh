#!/usr/bin/env bash
# The fast quantised kernel with int8 page-folded queries for int4 keys (dot4I8Packed), on the
# lent H200: b8 x 32768 and b1 x 131072, PyTorch SDPA with the f16 pool in its own process
# first (SDPA in the same process slows the codec kernels: BENCHMARKS.md, "The swing, probed"),
# then the codecs alone; the prefetch block (EXPERTKV_QUANT_PREFETCH, default 4 slots) and 8
# lanes per token.
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=.bin/expertkv
run() { $B bench attend --json --reps 20 "$@" 2>/dev/null | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l)
    if r['kernel']=='copy': continue
    print('pf=${EXPERTKV_QUANT_PREFETCH:-default}', '$*', r['shape'][-26:], 'ms', round(r['median_ms'],4), 'codec', round(r.get('codec_split_ms',0),4), 'sdpa', round(r.get('torch_ms',0),4), 'x', round(r.get('speedup_vs_torch',0),2), 'rho', round(r.get('rho',1),2), 'GB/s', round(r.get('gbps',0)), r['variant'][-48:])
"; }
S="--batch 8 --tokens 32768"
run $S --codecs none --torch
run $S --codecs int4,int8,int4:group=64
for pf in 2 8; do EXPERTKV_QUANT_PREFETCH=$pf run $S --codecs int4; done
for pf in 2 4; do EXPERTKV_QUANT_PREFETCH=$pf run $S --codecs int4 --lanes 8; done
run $S --codecs int4 --page-size 64
run --batch 1 --tokens 131072 --codecs none --torch
run --batch 1 --tokens 131072 --codecs int4,int8
