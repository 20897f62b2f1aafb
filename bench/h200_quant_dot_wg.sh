#!/usr/bin/env bash
# Runs against a build of commit d87e2db (its EXPERTKV_QUANT_ABLATE / _KERNEL / _WG knobs and the
# integer-key kernel were removed after these measurements; BENCHMARKS.md has the results).
# The integer-key kernel's rounds: 128 or 256 tokens per round (EXPERTKV_QUANT_WG), H200, b8 x 32768.
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=.bin/expertkv
for wg in 128 256; do for p in 16 64; do for a in 0 7; do
  EXPERTKV_QUANT_ABLATE=$a EXPERTKV_QUANT_WG=$wg $B bench attend --json --reps 20 --batch 8 --tokens 32768 --codecs int4 --page-size $p 2>/dev/null | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l)
    if r['kernel']=='copy': continue
    print('wg=$wg ablate=$a', r['shape'][-22:], 'ms', round(r['median_ms'],4), 'codec', round(r.get('codec_split_ms',0),4))
"
done; done; done
