#!/usr/bin/env bash
# The model's decode speed on the H200 with and without the route stage (#29's "not below
# today's model path"): SmolLM2-135M, 64 tokens generated one submission each, then (without a
# scheduler) 200 steps back to back, the second half timed; each configuration in a fresh
# process, twice. Needs .bin/expertkv and the
# model in models/ (see bench/h200_model.sh for carrying it in two parts).
set -u
. bench/lib.sh
h200_setup
B=.bin/expertkv
P="The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
for rep in 1 2; do
  while IFS='|' read -r label args; do
    # shellcheck disable=SC2086
    # Back-to-back timing needs no evicting scheduler (it runs between steps).
    steps="--time-steps 200"; case "$args" in *--scheduler*) steps="";; esac
    out=$($B run --tokens 64 $steps --prompt "$P" $args 2>&1)
    python3 -c '
import json, re, sys
label, out = sys.argv[1], sys.argv[2]
lines = out.strip().splitlines()
m = re.search(r"\(([0-9.]+) tokens/s, one submission per token\)", out)
if not m:
    print(f"{label:<48} failed: {out[-300:]}"); sys.exit()
gen = float(m.group(1))
try:
    back = json.loads(lines[-1])["tokens_per_s"]
except Exception:
    back = float("nan")
print(f"{label:<48} {back:8.1f} tokens/s back to back  {gen:8.1f} tokens/s one submission per token")
' "$label" "$out"
  done <<'CASES'
dense, no route stage|
labels 8:2 (route stage, topk)|--labels 8:2
dense, H2O 50%|--scheduler h2o --budget 50%
int4 pages under H2O 50%|--codec int4 --scheduler h2o --budget 50%
labels 8:2, 4 expert shards, H2O 50%|--labels 8:2 --shards 4 --scheduler h2o --budget 50%
labels 8:2, cache-aware, EKVA, H2O 50%|--labels 8:2 --kv-router cache-aware --shards 4 --scheduler h2o --budget 50% --allocator ekva
moe 8:2 (sparse FFN, route stage)|--moe 8:2
CASES
done
