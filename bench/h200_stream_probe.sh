#!/usr/bin/env bash
# Knobs and stages of the int4 stream kernel (attend/split_quant_stream.wgsl) on the lent H200,
# one `expertkv bench attend` per line of $CASES ("ENV=V ... -- bench arguments"; ENV among
# EXPERTKV_STREAM_ABLATE (stages left out, wrong results) and EXPERTKV_STREAM_RAW=0 (raw pages
# left to the raw pass)), each line its own process. Full JSON under $OUT.
. bench/lib.sh
h200_setup
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=.bin/expertkv
while IFS= read -r line; do
    [ -z "$line" ] && continue
    envs=${line%%--*}; args=${line#*-- }
    env $envs $B bench attend --json --reps ${REPS:-30} $args 2>>"$OUT/err.txt" | tee -a "$OUT/probe.jsonl" | attend_rows "$envs| $args"
done <<< "$CASES"
tail -3 "$OUT/err.txt"
