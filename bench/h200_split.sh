#!/usr/bin/env bash
# One GPU budget split between K/V pages and experts, traded: the synthetic MoE file of
# bench/h200_experts.sh's "small" shape (8 layers, 8 experts of 1024 x 2816, top 2, Q4_K), a
# prompt of about 2,000 tokens and 64 more generated, under one --gpu-mem total that holds the
# full cache's pool and 2.8 expert slots per layer. H2O at 100%, 50% and 25% of the context: a
# smaller K/V budget is a smaller pool (H2O keeps every list to its budget), so the planner gives
# the rest to expert slots. Each a fresh process, twice: tokens/s, slots, allocation, hits, and
# how many generated tokens match the full cache's before the first that differs (the quality the
# K/V budget costs on these random weights). Needs .bin/expertkv.xz and the Vulkan loader in .gl/.
set -u
. bench/lib.sh
h200_binary || exit 1
F=$(moe_file small) || exit 1
P=$(python3 -c 'print(("the budget holds the pages and the experts that fit; " * 40)[:2000])')
run() { $B run --model $F --prompt "$P" --tokens 64 --json "$@" 2>&1 | grep '^{' | tail -1; }
full=$(run --gpu-mem 64G --scheduler h2o --budget 100%)
echo "$full" > /tmp/split_full.json
read -r kv per fixed < <(python3 -c '
import json, sys
g = json.load(open("/tmp/split_full.json"))["gpu_mem"]; fixed = 8 * 8 * 4
print(g["kv_bytes"], (g["expert_bytes"] - fixed) // 8, fixed)')
total=$(python3 -c "print(int($kv + $fixed + 2.8 * $per))")
echo "{\"total_gpu_mem\": $total, \"full_kv_bytes\": $kv, \"slot_bytes\": $per}"
python3 - "$full" <<'PY'
import json, sys
j = json.loads(sys.argv[1]); g = j["gpu_mem"]
print(json.dumps({"row": "all resident, full cache (--gpu-mem 64G)", "tokens_per_s": round(j["tokens_per_s"], 1), "kv_bytes": g["kv_bytes"], "expert_bytes": g["expert_bytes"], "prompt": len(j["prompt_ids"])}))
PY
for b in 100% 50% 25%; do
  for rep in 1 2; do
    r=$(run --gpu-mem $total --scheduler h2o --budget $b)
    python3 - "$r" "$full" "$b" <<'PY'
import json, sys
j = json.loads(sys.argv[1]); f = json.loads(sys.argv[2]); g = j["gpu_mem"]; c = j.get("expert_cache") or {}
got, want = j["generated_ids"], f["generated_ids"]
first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
print(json.dumps({"row": f"h2o {sys.argv[3]}", "tokens_per_s": round(j["tokens_per_s"], 1), "slots": g["slots_per_layer"],
                  "kv_bytes": g["kv_bytes"], "expert_bytes": g["expert_bytes"], "allocated": g["allocated"], "budget": g["budget"],
                  "hit_rate": round(c.get("hit_rate", 1.0), 3), "same_tokens_as_full_cache_until": f"{first}/{len(want)}"}))
PY
  done
done
