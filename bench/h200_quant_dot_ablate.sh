#!/usr/bin/env bash
# Runs against a build of commit d87e2db (its EXPERTKV_QUANT_ABLATE / _KERNEL / _WG knobs and the
# integer-key kernel were removed after these measurements; BENCHMARKS.md has the results).
# Where the integer-key kernel's time goes (H200, b8 x 32768 int4): EXPERTKV_QUANT_ABLATE bits
# 1 (key dot products), 2 (value accumulation), 4 (query folding), 8 (dot4I8Packed replaced by
# bitwise operations) replace that part by a one-word use of its loads.
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=.bin/expertkv
for a in 0 1 2 4 7; do
  EXPERTKV_QUANT_ABLATE=$a $B bench attend --json --reps 20 --batch 8 --tokens 32768 --codecs int4 2>/dev/null | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l)
    if r['kernel']=='copy': continue
    print('ablate=$a', r['shape'][-22:], 'ms', round(r['median_ms'],4), 'codec', round(r.get('codec_split_ms',0),4))
"
done
