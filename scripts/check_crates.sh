#!/usr/bin/env bash
# The library as a registry would take it: `cargo doc --no-deps` over the workspace with every
# rustdoc warning an error (missing docs, broken intra-doc links), then `cargo package
# --no-verify` of every crate (metadata, the files each would ship). CI runs it after
# scripts/test.sh; it needs only the Rust toolchain (a few minutes on two cores, most of it
# type-checking the dependencies for rustdoc).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
echo "check_crates: cargo doc --no-deps --workspace (warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace --locked --quiet
echo "check_crates: cargo package --no-verify --workspace"
cargo package --no-verify --workspace --locked --allow-dirty --quiet
for c in target/package/*.crate; do
    echo "  $(basename "$c") $(du -h "$c" | cut -f1)"
done
echo "check_crates: done in $(($(date +%s) - t0)) s"
