#!/usr/bin/env bash
# The real-model issue's H200 numbers in one call: tokens/s of SmolLM2-135M dense and MoEfied
# (E=8 k=2, E=16 k=4), and the eval table with codecs and MoEfied models on the shipped text.
# Needs .bin/expertkv and models/SmolLM2-135M-Instruct.Q4_1.gguf there (the file is larger than
# one call carries: send it in parts, see DEVELOPERS notes in BENCHMARKS.md).
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=.bin/expertkv
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
sha256sum models/SmolLM2-135M-Instruct.Q4_1.gguf
for moe in dense 8:2 16:4; do
  echo "== run --moe $moe"
  $B run --tokens 64 --moe "$moe" 2>&1 | grep -v '^$' | tail -4
done
echo "== eval"
$B eval --tokens 256 --schedulers none --needle-filler 128 --codecs int8,int4,int4:group=64,fastv-dims --moe 8:2,16:4 2>&1 | grep -v '^$' | tail -12
