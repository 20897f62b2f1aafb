#!/usr/bin/env bash
# The recall tier's price in decode speed, on the GPU machine, in one short call that needs no
# model file: a random Q4_1 model of SmolLM2-135M's shape (30 layers, hidden 576, 9 query and 3
# KV heads of 64, FFN 1536; `synth`, whose byte-level vocabulary of 256 makes the LM head far
# cheaper than SmolLM2's 49,152 rows), H2O at 192 tokens a list, without and with `--recall 4` and `--recall 16`:
# batch 1 after a ~1,560-token prompt (the lists evicting every step), and batch 32 from short
# prompts (400 steps, evicting from step 193 on); decode steps back to back (`run --time-steps`),
# each pair twice in alternating order. Prints tokens/s, the recall's bytes a step from the tier
# (host memory) and of digests (device memory). Needs .bin/expertkv.xz and .gl/.
set -u
. bench/lib.sh
h200_binary || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
M=/root/smol_shape.gguf
[ -s "$M" ] || $B synth --out "$M" --experts 0 --layers 30 --hidden 576 --heads 9 --kv-heads 3 --ffn 1536 --weights q4_1 --untied-output | tail -1
# 250 words: about 1,560 byte-level tokens (350 words made 2,181, over the 2,048-token context).
LONG=$(python3 -c 'print(" ".join(open("bench/data/harbour_town.txt").read().split()[:250]))')
python3 -c 'import re; t=open("bench/data/harbour_town.txt").read(); s=[x.strip() for x in re.split(r"(?<=[.!?])\s+", t) if len(x.split()) > 4]; print("\n".join(s[:32]))' > /tmp/prompts32.txt
speed() { recall_speed_row 60 "$@"; }
rec() { [ "$1" = 0 ] || echo "--recall $1"; }
# RECALLS: the tier's pages to compare (default 0 4 16), run in that order and then reversed.
R=${RECALLS:-0 4 16}
REV=$(echo "$R" | tr ' ' '\n' | tac | tr '\n' ' ')
# With .bin/old.xz carried (an earlier release binary), each order runs the old binary's rows
# and then the new one's, labelled.
h200_bins
# ONCE=1: the given order only (half the rows, for a short call). BATCHES: the batches to run
# (default "1 32").
ORDERS=("$R" "$REV")
[ "${ONCE:-0}" = 1 ] && ORDERS=("$R")
for order in "${ORDERS[@]}"; do
  for bin in $bins; do
    B=${bin#*:}
    tag=${bin%%:*}
    for b in ${BATCHES:-1 32}; do
      if [ "$b" = 1 ]; then
        for r in $order; do speed "$tag h2o recall=$r batch 1" --prompt "$LONG" --tokens 2 --time-steps 300 $(rec $r); done
      else
        for r in $order; do speed "$tag h2o recall=$r batch 32" --prompts /tmp/prompts32.txt --batch 32 --tokens 2 --time-steps 400 $(rec $r); done
      fi
    done
  done
done
