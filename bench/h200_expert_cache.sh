#!/usr/bin/env bash
# Expert tiers on the H200 (or H100): the Mixtral-shaped Q4_K file of bench/h200_moe_q4k_vs_torch.sh
# (written there first, or here) decoded with every expert on the GPU and with 2, 4 and 6 of 8
# slots per layer (LRU and LFU): tokens/s, hits, misses and bytes moved host-to-GPU (`run --json`'s
# expert_cache), each in a fresh process; first the upload bandwidth (`bench upload`). Needs .bin/expertkv and the Vulkan loader in .gl/.
set -u
. bench/lib.sh
h200_setup
B=.bin/expertkv
F=/root/mixtral-q4k.gguf
[ -f "$F" ] || $B synth --out "$F" --layers 2 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --experts 8 --top-k 2 \
  --weights q4_k --untied-output --context 4096
# The host-to-GPU path a fetched expert takes (write_buffer), beside the copy roofline.
$B bench upload --json 2>&1 | grep '^{'
row() {
  python3 -c '
import json, sys
j = json.loads(sys.stdin.read().strip().splitlines()[-1])
c = j.get("expert_cache") or {}
print(json.dumps({"label": sys.argv[1], "tokens_per_s": round(j["tokens_per_s"], 2), "generated": j["generated_ids"][:8],
                  "hits": c.get("hits"), "misses": c.get("misses"), "hit_rate": c.get("hit_rate"), "bytes_moved": c.get("bytes_moved"),
                  "gpu_bytes": c.get("gpu_bytes")}))' "$1"
}
$B run --model "$F" --prompt "hello there, the heart is" --tokens 64 --json 2>&1 | row all-resident
for s in 2 4 6; do
  for p in lru lfu; do
    $B run --model "$F" --prompt "hello there, the heart is" --tokens 64 --expert-slots $s --expert-policy $p --json 2>&1 | row "slots=$s/$p"
  done
done
