#!/usr/bin/env bash
# The real model's eval with the quantising codecs on the lent H200 (the codec rows of
# bench/h200_model.sh; same text, same settings). Needs .bin/expertkv and the model file there
# (see bench/h200_model.sh for sending it in two parts).
. bench/lib.sh
h200_setup
sha256sum models/SmolLM2-135M-Instruct.Q4_1.gguf
.bin/expertkv eval --tokens 256 --schedulers none --needle-filler 128 --codecs int8,int4,int4:group=64 2>&1 | grep -v '^$' | tail -10
