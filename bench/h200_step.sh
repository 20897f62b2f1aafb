#!/usr/bin/env bash
# The closed-loop issue's full-step comparison on the lent H200, in one call: expertkv's decode
# step (route, append, gather, attend, evict, miss recount; one layer, batch 8, GQA 32/8,
# head_dim 128, 32K context) against the same step in batched PyTorch (bench/torch_pikv_step.py),
# for a Mixtral-like router (E=8, k=2) and a DeepSeek-like one (E=256, k=8).
# NO_TORCH=1 skips the PyTorch step.
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=.bin/expertkv
S="--seqs 8 --layers 1 --prompt 32768 --head-dim 128 --kv-heads 8 --group 4 --steps 12 --chunk-pages 32 --no-verify --no-reference --json"
med() { python3 -c "
import json,sys,statistics as st
lines=[json.loads(l) for l in sys.stdin if l.startswith('{')]
rows=[r for r in lines if 'step' in r and 'gpu' in r]
g=[r['gpu'] for r in rows][2:]
m={k: round(st.median([x[k] for x in g]),4) for k in g[0]}
m['total']=round(sum(m.values()),4)
out={'config': '$1', 'gpu_ms': m, 'kv_bytes_resident': rows[-1]['kv_bytes_resident'], 'evicted': rows[-1]['evicted'], 'host_ms': round(st.median([r['host_ms'] for r in rows[2:]]),3)}
print(json.dumps(out))
"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$B bench attend --batch 8 --tokens 32768 --chunk-pages 32 --json 2>/dev/null | grep attend_decode
$B bench attend --batch 8 --tokens 8192 --chunk-pages 32 --json 2>/dev/null | grep attend_decode
for ek in "8 2" "256 8"; do
  set -- $ek
  $B demo $S --experts $1 --top-k $2 --scheduler none | med "E$1 k$2 full cache"
  $B demo $S --experts $1 --top-k $2 --scheduler h2o --budget 25% | med "E$1 k$2 h2o 25%"
  $B demo $S --experts $1 --top-k $2 --scheduler none --codec int8 | med "E$1 k$2 int8 full cache"
done
$B demo $S --experts 8 --top-k 2 --scheduler h2o --budget 25% --allocator ekva | med "E8 k2 h2o 25% + ekva"
[ -n "$NO_TORCH" ] || python3 bench/torch_pikv_step.py --codec none,int8 --budget 0.25,1.0 --sweep-shapes --json
