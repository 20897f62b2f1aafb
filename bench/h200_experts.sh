#!/usr/bin/env bash
# Expert tiers on a GPU. First the host-to-GPU bandwidth (`bench upload`: wgpu's write_buffer,
# and a copy from a host-memory buffer, the path an expert fetch takes). Then synthetic MoE
# files (8 experts, top 2, Q4_K) decoded with every expert resident, and with 2 of 8 slots per
# layer (25% of the expert bytes), 4 of 8 (50%) and 6 of 8, on demand and with pre-gating
# prefetch, under each eviction policy where it can differ (at 2 slots every policy must evict
# the same), each a fresh process of 64 tokens, every row REPEAT times (default 2): tokens/s, hits, prefetch accuracy, bytes moved per token, and the
# zero-hit bound (every routed expert's bytes per token over the measured link) and the bound
# the bytes actually moved set. Needs .bin/expertkv.xz and the Vulkan loader in .gl/.
#   SHAPES="small mixtral" (default): small = 8 layers of 1024 x 2816 (4.9 MB an expert);
#   mixtral = 4 layers of Mixtral-8x7B's width, 4096 x 14336 (99 MB an expert); smollm2 =
#   SmolLM2-135M MoEfied, 8 experts, top 4 (lib.sh's moe_file; needs the model in models/).
#   TOPK (default 2): the files' experts per token, for the zero-hit bound. MODES: the rows,
#   comma-separated (default below; "all" or "SLOTS PREFETCH POLICY"). TOKENS (default 64).
set -u
. bench/lib.sh
h200_binary || exit 1
$B bench upload --json > /tmp/upload.jsonl || exit 1
python3 - <<'PY'
import json
for l in open("/tmp/upload.jsonl"):
    r = json.loads(l)
    if r["kernel"] == "upload":
        print(json.dumps({"upload": r["variant"], "bytes": r["bytes"], "median_ms": round(r["median_ms"], 3), "gbps": round(r["gbps"], 2), "adapter": r["adapter"]}))
PY
link=$(python3 -c '
import json
print(max(json.loads(l)["gbps"] for l in open("/tmp/upload.jsonl") if json.loads(l).get("variant") == "host_copy"))')
P="the budget holds the experts that fit"
for shape in ${SHAPES:-small mixtral}; do
  F=$(moe_file $shape) || exit 1
  IFS=, read -r -a modes <<< "${MODES:-all,2 none lru,2 pregate lru,4 none lru,4 none lfu,4 none score,4 pregate lru,4 pregate score,6 none lru}"
  for mode in "${modes[@]}"; do
   for rep in $(seq ${REPEAT:-2}); do
    set -- $mode
    if [ "$1" = all ]; then extra=""; else extra="--expert-slots $1 --expert-prefetch $2 --expert-policy $3"; fi
    out=$($B run --model $F --prompt "$P" --tokens ${TOKENS:-64} --json $extra 2>&1 | grep '^{' | tail -1)
    python3 - "$out" "$shape" "$mode" "$link" "${TOPK:-2}" <<'PY'
import json, sys
j = json.loads(sys.argv[1]); c = j.get("expert_cache") or {}; link = float(sys.argv[4]); k = int(sys.argv[5])
fed = len(j["prompt_ids"]) + len(j["generated_ids"])
row = {"shape": sys.argv[2], "mode": sys.argv[3], "tokens_per_s": round(j["tokens_per_s"], 1),
       "tpot_ms_p50": round(j["tpot_ms_p50"], 2), "tpot_ms_p99": round(j["tpot_ms_p99"], 2), "generated": j["generated_ids"][:6]}
if c:
    per_tok = c["bytes_moved"] / fed
    row.update({"hit_rate": round(c["hit_rate"], 3), "misses": c["misses"], "prefetched": c["prefetched"],
                "prefetch_used": c["prefetch_used"], "MB_moved_per_token": round(per_tok / 1e6, 2),
                "bound_tokens_per_s_at_link": round(link * 1e9 / per_tok, 1) if per_tok else None,
                # Every routed expert fetched: top k of the 8 experts' bytes in every layer.
                "zero_hit_bound_tokens_per_s": round(link * 1e9 / (k * c["host_bytes"] / 8), 1)})
print(json.dumps(row))
PY
   done
  done
done
