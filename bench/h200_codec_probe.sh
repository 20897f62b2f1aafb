#!/usr/bin/env bash
# Knobs of the quantised attention kernel on the lent H200 (b8 x 32768, int4 unless stated).
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=.bin/expertkv
run() { $B bench attend --json --batch 8 --tokens 32768 --reps 20 "$@" 2>/dev/null | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l)
    if r['kernel']=='copy': continue
    print('$*', r['shape'][-14:], round(r['median_ms'],4), 'split', round(r['split_ms'],4), 'codec', round(r.get('codec_split_ms',0),4))
"; }
run --codecs none,int4,int8,int4:group=64
for u in 1 2 8; do run --codecs int4 --tokens-in-flight $u; done
for c in 16 64; do run --codecs int4 --chunk-pages $c; done
run --codecs int4 --variant subgroup --lanes 8
