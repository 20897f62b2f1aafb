#!/usr/bin/env bash
# The prefill chunk (`run --prefill-chunk N`, default 64) on the GPU machine, in one call:
# prefill tokens/s of a 2,000-token prompt at chunks of 16 to 1024 tokens, each a fresh process,
# REPEAT runs a row (default 2), on two synthetic Q4_K files written here: 4 layers of
# Llama-3-8B's width (dense, 4096 x 14336, 32 heads, 8 KV heads) and 4 layers of Mixtral-8x7B's
# width (lib.sh's `moe_file mixtral`, 8 experts, top 2). Each row: time to first token (setup of
# the prefill's buffers and kernels included) and the GPU time of the prefill's passes
# (`--profile`: timestamps between them). Needs .bin/expertkv.xz and the Vulkan loader in .gl/.
set -u
. bench/lib.sh
h200_binary || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
dense=/root/llama8b4.gguf
[ -s "$dense" ] || $B synth --out "$dense" --layers 4 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --experts 0 \
  --weights q4_k --untied-output --context 4096 | tail -1
moe=$(moe_file mixtral) || exit 1
# About 2,000 tokens of the synthetic byte-level vocabulary (a token a byte).
prompt=$(python3 -c 'print(("The capital of France is Paris, and the river is the Seine. " * 40)[:2000])')
for f in "$dense" "$moe"; do
  for c in ${CHUNKS:-16 32 64 128 256 512 1024}; do
    for r in $(seq "${REPEAT:-2}"); do
      $B run --model "$f" --prompt "$prompt" --tokens 2 --prefill-chunk "$c" --profile --json 2>&1 |
        python3 -c '
import json, sys
run = gpu = None
for line in sys.stdin:
    if line.startswith("{"):
        j = json.loads(line)
        if "prefill_tokens_per_s" in j:
            run = j
        elif j.get("measure") == "gpu_stages":
            gpu = j
n = len(run["prompt_ids"])
ttft, tps = run["prefill_s"], run["prefill_tokens_per_s"]
pf = (gpu or {}).get("prefill") or {}
g = pf.get("total_ms", float("nan"))
print(sys.argv[1], "chunk", sys.argv[2], "run", sys.argv[3], "prompt %d tokens: TTFT %.4f s, %.1f tokens/s;" % (n, ttft, tps),
      "GPU time of the prefill passes %.2f ms, %.1f tokens/s;" % (g, n / g * 1e3), "chunked", run["prefill_chunked"], "passes", pf.get("recordings"))
' "$(basename "$f")" "$c" "$r"
    done
  done
done
