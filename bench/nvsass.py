#!/usr/bin/env python3
"""The machine code the NVIDIA Vulkan driver compiled our kernels to, disassembled.

The driver keeps what it compiled in two places: its disk cache (the folder named by
__GL_SHADER_DISK_CACHE_PATH, `GLCache/<hash>/<hash>/*.bin`, written for every pipeline wgpu
creates) and the blob of a VkPipelineCache (`shader_stats` writes one per kernel to
$SHADER_STATS_DUMP/<label>.vkcache). Both hold zstd frames; a frame that unpacks to an `NVuc`
object holds the SASS in its section of type 1. This script finds every such frame in the files
and folders it is given, writes `<name>.sass` (nvdisasm --binary SM90) next to OUTDIR, and prints
one line per kernel: instructions, and the counts that tell a kernel's story (local memory
traffic, shared loads and stores, barriers, integer dot products, packed f16 arithmetic,
special functions, branches).

  python3 bench/nvsass.py OUTDIR PATH...        (PATH: files or folders, searched recursively)

Needs the `zstandard` module (pip) and `nvdisasm`: $NVDISASM, on PATH (CUDA), or PyPI's
nvidia-cuda-nvdisasm installed for this Python; without nvdisasm it writes the code sections only.
"""

import os
import re
import shutil
import struct
import subprocess
import sys

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def frames(data):
    """Every zstd frame of `data` that unpacks, as bytes."""
    import zstandard

    i = 0
    while True:
        i = data.find(ZSTD_MAGIC, i)
        if i < 0:
            return
        try:
            yield zstandard.ZstdDecompressor().decompressobj().decompress(data[i:])
        except zstandard.ZstdError:
            pass
        i += 4


def code_section(obj):
    """The machine code of an NVuc object (section type 1), or None."""
    at = obj.find(b"NVuc")
    if at < 0:
        return None
    o = obj[at:]
    if len(o) < 32:
        return None
    n = struct.unpack_from("<I", o, 8)[0] & 0xFFFF
    for k in range(n):
        if 32 + 32 * k + 12 > len(o):
            return None
        kind, length, off = struct.unpack_from("<3I", o, 32 + 32 * k)
        if kind == 1 and off + length <= len(o):
            return o[off:off + length]
    return None


OPS = ["LDL", "STL", "LDS", "STS", "LDG", "STG", "BAR", "IDP", "HFMA2", "HADD2", "FFMA", "MUFU", "SHFL", "BRA"]


def summary(sass):
    ops = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops.append(m.group(1))
    return len(ops), {k: ops.count(k) for k in OPS}


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    nvdisasm = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not nvdisasm:
        # PyPI's nvidia-cuda-nvdisasm puts it under site-packages/nvidia/cu*/bin.
        for d in sys.path:
            for cu in ("cu13", "cu12"):
                cand = os.path.join(d, "nvidia", cu, "bin", "nvdisasm")
                if os.access(cand, os.X_OK) and not nvdisasm:
                    nvdisasm = cand
    paths = []
    for p in sys.argv[2:]:
        if os.path.isdir(p):
            for root, _, files in sorted(os.walk(p)):
                paths += [(os.path.join(root, f), os.path.relpath(os.path.join(root, f), p)) for f in sorted(files) if not f.endswith(".toc")]
        else:
            paths.append((p, os.path.basename(p)))
    seen = set()
    for path, rel in paths:
        base = re.sub(r"[^A-Za-z0-9]", "_", rel)
        for k, obj in enumerate(frames(open(path, "rb").read())):
            code = code_section(obj)
            if code is None or code in seen:
                continue
            seen.add(code)
            name = os.path.join(out, f"{base}_{k}")
            open(name + ".code", "wb").write(code)
            if not nvdisasm:
                print(f"{name}.code: {len(code)} bytes (no nvdisasm)")
                continue
            r = subprocess.run([nvdisasm, "--binary", "SM90", name + ".code"], capture_output=True, text=True)
            if r.returncode != 0:
                print(f"{name}.code: nvdisasm failed: {r.stderr.strip()[:200]}")
                continue
            open(name + ".sass", "w").write(r.stdout)
            n, counts = summary(r.stdout)
            print(f"{name}.sass: {len(code)} bytes, {n} instructions; " + " ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
