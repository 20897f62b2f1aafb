#!/usr/bin/env bash
# The expert FFN kernels after their rewrite (moe_down over 32 features x 8 neuron slices per
# workgroup, moe_gate_up four neurons per workgroup) on the lent H200, in one call: the random
# MoE files of bench/h200_moe_file.sh, SmolLM2-135M dense and MoEfied (E=8 k=2, E=16 k=4), tokens/s
# token by token and 200 steps back to back, and the MoEfied perplexities (which only the
# summation order may move).
# Needs .bin/expertkv and models/SmolLM2-135M-Instruct.Q4_1.gguf there, sent in two parts as
# bench/h200_model.sh says.
bash bench/h200_moe_file.sh
B=.bin/expertkv
sha256sum models/SmolLM2-135M-Instruct.Q4_1.gguf
for moe in dense 8:2 16:4; do
  echo "== run --moe $moe"
  $B run --time-steps 200 --tokens 64 --moe "$moe" 2>&1 | grep -E "prefill|decode_steps"
done
$B eval --tokens 256 --schedulers none --needle-filler 0 --moe 8:2,16:4 2>&1 | grep -E "^\|"
