#!/usr/bin/env bash
# One GPU budget split between K/V pages and expert slots request by request (`expertkv mix`):
# the joint controller against fixed splits at one total, then the 2-D grid (slots x H2O's share
# of each context) under the same total, drawn by bench/mix_grid.py. The synthetic file is
# lib.sh's kv8 shape (8 layers, 8 experts of 1024 x 2816 Q4_K, top 2, 8 KV heads: 38.9 MB a slot
# across the layers, 32 KiB of K/V a token). TOTAL (default 210M) holds the long requests' whole
# pool beside 4 slots; REPEAT (default 2) rounds of the first run; GRID=0 skips the grid. SHAPE:
# another of lib.sh's files (smollm2: SmolLM2-135M MoEfied, a trained model's routing). MIX=0
# skips the first run; GRID_SLOTS (default 2,3,4,5) the grid's slot counts. REQUESTS (default
# 3x128,2x1536), TOKENS (generated a request, default 32) and POLICIES (default joint and the three
# fixed splits, as the headline table was measured) shape the first run; POLICIES=joint,online
# adds the online split, told only each prompt, which grows the pool mid-request, so long
# generations (TOKENS=512) are where it differs from joint. Needs .bin/expertkv.xz and the Vulkan loader in .gl/.
set -u
. bench/lib.sh
h200_binary || exit 1
F=$(moe_file "${SHAPE:-kv8}") || exit 1
O=${OUT:-/tmp}
T=${TOTAL:-210M}
if [ "${MIX:-1}" != 0 ]; then
  $B mix --model "$F" --gpu-mem "$T" --requests "${REQUESTS:-3x128,2x1536}" --tokens "${TOKENS:-32}" \
    --policies "${POLICIES:-joint,50/50,0.75/0.15,experts-first:256}" --repeat "${REPEAT:-2}" --json 2>&1 | tee "$O/mix.txt"
fi
[ "${GRID:-1}" = 0 ] && exit 0
cells=$(python3 -c "print(','.join(f'cell:{s}:{p}' for s in (${GRID_SLOTS:-2,3,4,5}) for p in (25, 50, 75, 100)))")
$B mix --model "$F" --gpu-mem "$T" --requests "${GRID_REQUESTS:-1x128,1x1536}" --tokens 32 --policies "joint,$cells" --json 2>&1 | tee "$O/mix_grid.txt"
python3 bench/mix_grid.py "$O/mix_grid.txt" "$O/mix_grid.svg"
