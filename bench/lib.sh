# Sourced by the H200 bench scripts (`. bench/lib.sh`), from the repository root.

# The GL/Vulkan loader packages carried in .gl/ and the NVIDIA Vulkan driver.
h200_setup() {
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
}

# h200_binary: h200_setup, then the release binary carried in .bin/expertkv.xz unpacked to $B
# (/tmp/expertkv), where a warm machine's later calls find it too.
h200_binary() {
    h200_setup
    B=/tmp/expertkv
    xz -dc .bin/expertkv.xz > "$B" && chmod +x "$B"
}

# h200_bins: after h200_binary, `bins` lists "label:path" pairs to run in turn: new:$B, and
# first old:/tmp/expertkv_old where .bin/old.xz (an earlier release binary) is carried, so a
# baseline runs in the same call.
h200_bins() {
    bins="new:$B"
    if [ -s .bin/old.xz ]; then
        xz -dc .bin/old.xz > /tmp/expertkv_old && chmod +x /tmp/expertkv_old && bins="old:/tmp/expertkv_old $bins"
    fi
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

# moe_file SHAPE: the path of the synthetic Q4_K MoE file of that shape (8 experts, top 2),
# written under /root by $B the first time, so scripts on a warm machine share it.
#   small: 8 layers of 1024 x 2816 (4.9 MB an expert); mixtral: 4 layers of Mixtral-8x7B's
#   width, 4096 x 14336 (99 MB an expert); kv8: small's experts with 8 KV heads of 128 (32 KiB
#   of K/V a token, so a 1,500-token context's pool weighs about a slot). Context 4096 for all.
#   smollm2: not synthetic: SmolLM2-135M (models/, carried as bench/h200_model.sh says) MoEfied
#   at 8 experts, top 4, fitted routers, written by `moefy` (30 layers, an expert 351 KiB).
moe_file() {
    local geo f=/root/$1.gguf
    if [ "$1" = smollm2 ]; then
        [ -s "$f" ] || $B moefy --model models/SmolLM2-135M-Instruct.Q4_1.gguf --moe 8:4:fitted --out "$f" | tail -1 >&2
        [ -s "$f" ] && echo "$f"
        return
    fi
    case $1 in
        small) geo="--layers 8 --hidden 1024 --heads 16 --kv-heads 4 --ffn 2816" ;;
        mixtral) geo="--layers 4 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336" ;;
        kv8) geo="--layers 8 --hidden 1024 --heads 8 --kv-heads 8 --ffn 2816" ;;
        *) echo "moe_file: unknown shape $1 (small, mixtral, kv8 or smollm2)" >&2; return 1 ;;
    esac
    # shellcheck disable=SC2086
    [ -s "$f" ] || $B synth --out "$f" $geo --experts 8 --top-k 2 --weights q4_k --untied-output --context 4096 | tail -1 >&2
    echo "$f"
}

# prefill_row LABEL NAME CHUNK RUN: one line from `expertkv run --profile --json` on stdin: the
# prompt's tokens, the time to first token, the prefill passes' GPU time and rate (`gpu_stages`),
# whether the prompt went in chunks, the passes and each stage's milliseconds.
prefill_row() {
    python3 -c '
import json, sys
run = gpu = None
for line in sys.stdin:
    if line.startswith("{"):
        j = json.loads(line)
        if "prefill_tokens_per_s" in j:
            run = j
        elif j.get("measure") == "gpu_stages":
            gpu = j
n = len(run["prompt_ids"])
pf = (gpu or {}).get("prefill") or {}
g = pf.get("total_ms", float("nan"))
stages = {k: round(v, 1) for k, v in (pf.get("stages_ms") or {}).items()}
print(sys.argv[1], sys.argv[2], "chunk", sys.argv[3], "run", sys.argv[4],
      "prompt %d tokens: TTFT %.4f s, %.1f tokens/s;" % (n, run["prefill_s"], run["prefill_tokens_per_s"]),
      "GPU time of the prefill passes %.2f ms, %.1f tokens/s;" % (g, n / g * 1e3),
      "chunked", run["prefill_chunked"], "passes", pf.get("recordings"), "stages", stages)
' "$@"
}

# recall_speed_row LIMIT LABEL RUN-ARGS...: one line from `$B run --json --time-steps ...` (H2O at
# 192 tokens a list, the model in $M): tokens/s, wall and host ms a step, dispatches, and the
# recall tier's bytes a step read from the tier (host memory) and of digests (device memory).
recall_speed_row() {
    local limit=$1 label=$2
    shift 2
    timeout "$limit" $B run --model "$M" --scheduler h2o:sinks=4 --budget 192 --json "$@" 2>&1 | grep '"decode_steps"' | python3 -c '
import json, sys
j = json.loads(sys.stdin.read())
r = j.get("recall") or {}
st = (j.get("gpu") or {}).get("stages_ms") or {}
print(sys.argv[1], "%.1f tokens/s, %.3f ms a step (wall), host %.3f ms, %d dispatches; recall reads %s bytes a step from the tier (host memory: %s), %s bytes of digests (%s allocated); GPU ms a step: %s" % (
    j["tokens_per_s"], j["wall_ms_per_step"], j["host_ms_per_step"], j["dispatches_per_step"], r.get("bytes_read_per_step", 0), r.get("host_memory"), r.get("digest_bytes_read_per_step", 0), r.get("digest_bytes", 0),
    " ".join("%s %.3f" % (k, v) for k, v in sorted(st.items()))))' "$label"
}
