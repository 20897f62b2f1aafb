#!/usr/bin/env bash
# FlexGen's host tier beside an expert cache (one transfer schedule for K/V pages and experts):
# lib.sh's kv8 file (8 layers, 8 experts of 1024 x 2816 Q4_K, top 2, 32 KiB of K/V a token), a
# PROMPT_TOKENS-byte prompt (default 1500) then TOKENS generated (default 128), run five ways:
# everything resident; FlexGen's GPU tier of BUDGET tokens (default 256) with every expert;
# SLOTS expert slots (default 4) with pre-gating and the whole context; both tiers with and
# without pre-gating. One JSON line each: tokens/s, TPOT, bytes moved for K/V and weights, the
# schedule's totals, and the first generated ids (equal between runs that share a host tier).
# Needs .bin/expertkv.xz and the Vulkan loader in .gl/.
set -u
. bench/lib.sh
h200_binary || exit 1
F=$(moe_file kv8) || exit 1
P=$(python3 -c "import random; r = random.Random(7); print(''.join(r.choice('abcdefghij klmnop') for _ in range(${PROMPT_TOKENS:-1500})))")
BUDGET=${BUDGET:-256}; SLOTS=${SLOTS:-4}
fg="--scheduler flexgen --budget $BUDGET"; cache="--expert-slots $SLOTS"
while IFS='|' read -r label args; do
  # shellcheck disable=SC2086
  $B run --model "$F" --prompt "$P" --tokens "${TOKENS:-128}" --json $args 2>&1 | python3 -c '
import json, sys
label = sys.argv[1]
lines = sys.stdin.read().splitlines()
js = [l for l in lines if l.startswith("{")]
if not js:
    print(label, "FAILED:", " | ".join(lines[-3:])); sys.exit()
j = json.loads(js[-1]); e = j.get("expert_cache") or {}; f = j.get("flexgen") or {}; t = j.get("transfers") or {}
print(json.dumps({"run": label, "tokens_per_s": round(j["tokens_per_s"], 1), "tpot_ms_p50": round(j["tpot_ms_p50"] or 0, 2),
  "tpot_ms_p99": round(j["tpot_ms_p99"] or 0, 2), "ttft_s": round(j["ttft_s"], 2), "kv_MB_to_gpu": round(f.get("bytes_to_gpu", 0) / 1e6, 1),
  "kv_MB_to_host": round(f.get("bytes_to_host", 0) / 1e6, 1), "expert_MB_to_gpu": round(e.get("bytes_moved", 0) / 1e6, 1),
  "hit_rate": round(e.get("hit_rate", 1), 3), "tier_read_s": round(t.get("tier_read_s", 0), 2), "tier_host_s": round(f.get("host_s", 0), 2),
  "tier_page_read_s": round(f.get("page_read_s", 0), 2), "prefill_s": round(j["prefill_s"], 2), "decode_s": round(j["decode_s"], 2), "steps_moving_both": t.get("steps_moving_both", 0), "steps_moving": t.get("steps_moving", 0),
  "generated": j["generated_ids"][:12]}))
' "$label"
done <<RUNS
all resident|
flexgen $BUDGET, every expert|$fg
$SLOTS slots pregate, whole context|$cache --expert-prefetch pregate
flexgen $BUDGET + $SLOTS slots pregate|$fg $cache --expert-prefetch pregate
flexgen $BUDGET + $SLOTS slots on demand|$fg $cache
RUNS
