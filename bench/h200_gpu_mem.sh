#!/usr/bin/env bash
# `run --gpu-mem` on a GPU: a synthetic MoE file (8 layers, 8 experts of 1024 x 2816, top 2,
# Q4_K) decoded with every expert resident, then under budgets that leave 6, 4 and 2 expert
# slots per layer beside the K/V pool: tokens/s, the split, hits and bytes moved, each a fresh
# process (64 tokens, one submission each). Needs .bin/expertkv.xz and the Vulkan loader in .gl/.
set -u
. bench/lib.sh
h200_binary || exit 1
F=/tmp/gpu_mem_moe.gguf
$B synth --out $F --layers 8 --hidden 1024 --heads 16 --kv-heads 4 --ffn 2816 --experts 8 --top-k 2 \
  --weights q4_k --untied-output --context 2048 | tail -1
P="the budget holds the pages and the experts that fit"
run() { $B run --model $F --prompt "$P" --tokens 64 --json "$@" 2>&1 | grep '^{' | tail -1; }
all=$(run --gpu-mem 64G)
python3 - "$all" <<'PY'
import json, sys
j = json.loads(sys.argv[1]); g = j["gpu_mem"]
print(json.dumps({"label": "all resident (--gpu-mem 64G)", "tokens_per_s": round(j["tokens_per_s"], 1), "kv_bytes": g["kv_bytes"], "expert_bytes": g["expert_bytes"], "allocated": g["allocated"], "generated": j["generated_ids"][:6]}))
PY
read -r kv per fixed < <(python3 -c '
import json, sys
g = json.loads(sys.argv[1])["gpu_mem"]; fixed = 8 * 8 * 4
print(g["kv_bytes"], (g["expert_bytes"] - fixed) // 8, fixed)' "$all")
for s in 6 4 2; do
  budget=$((kv + fixed + s * per))
  r=$(run --gpu-mem $budget)
  python3 - "$r" "$s" "$budget" <<'PY'
import json, sys
j = json.loads(sys.argv[1]); g = j["gpu_mem"]; c = j.get("expert_cache") or {}
print(json.dumps({"label": f"--gpu-mem {sys.argv[3]} ({sys.argv[2]} slots)", "tokens_per_s": round(j["tokens_per_s"], 1), "slots": g["slots_per_layer"], "allocated": g["allocated"], "budget": g["budget"], "hit_rate": round(c.get("hit_rate", 0), 3), "bytes_moved": c.get("bytes_moved"), "generated": j["generated_ids"][:6]}))
PY
done
