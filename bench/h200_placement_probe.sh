#!/usr/bin/env bash
# Does page placement explain the pipeline's slower attention? Same 512 MiB of K/V, different
# distances between consecutive pages of a ring.
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=.bin/expertkv
C="--layers 1 --head-dim 128 --kv-heads 8 --group 4 --steps 4 --no-verify --no-reference --json --scheduler none --chunk-pages 32"
sum() { python3 -c "
import json,sys,statistics as st
g=[json.loads(l)['gpu'] for l in sys.stdin if l.startswith('{\"step')]
print('$1', 'attend', round(st.median([x['attend_ms'] for x in g]),4), 'gather', round(st.median([x['gather_ms'] for x in g]),4))
"; }
$B demo $C --seqs 8 --prompt 16384 --shards 4 | sum "8 seqs x 16K, 4 shards (256 rings)"
$B demo $C --seqs 8 --prompt 16384 --shards 1 | sum "8 seqs x 16K, 1 shard (64 rings)"
$B demo $C --seqs 1 --prompt 131072 --shards 1 | sum "1 seq x 128K, 1 shard (8 rings)"
$B bench attend --json --batch 8 --tokens 16384 --reps 20 | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l)
    if r['kernel']!='copy': print('bench attend b8 x 16K', round(r['median_ms'],4))
"
