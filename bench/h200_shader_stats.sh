#!/usr/bin/env bash
# What the NVIDIA Vulkan driver compiled the attention kernels to (registers per invocation,
# binary size, local memory), through VK_KHR_pipeline_executable_properties:
# `.bin/shader_stats` is `cargo build --release -p expertkv --example shader_stats`, carried.
# Each line: a kernel label and its defines as `bench attend` sets them for b8 x 32K.
. bench/lib.sh
h200_setup
X=.bin/shader_stats
while IFS= read -r line; do
    [ -z "$line" ] && continue
    echo "== $line"
    $X $line 2>&1 | grep -E "Register|Binary|Local|Stack|Shared|executable"
done <<< "${KERNELS:-attend/split_subgroup.wgsl GROUP=4u LANES=16u VPL=1u F16=true PAGE_SIZE=16u U=4u TRANSPOSE=true
attend/split_quant.wgsl GROUP=4u LANES=16u BITS=4u HEAD_DIM=128u PAGE_SIZE=16u U=2u PF=4u VP_PER_WORD=true TRANSPOSE=true
attend/split_quant_tile.wgsl GROUP=4u HEAD_DIM=128u PAGE_SIZE=64u NG=2u FLUSH=2u RAW=true WG=128u
attend/split_tiled.wgsl
attend/reduce.wgsl}"
