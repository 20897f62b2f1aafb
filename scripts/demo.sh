#!/usr/bin/env bash
# The main job on the built-in workload: `expertkv demo` (decode steps of the pipeline on the
# synthetic MoE workload, checked against the CPU reference). Extra arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_gpu
quiet_mesa
cargo run --release --locked -q -p expertkv -- demo "$@"
