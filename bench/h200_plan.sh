#!/usr/bin/env bash
# The roofline planner on the lent H200: predictions next to measured attention per step.
set -u
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
.bin/expertkv plan --measure --steps 8 --seqs 8 --layers 1 --prompt 16384 --head-dim 128 --kv-heads 8 --group 4 \
  --target-ms 0.1 --page-sizes 8,16,32,64 2>&1
