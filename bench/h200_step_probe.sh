#!/usr/bin/env bash
# Where the pipeline's attention stage spends its time on the lent H200.
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=.bin/expertkv
S="--seqs 8 --layers 1 --prompt 16384 --head-dim 128 --kv-heads 8 --group 4 --steps 6 --no-verify --no-reference --json"
sum() { python3 -c "
import json,sys
g=[json.loads(l)['gpu'] for l in sys.stdin if l.startswith('{\"step')]
import statistics as st
print('$1', {k: round(st.median([x[k] for x in g]),4) for k in g[0]})
"; }
$B demo $S --scheduler none | sum "none chunk8"
$B demo $S --scheduler none --chunk-pages 32 | sum "none chunk32"
$B demo $S --scheduler h2o --budget 100% | sum "h2o100 chunk8 (mass)"
$B demo $S --scheduler h2o --budget 100% --chunk-pages 32 | sum "h2o100 chunk32 (mass)"
$B demo $S --scheduler h2o --budget 25% --chunk-pages 32 | sum "h2o25 chunk32"
