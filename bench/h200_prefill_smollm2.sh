#!/usr/bin/env bash
# The prefill on a small real model, SmolLM2-135M (bench/h200_prefill.sh measures 4-layer files of
# Llama-3-8B's and Mixtral's width): a prompt of the shipped text's first 1,500 words (about
# 2,000 tokens) through `run --prefill-chunk C --profile --json` at chunks of 64 and 256, each a
# fresh process, two runs a row, with .bin/expertkv.xz (`new`) and, where present, .bin/old.xz
# (`old`) in the same call; then PyTorch's one-pass prefill of the same length
# (bench/torch_model.py) where PyTorch is installed. The model goes in two parts over two calls
# as bench/h200_model.sh says (scratch/m1/a, then scratch/m2/b with this script); the joined
# file's sha256 is printed.
set -u
. bench/lib.sh
h200_binary || exit 1
M=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -s "$M" ]; then
  mkdir -p models && cat /root/a scratch/m2/b > "$M" || exit 1
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
sha256sum "$M"
h200_bins
LONG=$(python3 -c 'print(" ".join(open("bench/data/harbour_town.txt").read().split()[:1500]))')
for lb in $bins; do
  label=${lb%%:*} bin=${lb#*:}
  for c in ${CHUNKS:-64 256}; do
    for r in 1 2; do
      $bin run --model "$M" --prompt "$LONG" --tokens 2 --prefill-chunk "$c" --profile --json 2>&1 | prefill_row "$label" SmolLM2 "$c" "$r"
    done
  done
done
if python3 -c 'import torch' 2>/dev/null; then
  python3 bench/torch_model.py --model "$M" --ids 1,2,3 --tokens 1 --bench --batch 1 --prefill 2000 --steps 8 2>&1 | grep '"prefill"\|Error'
fi
