#!/usr/bin/env bash
# Why the pipeline's attention (1.64 ms) is slower than `bench attend` (0.35 ms) over the same
# 1 GiB (BENCHMARKS.md, "A full decode step against batched PyTorch"): GPU clocks logged through
# every phase (read-only), the benchmark with a short warm-up, with the pipeline's uneven list
# length, and the pipeline's own probe with and without the workload's planted keys.
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=.bin/expertkv
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=timestamp,pstate,clocks.sm,clocks.mem,power.draw,utilization.gpu --format=csv,noheader -lms 50 > "$OUT/clk.csv" & CLK=$!
mark() { echo "== $(date +%H:%M:%S.%N | cut -c1-12) $*"; }
S="--seqs 8 --layers 1 --prompt 32768 --head-dim 128 --kv-heads 8 --group 4 --steps 12 --chunk-pages 32 --no-verify --no-reference --json --probe-attention --experts 8 --top-k 2 --scheduler none"
printf '[workload]\nsink_boost = 0.0\nheavy_boost = 0.0\nheavy_fraction = 0.0\n' > /tmp/zero.toml
mark "bench full"; $B bench attend --batch 8 --tokens 32768 --chunk-pages 32 --json 2>/dev/null | grep attend_decode | cut -c1-400
mark "bench quick"; $B bench attend --quick --batch 8 --tokens 32768 --chunk-pages 32 --reps 20 --json 2>/dev/null | grep attend_decode | cut -c1-400
mark "bench 32780 tokens"; $B bench attend --batch 8 --tokens 32780 --chunk-pages 32 --json 2>/dev/null | grep attend_decode | cut -c1-400
mark "demo probe"; $B demo $S 2>/dev/null | grep -E '"probe"' | cut -c1-600
mark "demo probe, no planted keys"; $B demo $S --config /tmp/zero.toml 2>/dev/null | grep -E '"probe"' | cut -c1-600
mark "demo probe, bench fill"; EXPERTKV_PROBE_BENCH_FILL=1 $B demo $S 2>/dev/null | grep -E '"probe"' | cut -c1-600
mark "bench quick again"; $B bench attend --quick --batch 8 --tokens 32768 --chunk-pages 32 --reps 20 --json 2>/dev/null | grep attend_decode | cut -c1-400
mark done
kill $CLK
python3 - "$OUT/clk.csv" <<'PY'
import sys
rows=[l.strip().split(', ') for l in open(sys.argv[1]) if l.strip()]
print(f"{len(rows)} clock samples")
last=None
for r in rows:
    key=(r[1], r[2], r[3])
    if key!=last:
        print(' '.join(r)); last=key
PY
