#!/usr/bin/env bash
# Codec attention on the lent H200 (see BENCHMARKS.md): step time against the compression ratio
# rho, checked against the step-time model t(f16) / rho, and against PyTorch SDPA in f16 over the
# same context; then int4 at pages of 32 and 64 slots (the tile kernel). The release binary (and
# the GPU test binary, if built) are carried in .bin/, the Vulkan loader in .gl/.
set -u
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=.bin/expertkv
CODECS=${CODECS:-none,int8,int4,int4:group=64,fastv-dims,low-rank:rank=32,lora:rank=16}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# The codec kernels' GPU-vs-CPU tests on this GPU first, when the release test binary is there.
if [ -x .bin/gpu-tests ] && [ "${TESTS:-1}" = 1 ]; then
  .bin/gpu-tests --test-threads 1 compress:: 2>&1 | grep -E "^test |test result" | tee "$OUT/tests.txt"
fi
for shape in "--batch 8 --tokens 32768" "--batch 1 --tokens 131072"; do
  $B bench attend --json --torch $shape --codecs "$CODECS" >> "$OUT/codec.jsonl" 2>> "$OUT/codec.err"
  # Larger pages: the f16 pool, and int4 through the tile kernel (attend/split_quant_tile.wgsl).
  for P in ${PAGES:-32 64}; do
    $B bench attend --json $shape --page-size $P --codecs none,int4,int4:group=64 >> "$OUT/codec.jsonl" 2>> "$OUT/codec.err"
  done
done
python3 - "$OUT" <<'PY'
import json, sys, os
for l in open(os.path.join(sys.argv[1], "codec.jsonl")):
    if not l.startswith('{'): continue
    r = json.loads(l)
    if r['kernel'] == 'copy': print(f"copy {r['gbps']:.0f} GB/s"); continue
    print(f"{r['shape']:<52} rho {r.get('rho',0):5.2f} {r['median_ms']:.4f} ms (codec kernel {r.get('codec_split_ms',0):.4f})  x f16pool {r.get('speedup_vs_f16_pool',0):.2f}"
          f"  model {r.get('predicted_ms',0):.4f} ms  sdpa {r.get('torch_ms',0):.4f} ms  x sdpa {r.get('speedup_vs_torch',0):.2f}  [{r['variant']}]")
PY
tail -5 "$OUT/codec.err"
