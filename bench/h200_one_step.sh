#!/usr/bin/env bash
# The decode step written once (core/src/step/) on the GPU machine, in one call: every row runs
# the new binary (.bin/expertkv.xz) and, where .bin/old.xz is carried, the old one in the same
# call, alternating, each in a fresh process, REPEAT times (default 2):
#   - decode steps back to back (`run --time-steps 200`): batch 1 on a SmolLM2-shaped synthetic
#     file (30 layers of 576, 9/3 heads, FFN 1536, Q4_1) and on 4 layers of Llama-3-8B's width
#     (Q4_K); batch 32 on the SmolLM2-shaped file (tokens/s, wall and host ms a step, dispatches);
#   - the synthetic pipeline's decode step (`demo`, no lockstep, no full-cache reference; H2O at
#     25%, 8 sequences, 4 layers, a 4,096-token prompt): median GPU and host ms a step;
#   - the prefill of a 2,000-token prompt at 256 tokens a chunk on the dense and on the
#     Mixtral-width MoE file (lib.sh's `moe_file mixtral`): time to first token;
#   - with .bin/gpu-tests.xz (the `gpu` test binary of expertkv-tests), the step's GPU tests on
#     this GPU first (the pipeline, the model, chunked prefill, the expert cache).
# Needs .bin/expertkv.xz and the Vulkan loader in .gl/. REPEAT and SKIP_TESTS=1 override.
set -u
. bench/lib.sh
h200_binary || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
h200_bins
if [ -s .bin/gpu-tests.xz ] && [ -z "${SKIP_TESTS:-}" ]; then
  xz -dc .bin/gpu-tests.xz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
  (cd tests && timeout 240 /tmp/gpu-tests pipeline:: prefill:: model:: experts:: labels:: 2>&1 | grep -E "^test |test result|panicked|seed")
fi
small=/root/smollm2_shape.gguf
[ -s "$small" ] || $B synth --out "$small" --layers 30 --hidden 576 --heads 9 --kv-heads 3 --ffn 1536 --experts 0 \
  --weights q4_1 --untied-output --context 8192 | tail -1
dense=/root/llama8b4.gguf
[ -s "$dense" ] || $B synth --out "$dense" --layers 4 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --experts 0 \
  --weights q4_k --untied-output --context 4096 | tail -1
moe=$(moe_file mixtral) || exit 1
python3 -c 'print("\n".join("prompt number %d says hello to the GPU" % i for i in range(32)))' > /tmp/prompts32.txt
prompt=$(python3 -c 'print(("The capital of France is Paris, and the river is the Seine. " * 80)[:2000])')
steps_row() { # LABEL BIN FILE ARGS...: one line from `run --time-steps`
  local label=$1 bin=$2 file=$3
  shift 3
  local what="$(basename "$file") $*"
  $bin run --model "$file" --tokens 2 --time-steps 200 --json "$@" 2>&1 | grep '"decode_steps"' | python3 -c '
import json, sys
j = json.loads(sys.stdin.read())
print(sys.argv[1], sys.argv[2], "decode %.1f tokens/s, %.3f ms a step (wall), host %.3f ms, %d dispatches" % (
    j["tokens_per_s"], j["wall_ms_per_step"], j["host_ms_per_step"], j["dispatches_per_step"]))' "$label" "$what"
}
demo_row() { # LABEL BIN
  $2 demo --no-verify --no-reference --steps 64 --seqs 8 --layers 4 --prompt 4096 --budget 25% --json 2>/dev/null | python3 -c '
import json, statistics, sys
gpu, host = [], []
for line in sys.stdin:
    if not line.startswith("{"):
        continue
    j = json.loads(line)
    if isinstance(j.get("gpu"), dict) and "host_ms" in j:
        gpu.append(sum(v for k, v in j["gpu"].items() if k.endswith("_ms")))
        host.append(j["host_ms"])
t = gpu[len(gpu) // 4:]
h = host[len(host) // 4:]
print(sys.argv[1], "demo step (H2O 25%%, 8 x 4 layers x 4096): GPU %.3f ms, host %.3f ms a step (median of %d)" % (
    statistics.median(t), statistics.median(h), len(t)))' "$1"
}
prefill_ttft() { # LABEL BIN FILE
  $2 run --model "$3" --prompt "$prompt" --tokens 2 --prefill-chunk 256 --json 2>&1 | grep '"prompt_ids"' | python3 -c '
import json, sys
j = json.loads(sys.stdin.read())
print(sys.argv[1], sys.argv[2], "prefill %d tokens: %.3f s, %.0f tokens/s" % (len(j["prompt_ids"]), j["prefill_s"], j["prefill_tokens_per_s"]))' "$1" "$(basename "$3")"
}
for r in $(seq "${REPEAT:-2}"); do
  for lb in $bins; do
    label=${lb%%:*} bin=${lb#*:}
    steps_row "$label" "$bin" "$small" --prompt "Hi"
    steps_row "$label" "$bin" "$dense" --prompt "Hi"
    steps_row "$label" "$bin" "$small" --prompts /tmp/prompts32.txt --batch 32
    demo_row "$label" "$bin"
    prefill_ttft "$label" "$bin" "$dense"
    prefill_ttft "$label" "$bin" "$moe"
  done
done
