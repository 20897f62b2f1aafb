#!/usr/bin/env bash
# The real-model issue's H200 numbers in one call: tokens/s of SmolLM2-135M dense and MoEfied
# (E=8 k=2, E=16 k=4), each also as 200 steps back to back (--time-steps, the second
# half timed), and the eval table with codecs (the low-rank ones fitted on the text's first 64
# tokens) and MoEfied models on the shipped text, their experts also chosen by the pipeline's
# routers.
# Needs .bin/expertkv and models/SmolLM2-135M-Instruct.Q4_1.gguf there. The file (98 MB) is larger
# than one call carries (64 MiB), so it goes in two parts over two consecutive calls while the
# machine stays warm: here `head -c 58000000 models/*.gguf > scratch/m1/a` and
# `tail -c +58000001 models/*.gguf > scratch/m2/b`; a first call carries [.gl, scratch/m1], the
# second [.bin, scratch/m2] and runs `cat scratch/m1/a scratch/m2/b > models/<file>` then this
# script, which prints the file's sha256 to check the join.
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=.bin/expertkv
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
sha256sum models/SmolLM2-135M-Instruct.Q4_1.gguf
for moe in dense 8:2 16:4; do
  echo "== run --moe $moe"
  $B run --time-steps 200 --tokens 64 --moe "$moe" 2>&1 | grep -v '^$' | tail -5
done
echo "== eval"
$B eval --tokens 256 --schedulers none --needle-filler 128 --codecs int8,int4,int4:group=64,fastv-dims,low-rank:rank=32,lora:rank=16 --moe 8:2,16:4 --moe-routers load-balance,entropy,hash,adaptive 2>&1 | grep -v '^$' | tail -22
