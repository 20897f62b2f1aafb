#!/usr/bin/env bash
# #30's comparison on the H200 in one call: SmolLM2-135M from the same GGUF file through expertkv
# and through bench/torch_model.py (dequantised to f16, SDPA, static KV cache; eager and in a
# CUDA graph), each in a fresh process:
#   - the greedy tokens of the same prompt ids (they must be equal);
#   - decode at batch 1 and 32: expertkv's `--time-steps` (steps submitted back to back, the
#     second half timed; batch 32 after a --prompts batch) against torch's eager and graphed;
#   - the prefill of a 2048-token prompt (bench/data/harbour_town.txt): expertkv's chunked
#     prefill (`run --json` prefill_tokens_per_s) against torch's one-pass prefill;
#   - expertkv's dispatches per token.
# Needs .bin/expertkv and models/SmolLM2-135M-Instruct.Q4_1.gguf (carried in two parts, see
# bench/h200_model.sh), and PyTorch with numpy on the machine.
set -u
. bench/lib.sh
h200_setup
B=.bin/expertkv
M=models/SmolLM2-135M-Instruct.Q4_1.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
sha256sum "$M"
P="The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
J=$($B run --model "$M" --prompt "$P" --tokens 32 --json --time-steps 400 2>&1)
echo "$J" | tail -2
IDS=$(echo "$J" | grep '"prompt_ids"' | python3 -c 'import json,sys; print(",".join(map(str, json.load(sys.stdin)["prompt_ids"])))')
python3 bench/torch_model.py --model "$M" --ids "$IDS" --tokens 32 --bench --batch 1,32 --prefill 2048 --steps 64
echo "$J" | grep '"generated_ids"' | python3 -c 'import json,sys; print("expertkv generated_ids", json.load(sys.stdin)["generated_ids"])'
# Batch 32: 32 prompts (lines of the shipped text), then every sequence decoding back to back.
python3 -c 'import re; t=open("bench/data/harbour_town.txt").read(); s=[x.strip() for x in re.split(r"(?<=[.!?])\s+", t) if len(x.split()) > 4]; print("\n".join(s[:32]))' > /tmp/prompts32.txt
$B run --model "$M" --prompts /tmp/prompts32.txt --batch 32 --tokens 16 --time-steps 400 --json 2>&1 | tail -2
# A 2048-token prompt, prefilled in chunks.
LONG=$(python3 -c 'import sys; t=open("bench/data/harbour_town.txt").read(); print(" ".join(t.split()[:1500]))')
$B run --model "$M" --prompt "$LONG" --tokens 4 --json 2>&1 | tail -1 | python3 -c '
import json, sys
j = json.loads(sys.stdin.read())
print(json.dumps({"measure": "expertkv_prefill", "tokens": len(j["prompt_ids"]), "prefill_s": j["prefill_s"],
                  "tokens_per_s": j["prefill_tokens_per_s"], "chunked": j["prefill_chunked"], "dispatches_per_token": j["dispatches_per_token"]}))'
