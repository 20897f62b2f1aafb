#!/usr/bin/env bash
# The KV page store's figures (BENCHMARKS.md, "The KV page store"), on whatever adapter the
# machine has, against a Redis server this script starts on a free loopback port:
#   1. store and fetch throughput of `expertkv store bench` (pipelined SETs, MGETs of 12 KiB
#      values: a raw f16 page of SmolLM2) against `redis-benchmark` for the same value size and
#      pipeline depth on the same server;
#   2. time to first token of SmolLM2 for prompts of about 2K and 8K tokens (2,319 and 7,978:
#      SmolLM2's context is 8,192, and a size of N gives 1.13-1.19 N tokens): a cold prefill
#      (storing its pages), then three more processes with the same prompt (its prefix
#      fetched), then the same prompt with no store at all, each a fresh process.
# Usage: bash bench/kv_store.sh [BIN] [SIZES...]   (BIN: target/release/expertkv; SIZES: 2048 6700;
# 0: the throughput only). RUNS="cold warm" runs only those.
# Needs redis-server and redis-benchmark (Debian's redis-server package) and the model
# (scripts/fetch_model.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/expertkv}
shift || true
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(2048 6700)
command -v redis-server >/dev/null || {
    echo "error: redis-server is missing (apt-get install redis-server)" >&2
    exit 1
}
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no >/dev/null 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
url=redis://127.0.0.1:$port/0
echo "# $(date -u +%FT%TZ), $(nproc) cores, $(redis-server --version | cut -d' ' -f1-3)"

echo "== throughput, 12 KiB values, 256 keys per round trip"
"$bin" store bench --kv-store "$url" --value-bytes 12K --values 4000 --rounds 5
# One connection, as expertkv uses, then redis-benchmark's default 50.
for clients in 1 50; do
    redis-benchmark -p "$port" -c $clients -d 12288 -t set,get -n 40000 -P 256 -q | tr '\r' '\n' |
        grep 'requests per second' |
        awk -v c=$clients '{ printf "redis-benchmark, %d connection(s): %s %s requests/s = %.3f GB/s\n", c, $1, $2, $2 * 12288 / 1e9 }'
done

[ "${sizes[0]}" != 0 ] || exit 0

# A prompt of about N tokens: the project's own docs, repeated as needed (about 4 characters a
# token in SmolLM2's vocabulary; the JSON line gives the exact count).
prompt_of() {
    python3 - "$1" <<'EOF'
import sys
n = int(sys.argv[1])
text = " ".join(open(f).read() for f in ["README.md", "ARCHITECTURE.md", "BENCHMARKS.md"])
text = " ".join(text.split())
while len(text) < 4 * n:
    text += " " + text
print(text[: int(3.6 * n)])
EOF
}

echo "== time to first token, SmolLM2 (each run a fresh process; the fetch split into the store's replies, checks and the pool's append)"
for n in "${sizes[@]}"; do
    p=$(prompt_of "$n")
    "$bin" store clear --kv-store "$url" --kv-store-namespace bench >/dev/null
    for what in ${RUNS:-cold warm warm warm plain}; do
        args=(run --prompt "$p" --tokens 1 --json)
        [ $what = plain ] || args+=(--kv-store "$url" --kv-store-namespace bench)
        "$bin" "${args[@]}" 2>/dev/null | grep '^{' | python3 -c '
import json, sys
r = json.loads(sys.stdin.read())
s = r.get("kv_store") or {}
print(sys.argv[1], len(r["prompt_ids"]), "tokens: ttft_s", round(r["ttft_s"], 3), "reused", s.get("tokens_reused", 0),
      "fetched_bytes", s.get("bytes_fetched", 0), "fetch_s", round(s.get("fetch_s", 0), 3), "(replies", round(s.get("fetch_get_s", 0), 3),
      "checks", round(s.get("fetch_check_s", 0), 3), "pool", str(round(s.get("fetch_restore_s", 0), 3)) + ")",
      "stored_bytes", s.get("bytes_stored", 0), "store_s", round(s.get("store_s", 0), 3), "adapter", r["adapter"])
' "$what"
    done
done
