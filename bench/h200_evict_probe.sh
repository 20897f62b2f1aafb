#!/usr/bin/env bash
# The eviction stage's kernels one by one (EXPERTKV_PROBE_EVICT: the last timed step of
# `Pipeline::probe_steps` encodes each stage in its own timed pass), at serving clocks, on the
# sustained step's shapes; and the quantised kernel's prefetch block at int8.
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=.bin/expertkv
run() { $B bench attend --json --reps 20 --batch 8 --tokens 32768 "$@" 2>/dev/null | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l)
    if r['kernel']=='copy': continue
    print('pf=${EXPERTKV_QUANT_PREFETCH:-default}', '$*', r['shape'][-22:], 'ms', round(r['median_ms'],4), 'codec', round(r.get('codec_split_ms',0),4), r['variant'][-40:])
"; }
run --codecs int4,int8
for pf in 2 8; do EXPERTKV_QUANT_PREFETCH=$pf run --codecs int8; done
S="--seqs 8 --layers 1 --prompt 32768 --head-dim 128 --kv-heads 8 --group 4 --steps 612 --chunk-pages 32 --no-verify --no-reference --json"
export EXPERTKV_PROBE_STEPS=600 EXPERTKV_PROBE_EVICT=1
for ek in "8 2" "256 8"; do
  set -- $ek
  echo "== E$1 k$2 h2o 25%"
  $B demo $S --experts $1 --top-k $2 --scheduler h2o --budget 25% 2>/dev/null | grep '"probe":"steps"'
done
echo "== E8 k2 int8"
$B demo $S --experts 8 --top-k 2 --scheduler none --codec int8 2>/dev/null | grep '"probe":"steps"'
