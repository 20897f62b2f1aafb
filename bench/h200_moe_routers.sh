#!/usr/bin/env bash
# MoEfication's routers on the H200 in one call: the eval table of SmolLM2-135M MoEfied at
# E=8 k=2/4/6 and E=16 k=4, the experts chosen by the centroid routers and by the routers fitted
# to the experts' activation mass on the calibration text (`--moe E:K:fitted`), on the shipped
# text; and tokens/s of E=8 k=2 fitted, 200 steps back to back (the fitted router is the same
# [E][hidden] product as the centroids, so the speed should not change).
# Needs .bin/expertkv and models/SmolLM2-135M-Instruct.Q4_1.gguf there, sent in two parts as
# bench/h200_model.sh says.
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=.bin/expertkv
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
sha256sum models/SmolLM2-135M-Instruct.Q4_1.gguf
echo "== run --moe 8:2:fitted"
$B run --time-steps 200 --tokens 64 --moe 8:2:fitted 2>&1 | grep -v '^$' | tail -6
echo "== eval"
$B eval --tokens 256 --schedulers none --needle-filler 128 --moe 8:2,8:2:fitted,8:4,8:4:fitted,8:6,8:6:fitted,16:4,16:4:fitted 2>&1 | grep -v '^$' | tail -24
