#!/usr/bin/env bash
# The clock lead of bench/h200_gap_probe.sh, checked: the pipeline's attention probe after a long
# warm-up (EXPERTKV_PROBE_WARMUP passes back to back), and full decode steps timed over a long run
# (--steps 200: the median of steps 2.. is dominated by steps taken with the GPU already busy),
# with the SM clock logged (read-only) through both.
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=.bin/expertkv
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=timestamp,clocks.sm,utilization.gpu --format=csv,noheader -lms 50 > "$OUT/clk2.csv" & CLK=$!
mark() { echo "== $(date +%H:%M:%S.%N | cut -c1-12) $*"; }
S="--seqs 8 --layers 1 --prompt 32768 --head-dim 128 --kv-heads 8 --group 4 --chunk-pages 32 --no-verify --no-reference --json"
med() { python3 -c "
import json,sys,statistics as st
lines=[json.loads(l) for l in sys.stdin if l.startswith('{')]
rows=[r for r in lines if 'step' in r and 'gpu' in r]
g=[r['gpu'] for r in rows][2:]
m={k: round(st.median([x[k] for x in g]),4) for k in g[0]}
m['total']=round(sum(m.values()),4)
late=[r['gpu'] for r in rows][-50:]
lt=round(st.median([sum(x.values()) for x in late]),4)
print(json.dumps({'config': '$1', 'steps': len(rows), 'gpu_ms_median': m, 'total_ms_last50': lt, 'host_ms': round(st.median([r['host_ms'] for r in rows[2:]]),3)}))
"; }
for w in 5 300 1500; do
  mark "probe warmup $w"; EXPERTKV_PROBE_WARMUP=$w $B demo $S --steps 4 --probe-attention --experts 8 --top-k 2 --scheduler none 2>/dev/null | grep -E '"probe"' | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print({k: d[k] for k in ('median_ms','split_ms','random_queries_ms')})"
done
mark "E8 full, 200 steps"; $B demo $S --steps 200 --experts 8 --top-k 2 --scheduler none 2>/dev/null | med "E8 k2 full cache"
mark "E8 h2o 25%, 200 steps"; $B demo $S --steps 200 --experts 8 --top-k 2 --scheduler h2o --budget 25% 2>/dev/null | med "E8 k2 h2o 25%"
mark "E256 full, 200 steps"; $B demo $S --steps 200 --experts 256 --top-k 8 --scheduler none 2>/dev/null | med "E256 k8 full cache"
mark "E256 h2o 25%, 200 steps"; $B demo $S --steps 200 --experts 256 --top-k 8 --scheduler h2o --budget 25% 2>/dev/null | med "E256 k8 h2o 25%"
mark done
kill $CLK
python3 - "$OUT/clk2.csv" <<'PY'
import sys
rows=[l.strip().split(', ') for l in open(sys.argv[1]) if l.strip()]
last=None
for r in rows:
    if r[1]!=last:
        print(' '.join(r)); last=r[1]
PY
