#!/usr/bin/env bash
# The whole test suite: shader validation (naga), CPU references, and every GPU kernel against
# its reference on the machine's adapter (Mesa lavapipe when there is no GPU, installed here).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_gpu
quiet_mesa
cargo test --workspace --locked "$@"
