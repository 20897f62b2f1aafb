#!/usr/bin/env bash
# The browser demo: the pipeline and the viewer compiled to wasm32, on WebGPU.
#   scripts/web.sh build        build web/www/pkg (installs what it needs, see below)
#   scripts/web.sh serve [PORT] build, then serve web/www on http://127.0.0.1:PORT (default 8088)
#   scripts/web.sh test         build, run web/browser.toml natively for its checksum, then load the
#                               page in headless Chromium (WebGPU on SwiftShader) and require the
#                               same checksum; also checks the no-WebGPU message. Screenshot:
#                               target/web/browser.png
#
# Tools (installed when missing): Debian's rustc-web, cargo-web, rust-web-src and lld-22 (the rustup
# toolchain has no wasm32 std; Debian's compiler builds one from source with -Z build-std),
# chromium, nodejs/npm; wasm-bindgen-cli of the version in Cargo.lock, built once into
# EXPERTKV_TOOLS (default ~/.cache/expertkv/tools) and reused; playwright-core from npm into
# web/tests/node_modules (it drives /usr/bin/chromium and never downloads a browser).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
tools=${EXPERTKV_TOOLS:-$HOME/.cache/expertkv/tools}
out=$root/target/web
www=$root/web/www

log() { echo "web: $*" >&2; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
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
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    [ -x /usr/lib/llvm-22/bin/wasm-ld ] || { log "error: /usr/lib/llvm-22/bin/wasm-ld missing after installing lld-22"; exit 1; }
    # playwright-core 1.57 (web/tests/package.json) runs on Node.js 18 (Debian bookworm's) and newer.
    node -e 'process.exit(parseInt(process.versions.node, 10) >= 18 ? 0 : 1)' ||
        { log "error: Node.js 18 or newer needed for the browser test, found $(node --version)"; exit 1; }
}

bindgen_version() {
    awk '/^name = "wasm-bindgen"$/ { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock
}

ensure_bindgen() {
    local v
    v=$(bindgen_version)
    [ -n "$v" ] || { log "error: no wasm-bindgen in Cargo.lock"; exit 1; }
    bindgen=$tools/bin/wasm-bindgen
    if [ -x "$bindgen" ] && "$bindgen" --version | grep -qx "wasm-bindgen $v"; then
        return
    fi
    log "building wasm-bindgen-cli $v once into $tools (about 9 minutes on 2 cores; reused afterwards)"
    # Not --locked: one of its locked dependency versions is gone from the registry.
    cargo install -q wasm-bindgen-cli --version "$v" --root "$tools" --force
}

build() {
    ensure_debs
    ensure_bindgen
    log "compiling expertkv-web for wasm32 (Debian's rustc with build-std)"
    # Debian's cargo and rustc, never rustup's; a target folder of their own.
    env -u RUSTUP_TOOLCHAIN RUSTC=/usr/bin/rustc RUSTDOC=/usr/bin/rustdoc RUSTC_BOOTSTRAP=1 \
        CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_LINKER=/usr/lib/llvm-22/bin/wasm-ld \
        /usr/bin/cargo build --locked --release -p expertkv-web --target wasm32-unknown-unknown \
        -Z build-std=std,panic_abort --target-dir "$root/target-wasm"
    local wasm=$root/target-wasm/wasm32-unknown-unknown/release/expertkv_web.wasm
    rm -rf "$www/pkg"
    "$bindgen" --target web --no-typescript --out-dir "$www/pkg" "$wasm"
    log "built $www/pkg ($(du -h "$www/pkg/expertkv_web_bg.wasm" | cut -f1) of wasm)"
}

# A static server on 127.0.0.1; prints its port. Serves .wasm as application/wasm.
start_server() {
    local port=$1
    python3 - "$www" "$port" <<'EOF' &
import functools, http.server, socketserver, sys
root, port = sys.argv[1], int(sys.argv[2])
class H(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".wasm": "application/wasm", ".js": "text/javascript"}
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

cmd=${1:-}
case "$cmd" in
build)
    build
    ;;
serve)
    build
    port=${2:-8088}
    start_server "$port"
    log "open http://127.0.0.1:$port/ in a browser with WebGPU (Ctrl-C stops)"
    wait "$server_pid"
    ;;
test)
    build
    . scripts/lib.sh
    ensure_gpu
    quiet_mesa
    mkdir -p "$out"
    steps=$(awk -F' *= *' '/^steps/ { print $2; exit }' web/browser.toml)
    log "native run of web/browser.toml ($steps steps) for the expected checksum"
    expected=$(cargo run -q --locked -p expertkv -- demo --config web/browser.toml --checksum --json | \
        sed -n 's/.*"checksum":"\(0x[0-9a-f]*\)".*/\1/p' | tail -1)
    [ -n "$expected" ] || { log "error: the native run printed no checksum"; exit 1; }
    log "native checksum $expected"
    (cd web/tests && npm ci --no-audit --no-fund --silent)
    port=$(free_port)
    start_server "$port"
    trap 'kill $server_pid 2>/dev/null || true' EXIT
    sleep 1
    node web/tests/e2e.mjs "http://127.0.0.1:$port/" "$expected" "$steps" "$out/browser.png"
    ;;
*)
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
