#!/usr/bin/env bash
# Host memory with and without `run --mmap`: the 4-layer Mixtral-width file of
# bench/h200_experts.sh (3.1 GB, experts 3.0 GB) decoded with 2 of 8 expert slots, the peak
# anonymous and file-backed resident memory of each process sampled every 20 ms from
# /proc/PID/status, and the generated tokens compared. Needs .bin/expertkv.xz and .gl/.
set -u
. bench/lib.sh
h200_binary || exit 1
F=$(moe_file mixtral) || exit 1
for m in "" "--mmap"; do
  python3 - $B run --model $F --prompt "the budget holds the experts that fit" --tokens 16 --expert-slots 2 --json $m <<'PY'
import json, subprocess, sys, time
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
peak = {"RssAnon": 0, "RssFile": 0}
while p.poll() is None:
    try:
        for l in open(f"/proc/{p.pid}/status"):
            k = l.split(":")[0]
            if k in peak:
                peak[k] = max(peak[k], int(l.split()[1]))
    except OSError:
        pass
    time.sleep(0.02)
j = json.loads([l for l in p.stdout.read().decode().splitlines() if l.startswith("{")][-1])
print(json.dumps({"mmap": "--mmap" in sys.argv, "peak_anon_MiB": round(peak["RssAnon"] / 1024), "peak_file_MiB": round(peak["RssFile"] / 1024),
                  "host_tier_MiB": round(j["expert_cache"]["host_bytes"] / 2**20), "tokens_per_s": round(j["tokens_per_s"], 1), "generated": j["generated_ids"][:8]}))
PY
done
