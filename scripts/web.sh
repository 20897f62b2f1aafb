#!/usr/bin/env bash
# The browser demo: the pipeline and the viewer compiled to wasm32, on WebGPU.
#   scripts/web.sh build        build web/www/pkg in the release profile (installs what it needs)
#   scripts/web.sh serve [PORT] build, then serve web/www on http://127.0.0.1:PORT (default 8088)
#   scripts/web.sh test         build in the web-test profile (release code at opt-level 0, a
#                               third quicker to compile), run web/browser.toml natively for its
#                               checksum and attention fingerprint, then load the page in headless
#                               Chromium (WebGPU on SwiftShader) and require the same checksum and
#                               a fingerprint within tolerance; also checks the no-WebGPU message.
#                               Screenshot: target/web/browser.png
#   scripts/web.sh deps         install the Debian packages only (scripts/test.sh runs this early)
#   scripts/web.sh test-build   the test's build only;  scripts/web.sh test-run  the test without it
#
# Tools (installed when missing): Debian's rustc-web, cargo-web, rust-web-src and lld-22 (the rustup
# toolchain has no wasm32 std; Debian's compiler builds one from source with -Z build-std),
# chromium, nodejs/npm; playwright-core from npm into web/tests/node_modules (it drives
# /usr/bin/chromium and never downloads a browser). The JS glue comes from web/bindgen, a small
# workspace binary over wasm-bindgen's own library at the Cargo.lock version (no wasm-bindgen-cli
# to install: no registry here ships it prebuilt, and building it takes about 9 minutes).
# EXPERTKV_BIN: an expertkv binary for the native run (default: cargo run).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=$root/target/web
www=$root/web/www
. scripts/lib.sh

log() { echo "web: $*" >&2; }
die() {
    log "error: $*"
    exit 1
}

ensure_debs() {
    local missing=() p
    for p in rustc-web cargo-web rust-web-src lld-22 chromium; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    command -v node >/dev/null || missing+=(nodejs)
    command -v npm >/dev/null || missing+=(npm)
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing ${missing[*]} (apt, about 150 MB)"
        apt_install "${missing[@]}" || die "could not install ${missing[*]} (see the apt output above)"
    fi
    [ -x /usr/lib/llvm-22/bin/wasm-ld ] || die "/usr/lib/llvm-22/bin/wasm-ld missing after installing lld-22"
    [ -x /usr/bin/rustc ] && [ -x /usr/bin/cargo ] || die "Debian's rustc/cargo (rustc-web, cargo-web) are missing"
    # playwright-core (web/tests/package.json) runs on Node.js 18 (Debian bookworm's) and newer.
    node -e 'process.exit(parseInt(process.versions.node, 10) >= 18 ? 0 : 1)' ||
        die "Node.js 18 or newer needed for the browser test, found $(node --version)"
}

ensure_playwright() {
    if [ -f web/tests/node_modules/playwright-core/package.json ]; then
        return
    fi
    log "installing playwright-core from npm (no browser download)"
    (cd web/tests && with_timeout 300 npm ci --no-audit --no-fund --silent) ||
        die "npm ci in web/tests failed (is the npm registry reachable?)"
}

# The JS glue tool, built with rustup's cargo into its own target folder (so it never waits on
# the test build's lock).
ensure_bindgen() {
    log "building web/bindgen (wasm-bindgen's library at the Cargo.lock version)"
    cargo build -q --locked -p expertkv-bindgen --target-dir "$root/target/tools" || die "building expertkv-bindgen failed"
    bindgen=$root/target/tools/debug/expertkv-bindgen
}

# compile PROFILE: the wasm32 build with Debian's cargo and rustc, a target folder of their own.
compile() {
    local profile=$1
    log "compiling expertkv-web for wasm32, profile $profile (Debian's rustc with build-std)"
    env -u RUSTUP_TOOLCHAIN -u RUSTC -u RUSTDOC -u CARGO_BUILD_RUSTC RUSTC=/usr/bin/rustc RUSTDOC=/usr/bin/rustdoc RUSTC_BOOTSTRAP=1 \
        CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_LINKER=/usr/lib/llvm-22/bin/wasm-ld \
        /usr/bin/cargo build --locked --profile "$profile" -p expertkv-web --target wasm32-unknown-unknown \
        -Z build-std=std,panic_abort --target-dir "$root/target-wasm" || die "the wasm32 build failed"
    wasm=$root/target-wasm/wasm32-unknown-unknown/$profile/expertkv_web.wasm
}

glue() {
    rm -rf "$www/pkg"
    "$bindgen" --out-dir "$www/pkg" "$wasm" || die "the JS glue step failed"
    log "built $www/pkg ($(du -h "$www/pkg/expertkv_web_bg.wasm" | cut -f1) of wasm)"
}

build() {
    local profile=$1
    ensure_debs
    compile "$profile"
    ensure_bindgen
    glue
}

# A static server on 127.0.0.1; prints its port. Serves .wasm as application/wasm; web/www at
# /, the JS API example page (examples/web) at /examples/, and the test's files ($out) at /data/.
start_server() {
    local port=$1
    mkdir -p "$out"
    python3 - "$www" "$port" "$root/examples/web" "$out" <<'EOF' &
import functools, http.server, os, socketserver, sys
root, port, examples, data = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
class H(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".wasm": "application/wasm", ".js": "text/javascript"}
    def translate_path(self, path):
        for prefix, folder in (("/examples/", examples), ("/data/", data)):
            if path.startswith(prefix):
                rel = path[len(prefix):].split("?", 1)[0].split("#", 1)[0]
                full = os.path.normpath(os.path.join(folder, rel))
                return full if full.startswith(os.path.normpath(folder)) else folder
        return super().translate_path(path)
    def log_message(self, *a):
        pass
socketserver.TCPServer.allow_reuse_address = True
with socketserver.TCPServer(("127.0.0.1", port), functools.partial(H, directory=root)) as s:
    print(f"serving {root} on http://127.0.0.1:{s.server_address[1]}/", flush=True)
    s.serve_forever()
EOF
    server_pid=$!
}

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# The page against the native run (the build must be there).
run_test() {
    [ -f "$www/pkg/expertkv_web_bg.wasm" ] || die "no build in $www/pkg (scripts/web.sh test-build)"
    ensure_gpu
    quiet_mesa
    ensure_playwright
    mkdir -p "$out"
    local steps native
    steps=$(awk -F' *= *' '/^steps/ { print $2; exit }' web/browser.toml)
    log "native run of web/browser.toml ($steps steps) for the expected checksum and fingerprint"
    native=$out/native.json
    local run=(cargo run -q --locked -p expertkv --)
    [ -z "${EXPERTKV_BIN:-}" ] || run=("$EXPERTKV_BIN")
    "${run[@]}" demo --config web/browser.toml --checksum --json >"$out/native.out" || die "the native run failed (see $out/native.out)"
    grep '"checksum"' "$out/native.out" | tail -1 >"$native" || true
    grep -q '"checksum":"0x' "$native" || die "the native run printed no checksum (see $out/native.out)"
    log "native: $(cut -c1-80 "$native")..."
    # The JS API's check: a small synthetic model decoded natively, its token ids expected.
    local api=$out/api.json prompt="The capital of France is" n=12
    # An LM head of its own, so the tokens depend on the whole forward pass (a tied random model
    # repeats its last token); H2O keeping 16 tokens with the recall tier attending 2 of each
    # list's evicted pages (in device memory on WebGPU), so the policy reaches the page too.
    "${run[@]}" synth --out "$out/model.gguf" --experts 0 --seed 4 --untied-output >/dev/null || die "writing the synthetic model failed"
    "${run[@]}" run --model "$out/model.gguf" --prompt "$prompt" --tokens "$n" --scheduler h2o --budget 16 --recall 2 --json >"$out/api-native.out" ||
        die "the native run of the synthetic model failed (see $out/api-native.out)"
    tail -1 "$out/api-native.out" | python3 -c '
import json, sys
r = json.loads(sys.stdin.read())
json.dump({"prompt": sys.argv[1], "tokens": int(sys.argv[2]), "policy": {"scheduler": "h2o", "budget": "16", "recall": 2},
           "generated_ids": r["generated_ids"]}, sys.stdout)' "$prompt" "$n" >"$api" ||
        die "the native run printed no JSON (see $out/api-native.out)"
    local port
    port=$(free_port)
    start_server "$port"
    trap 'kill $server_pid 2>/dev/null || true' EXIT
    local i
    for i in $(seq 50); do
        curl -fs -o /dev/null "http://127.0.0.1:$port/" && break
        kill -0 "$server_pid" 2>/dev/null || die "the page server did not start"
        [ "$i" != 50 ] || die "the page server did not answer within 10 s"
        sleep 0.2
    done
    with_timeout 900 node web/tests/e2e.mjs "http://127.0.0.1:$port/" "$native" "$steps" "$out/browser.png" "$api"
}

cmd=${1:-}
case "$cmd" in
deps)
    ensure_debs
    ensure_playwright
    ;;
build)
    build release
    ;;
serve)
    build release
    port=${2:-8088}
    start_server "$port"
    log "open http://127.0.0.1:$port/ (the demo) or http://127.0.0.1:$port/examples/ (a GGUF model through the JS API) in a browser with WebGPU (Ctrl-C stops)"
    wait "$server_pid"
    ;;
test-build)
    build web-test
    ;;
test-run)
    run_test
    ;;
test)
    build web-test
    run_test
    ;;
*)
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
