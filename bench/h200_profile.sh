#!/usr/bin/env bash
# Where a step's GPU time goes on the H200 (or H100): SmolLM2-135M's decode at batch 1 and 32
# and the chunked prefill of a 1,845-token prompt, each stage timed with GPU timestamps
# between the passes (`run --profile`; `--time-steps` adds the stages of 5 steps of its run).
# Needs .bin/expertkv and models/SmolLM2-135M-Instruct.Q4_1.gguf (carried in two parts, see
# bench/h200_model_vs_torch.sh).
set -u
. bench/lib.sh
h200_setup
B=.bin/expertkv
M=models/SmolLM2-135M-Instruct.Q4_1.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== batch 1"
$B run --model "$M" --tokens 8 --profile --time-steps 100 --json 2>&1 | tail -2
echo "== batch 32"
python3 -c 'import re; t=open("bench/data/harbour_town.txt").read(); s=[x.strip() for x in re.split(r"(?<=[.!?])\s+", t) if len(x.split()) > 4]; print("\n".join(s[:32]))' > /tmp/prompts32.txt
$B run --model "$M" --prompts /tmp/prompts32.txt --batch 32 --tokens 16 --time-steps 100 --json 2>&1 | tail -2
echo "== prefill"
LONG=$(python3 -c 'import sys; t=open("bench/data/harbour_town.txt").read(); print(" ".join(t.split()[:1500]))')
$B run --model "$M" --prompt "$LONG" --tokens 4 --profile --json 2>&1 | tail -1
