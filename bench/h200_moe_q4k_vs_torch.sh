#!/usr/bin/env bash
# #30's MoE comparison on the H200 in one call: a synthetic Mixtral-shaped file at Q4_K, written
# on the machine (`expertkv synth`: 2 layers, hidden 4096, 32/8 heads, 8 experts of 14336, top 2,
# about 1.6 GB), decoded by expertkv and by bench/torch_model.py (f16, gpt-fast-style expert
# gather; eager and CUDA-graphed) from the same file: the greedy tokens of the same prompt ids,
# decode tokens/s at batch 1, and the weight bytes a token reads (the non-expert matrices and
# the top 2 of 8 experts per layer, as stored) over the copy roofline measured in the same call.
# Needs .bin/expertkv and PyTorch with numpy on the machine.
set -u
. bench/lib.sh
h200_setup
B=.bin/expertkv
F=/root/mixtral-q4k.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ -f "$F" ] || $B synth --out "$F" --layers 2 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --experts 8 --top-k 2 \
  --weights q4_k --untied-output --context 4096
COPY=$($B bench attend --json --quick 2>/dev/null | python3 -c 'import json,sys; print(next(json.loads(l)["gbps"] for l in sys.stdin if l.startswith("{") and json.loads(l)["kernel"] == "copy"))')
echo "copy roofline: $COPY GB/s"
J=$($B run --model "$F" --prompt "hello there, the heart is" --tokens 32 --json --time-steps 200 2>&1)
echo "$J" | tail -2
IDS=$(echo "$J" | grep '"prompt_ids"' | python3 -c 'import json,sys; print(",".join(map(str, json.load(sys.stdin)["prompt_ids"])))')
echo "$J" | grep '"generated_ids"' | python3 -c 'import json,sys; print("expertkv generated_ids", json.load(sys.stdin)["generated_ids"])'
python3 bench/torch_model.py --model "$F" --ids "$IDS" --tokens 32 --bench --batch 1 --prefill 512 --steps 32
python3 - "$F" "$COPY" <<'PY'
import sys
sys.path.insert(0, "bench")
from torch_model import read_gguf
meta, tensors = read_gguf(sys.argv[1])
E, k = meta["llama.expert_count"], meta["llama.expert_used_count"]
size = lambda raw: len(raw) if raw is not None else 0
experts = sum(size(r) for n, (_, _, r) in tensors.items() if "_exps" in n)
rest = sum(size(r) for n, (_, _, r) in tensors.items() if "_exps" not in n and n != "token_embd.weight")
per_token = rest + experts * k / E
print(f"weight bytes per token: {per_token / 1e6:.1f} MB (experts {experts / 1e9:.2f} GB of which top {k} of {E} read; "
      f"the rest {rest / 1e6:.1f} MB); at the copy roofline {float(sys.argv[2]):.0f} GB/s: "
      f"{float(sys.argv[2]) * 1e9 / per_token:.0f} tokens/s at most")
PY
