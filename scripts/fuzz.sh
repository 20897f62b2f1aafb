#!/usr/bin/env bash
# Coverage-guided fuzzing of every reader of user data (fuzz/fuzz_targets: gguf, tokenizer,
# trace, config, moe_cache, model_trace) with libFuzzer, on the stable toolchain: the targets are built with
# SanitizerCoverage and AddressSanitizer (RUSTC_BOOTSTRAP=1 unlocks -Zsanitizer; the sanitizer
# runtimes ship with rustup's stable toolchain). Each target starts from its corpus in
# fuzz/corpus/TARGET (small text seeds, kept in the repository) and the binary seeds the `seeds`
# program writes under fuzz/target/seeds/TARGET (synthetic GGUF models and a MoEfication
# cache: no model file is kept in the repository), and runs RUNS executions
# (default 1000000) with a 2048 MB RSS limit and a 256 MB cap on any single allocation;
# crashes land in fuzz/artifacts/TARGET. New corpus entries go to a scratch folder, not the
# repository. Usage: scripts/fuzz.sh [RUNS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-1000000}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(gguf tokenizer trace config moe_cache model_trace)
export RUSTC_BOOTSTRAP=1
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
-Cllvm-args=-sanitizer-coverage-pc-table -Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Zsanitizer=address -Cforce-frame-pointers"
host="$(rustc -vV | sed -n 's/^host: //p')"
t0=$(date +%s)
cargo build --manifest-path fuzz/Cargo.toml --release --target "$host" --bins
echo "fuzz: built in $(( $(date +%s) - t0 )) s"
seeds=fuzz/target/seeds
rm -rf "$seeds"
"fuzz/target/$host/release/seeds" "$seeds"
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t" "$seeds/$t"
  scratch="$(mktemp -d)"
  start=$(date +%s)
  "fuzz/target/$host/release/$t" "$scratch" "fuzz/corpus/$t" "$seeds/$t" -runs="$runs" -rss_limit_mb=2048 -malloc_limit_mb=256 \
    -timeout=10 -max_len=65536 -artifact_prefix="fuzz/artifacts/$t/" -print_final_stats=1 2>&1 | tail -n 14 | sed "s/^/$t: /"
  echo "$t: $runs runs in $(( $(date +%s) - start )) s, no crash, hang or allocation over the cap; corpus grew to $(ls "$scratch" | wc -l) entries (scratch)"
  rm -rf "$scratch"
done
