# Sourced by the H200 bench scripts (`. bench/lib.sh`), from the repository root.

# The GL/Vulkan loader packages carried in .gl/ and the NVIDIA Vulkan driver.
h200_setup() {
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
}

# attend_rows LABEL: one line per attention record of `expertkv bench attend --json` on stdin
# (the copy roofline's records skipped): the label, the shape, the whole attention's median ms,
# the compressed pages' kernel alone, SDPA's ms and our ratio to it (with --torch), rho, GB/s
# and the end of the kernel's description.
attend_rows() {
    python3 -c '
import json, sys
label = sys.argv[1]
for line in sys.stdin:
    r = json.loads(line)
    if r["kernel"] == "copy":
        continue
    print(label, r["shape"][-26:], "ms", round(r["median_ms"], 4), "codec", round(r.get("codec_split_ms", 0), 4),
          "sdpa", round(r.get("torch_ms", 0), 4), "x", round(r.get("speedup_vs_torch", 0), 2),
          "rho", round(r.get("rho", 1), 2), "GB/s", round(r.get("gbps", 0)), r["variant"][-48:])
' "$1"
}
