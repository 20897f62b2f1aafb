#!/usr/bin/env bash
# The prefill on the GPU machine, in one call: prefill tokens/s of a 2,000-token prompt at chunks
# of 16 to 1024 tokens (`run --prefill-chunk N`, default 64), each a fresh process, REPEAT runs a
# row (default 2), on two synthetic Q4_K files written here: 4 layers of Llama-3-8B's width
# (dense, 4096 x 14336, 32 heads, 8 KV heads) and 4 layers of Mixtral-8x7B's width (lib.sh's
# `moe_file mixtral`, 8 experts, top 2). Each row: time to first token (setup of the prefill's
# buffers and kernels included) and the GPU time of the prefill's passes (`--profile`:
# timestamps between them). Then, on the dense file:
#   - the decode step at batch 1 (`run --time-steps 200`), so a prefill change shows what it
#     costs the step;
#   - PyTorch's one-pass prefill of 2,000 tokens (bench/torch_model.py: weights dequantised to
#     f16, SDPA; CUDA events), where PyTorch is installed.
# With .bin/old.xz (an earlier release binary) every row runs with it too, labelled `old`: the
# baseline measured in the same call. With .bin/gpu-tests.xz (the `gpu` test binary of
# expertkv-tests) the products' and the chunked prefill's tests run on this GPU first (the
# prefill's tiled products against the CPU, the same bits in any chunking, the chunked prefill
# against token by token).
# Needs .bin/expertkv.xz and the Vulkan loader in .gl/. CHUNKS, MOE_CHUNKS (empty: no MoE rows),
# REPEAT and PROMPT_TOKENS (default 2000; the files' context is 4096) override.
set -u
. bench/lib.sh
h200_binary || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
h200_bins
if [ -s .bin/gpu-tests.xz ]; then
  xz -dc .bin/gpu-tests.xz > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
  (cd tests && /tmp/gpu-tests ops::matvec_and_embed ops::moe_file_experts prefill::chunked attend::attend_prefill 2>&1 | grep -E "^test |test result|panicked|seed")
fi
dense=/root/llama8b4.gguf
[ -s "$dense" ] || $B synth --out "$dense" --layers 4 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --experts 0 \
  --weights q4_k --untied-output --context 4096 | tail -1
moe=$(moe_file mixtral) || exit 1
# PROMPT_TOKENS tokens of the synthetic byte-level vocabulary (a token a byte).
n_prompt=${PROMPT_TOKENS:-2000}
prompt=$(python3 -c 'import sys; print(("The capital of France is Paris, and the river is the Seine. " * 80)[:int(sys.argv[1])])' "$n_prompt")
row() { # LABEL BIN FILE CHUNK
  for r in $(seq "${REPEAT:-2}"); do
    $2 run --model "$3" --prompt "$prompt" --tokens 2 --prefill-chunk "$4" --profile --json 2>&1 | prefill_row "$1" "$(basename "$3")" "$4" "$r"
  done
}
for lb in $bins; do
  label=${lb%%:*} bin=${lb#*:}
  for c in ${CHUNKS:-16 32 64 128 256 512 1024}; do row "$label" "$bin" "$dense" "$c"; done
  for c in ${MOE_CHUNKS-64 256}; do row "$label" "$bin" "$moe" "$c"; done
  $bin run --model "$dense" --prompt "Hi" --tokens 2 --time-steps 200 --json 2>&1 | grep '"decode_steps"' |
    python3 -c 'import json,sys; j=json.loads(sys.stdin.read()); print(sys.argv[1], "decode batch 1: %.2f tokens/s, %.3f ms a step (wall)" % (j["tokens_per_s"], j["wall_ms_per_step"]))' "$label"
done
if python3 -c 'import torch' 2>/dev/null; then
  ids=$($B run --model "$dense" --prompt "Hi" --tokens 1 --json 2>&1 | grep '"prompt_ids"' |
    python3 -c 'import json,sys; print(",".join(map(str, json.load(sys.stdin)["prompt_ids"])))')
  python3 bench/torch_model.py --model "$dense" --ids "$ids" --tokens 1 --bench --batch 1 --prefill "$n_prompt" --steps 8 2>&1 | grep '"prefill"\|Error'
fi
