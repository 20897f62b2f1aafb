#!/usr/bin/env bash
# The int4 tile kernel on the lent H200 with what its driver compiled kept for disassembly here:
# the tile kernel's GPU-vs-CPU test (release test binary, .bin/gpu-tests), one `expertkv bench
# attend` per line of $CASES ("ENV=V ... -- bench arguments"; BIN=path picks another binary,
# e.g. a build of the previous commit), `shader_stats` for each line of $KERNELS, and the
# driver's disk cache and pipeline-cache blobs packed into $OUT/sass.tgz, for
# `python3 bench/nvsass.py DIR <unpacked folder>` on this machine (nvdisasm from PyPI's
# nvidia-cuda-nvdisasm).
. bench/lib.sh
h200_setup
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export __GL_SHADER_DISK_CACHE=1 __GL_SHADER_DISK_CACHE_PATH=/tmp/sass/glcache __GL_SHADER_DISK_CACHE_SKIP_CLEANUP=1
export SHADER_STATS_DUMP=/tmp/sass/dump
mkdir -p /tmp/sass/glcache /tmp/sass/dump
if [ -x .bin/gpu-tests ] && [ "${TESTS:-1}" = 1 ]; then
    .bin/gpu-tests --test-threads 1 --nocapture ${TEST_FILTER:-compress::quant_tile} 2>&1 \
        | grep -E "^test |test result|worst|panicked" | tee "$OUT/tests.txt"
fi
while IFS= read -r line; do
    [ -z "$line" ] && continue
    envs=${line%%--*}; args=${line#*-- }; bin=.bin/expertkv
    for e in $envs; do case $e in BIN=*) bin=${e#BIN=} ;; esac; done
    env $envs $bin bench attend --json --reps ${REPS:-30} $args 2>>"$OUT/err.txt" | tee -a "$OUT/probe.jsonl" | attend_rows "$envs| $args"
done <<< "$CASES"
i=0
while IFS= read -r line; do
    [ -z "$line" ] && continue
    i=$((i + 1)); echo "== $i: $line"; echo "$line" > /tmp/sass/dump/kernel$i.txt
    SHADER_STATS_DUMP=/tmp/sass/dump/k$i .bin/shader_stats $line 2>&1 | grep -E "Register|Binary|Local|Shared|wrote"
done <<< "$KERNELS"
tar czf "$OUT/sass.tgz" -C /tmp sass
tail -3 "$OUT/err.txt"
