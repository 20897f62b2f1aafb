#!/usr/bin/env bash
# The int4 tensor-core kernel (attend/split_quant_coop.wgsl) on the lent H200, one call: its
# GPU-vs-CPU test and the tile kernel's (release test binary carried in .bin/gpu-tests), then
# one `expertkv bench attend` per line of $CASES ("ENV=V ... -- bench arguments", ENV among
# EXPERTKV_COOP_NW (at most that many subgroups per workgroup) and EXPERTKV_COOP_ABLATE (stages
# left out, wrong results)), each line its own process, SDPA from the lines that ask for
# --torch. Full JSON under $OUT.
. bench/lib.sh
h200_setup
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=.bin/expertkv
if [ -x .bin/gpu-tests ] && [ "${TESTS:-1}" = 1 ]; then
    .bin/gpu-tests --test-threads 1 --nocapture codec::quant_coop codec::quant_tile 2>&1 \
        | grep -E "^test |test result|worst|panicked|skipped" | tee "$OUT/tests.txt"
fi
while IFS= read -r line; do
    [ -z "$line" ] && continue
    envs=${line%%--*}; args=${line#*-- }
    env $envs $B bench attend --json --reps ${REPS:-30} $args 2>>"$OUT/err.txt" | tee -a "$OUT/probe.jsonl" | attend_rows "$envs| $args"
done <<< "$CASES"
tail -3 "$OUT/err.txt"
