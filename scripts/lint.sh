#!/usr/bin/env bash
# The linters CI runs (.ci/run): `cargo fmt --check` over the workspace and the fuzz crate, and
# `cargo clippy --workspace --all-targets --locked -- -D warnings` (every crate, test and example,
# the fuzz targets' bodies through the corpus test; a warning is an error). `scripts/lint.sh fmt`
# runs only the first (seconds), `scripts/lint.sh clippy` only the second: about 2 minutes on 2
# cores after scripts/test.sh's build, since clippy type-checks every dependency again as `cargo
# check` does (the test build's artifacts are not metadata-only). CI runs fmt before
# scripts/test.sh and clippy after it, outside the test command's 15 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
need_cargo
what=${1:-all}
t0=$(date +%s)
if [ "$what" = all ] || [ "$what" = fmt ]; then
    echo "lint: cargo fmt --check"
    cargo fmt --all --check
    cargo fmt --manifest-path fuzz/Cargo.toml --all --check
fi
if [ "$what" = all ] || [ "$what" = clippy ]; then
    echo "lint: cargo clippy --workspace --all-targets -- -D warnings"
    cargo clippy --workspace --all-targets --locked --quiet -- -D warnings
fi
echo "lint: done in $(($(date +%s) - t0)) s"
