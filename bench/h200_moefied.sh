#!/usr/bin/env bash
# SmolLM2-135M MoEfied as a MoE file (`expertkv moefy --moe 8:4:fitted`, lib.sh's smollm2): the
# expert tiers and the joint budget on a trained model's routing, in one call. First the file's
# perplexity against the dense model MoEfied the same way (`eval`: the same experts and routers,
# so the same figure up to the f16 down projection); then tokens/s all resident and with 4 (the
# fewest top 4 allows), 5 and 6 of 8 slots, on demand and pre-gated (bench/h200_experts.sh, with
# the link's bandwidth); then `mix` at TOTAL (default 100M: all 8 slots, 82 MiB, leave 18 MiB of
# K/V, about 800 tokens of context; 4 slots leave room for a 1,568-token context's whole pool),
# the joint controller against fixed splits. Needs models/SmolLM2-135M-Instruct.Q4_1.gguf
# (carried in two parts, see bench/h200_model.sh), .bin/expertkv.xz and the Vulkan loader in .gl/.
set -u
. bench/lib.sh
h200_binary || exit 1
sha256sum models/SmolLM2-135M-Instruct.Q4_1.gguf
F=$(moe_file smollm2) || exit 1
echo "== eval: the MoE file, then the dense model MoEfied the same way"
$B eval --model "$F" --tokens 256 --schedulers none 2>&1 | grep -v '^$' | tail -8
$B eval --tokens 256 --schedulers none --moe 8:4:fitted 2>&1 | grep -v '^$' | tail -8
echo "== expert tiers"
SHAPES=smollm2 TOPK=4 TOKENS=${TOKENS:-128} \
  MODES="${MODES:-all,4 none lru,4 pregate lru,5 none lru,5 pregate lru,6 none lru,6 pregate lru,6 none score}" \
  bash bench/h200_experts.sh
echo "== mix"
SHAPE=smollm2 TOTAL=${TOTAL:-100M} GRID=0 bash bench/h200_mix.sh
