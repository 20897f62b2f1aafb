#!/usr/bin/env bash
# A Mixture-of-Experts GGUF through the GPU forward pass on the lent H200: random files of
# SmolLM2-135M's shape written there by `expertkv synth` (30 layers, hidden 576, 9/3 heads of
# 64; F32 weights), dense FFN 1536 against 8 experts of 1536 (top 2, a Mixtral-style file) and
# 8 experts of 192 (top 2, as many neurons per token as SmolLM2 MoEfied at E=8 k=2): tokens/s
# token by token, and 200 steps back to back (the second half timed).
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=.bin/expertkv
S="--layers 30 --hidden 576 --heads 9 --kv-heads 3 --context 2048"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$B synth --out /tmp/dense.gguf $S --experts 0 --ffn 1536
$B synth --out /tmp/e8x1536.gguf $S --experts 8 --top-k 2 --ffn 1536
$B synth --out /tmp/e8x192.gguf $S --experts 8 --top-k 2 --ffn 192
for m in dense e8x1536 e8x192; do
  echo "== $m"
  $B run --time-steps 200 --model /tmp/$m.gguf --prompt "Hello" --tokens 64 2>&1 | grep -E "^model|prefill|decode_steps|routing"
done
