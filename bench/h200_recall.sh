#!/usr/bin/env bash
# The recall tier on SmolLM2-135M, on the GPU machine, in one call of about eight minutes:
#   - speed first, alone on the GPU (SPEED=0 skips it): decode steps back to back (`run
#     --time-steps`), H2O at 192 tokens a list (10% of a 2,048-token context) without and with
#     `--recall ${RECALL:-16}`: batch 1 after a 1,500-word prompt, and batch 32 from short prompts
#     (400 steps, the lists evicting from step 193 on); the bytes the recall passes read a step
#     (host memory) and the digests they score (device memory);
#   - quality: `eval` over bench/data/harbour_town.txt (2,048 tokens), with FILLER > 0 the
#     retrieval checks too (a fact at 10%, 50% and 90% depth, three facts in one context, the
#     two-turn question), K/V bytes held at 10% and 5% of the full cache's (`--bytes`; the
#     digests' device bytes come out of the budget), H2O without and with the recall tier, f16 and
#     int4 pages; three eval processes (groups f16_10, int4_10, int4_5; GROUP_ONLY picks one),
#     each scoring the full cache too, its reference, and printing each row as it finishes (LIMIT
#     seconds each).
# JSON rows to $OUT/r_*.jsonl and $OUT/speed.txt, then one table. The model goes in two parts over
# two calls as bench/h200_model.sh says (/root/a from the first call, scratch/m2/b with this one);
# the joined file's sha256 is printed. Needs .bin/expertkv.xz and the Vulkan loader in .gl/.
set -u
. bench/lib.sh
h200_binary || exit 1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
M=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -s "$M" ]; then
  mkdir -p models && cat /root/a scratch/m2/b > "$M" || exit 1
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
sha256sum "$M"
# FILLER: the retrieval checks' filler tokens (0, the default: the scored text alone). With the
# tier a step takes 26 ms at batch 1 on the H100 (2026-12-07), so one row of the text and the five
# retrieval cases (~12,000 tokens) does not finish in a call's 490 s: run FILLER=2000 with one
# group at a time (GROUP_ONLY=f16_10, say).
C="--model $M --text bench/data/harbour_town.txt --tokens 2048 --needle-filler ${FILLER:-0} --needle-depth 10%,50%,90% --needles 3 --json"
run() { # name, limit, eval arguments...
  local name=$1 limit=$2
  shift 2
  [ -z "${GROUP_ONLY:-}" ] || [ "$GROUP_ONLY" = "$name" ] || return 0
  # shellcheck disable=SC2086
  timeout "$limit" $B eval $C "$@" > "$OUT/r_$name.jsonl" 2> "$OUT/r_$name.err" &
}
LONG=$(python3 -c 'print(" ".join(open("bench/data/harbour_town.txt").read().split()[:1500]))')
python3 -c 'import re; t=open("bench/data/harbour_town.txt").read(); s=[x.strip() for x in re.split(r"(?<=[.!?])\s+", t) if len(x.split()) > 4]; print("\n".join(s[:32]))' > /tmp/prompts32.txt
speed() { recall_speed_row 120 "$@"; }
rec() { [ "$1" = 0 ] || echo "--recall $1"; }
if [ "${SPEED:-1}" = 1 ]; then
  {
    for r in 0 ${RECALL:-16}; do speed "h2o recall=$r batch 1" --prompt "$LONG" --tokens 2 --time-steps 300 $(rec "$r"); done
    for r in 0 ${RECALL:-16}; do speed "h2o recall=$r batch 32" --prompts /tmp/prompts32.txt --batch 32 --tokens 2 --time-steps 400 $(rec "$r"); done
  } > "$OUT/speed.txt" 2>&1
  cat "$OUT/speed.txt"
fi
# Three eval processes: f16 pages at 10% without and with the tier; int4 pages (and the f16
# row again, which `eval` crosses in) at 10% and at 5% with the tier.
run f16_10 ${LIMIT:-280} --schedulers h2o:sinks=4 --bytes 10% --recall 0,${RECALL:-16}
run int4_10 ${LIMIT:-280} --schedulers h2o:sinks=4 --bytes 10% --recall ${RECALL:-16} --codecs int4
run int4_5 ${LIMIT:-280} --schedulers h2o:sinks=4 --bytes 5% --recall ${RECALL:-16} --codecs int4
wait
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
full = None
rows = []
for f in sorted(glob.glob(f"{out}/r_*.jsonl")):
    name = os.path.basename(f)[2:-6]
    for line in open(f):
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        r["group"] = name
        if r["scheduler"] == "none" and r.get("codec", "none") in ("none", None):
            full = full or r
            continue
        rows.append(r)
    err = open(f"{out}/r_{name}.err").read().strip().splitlines()
    if err and any("rror" in e for e in err):
        print(f"{name}: {err[-1]}")
if not full:
    sys.exit("no full-cache row")
def needles(r):
    n = r.get("needles") or []
    missed = [f"{x['case']}: {x['answers']!r}" for x in n if not x["found"]]
    return f"{sum(x['found'] for x in n)}/{len(n)} found" + (f"; missed {'; '.join(missed)}" if missed else "")
print(f"full cache: perplexity {full['perplexity']:.4f}, K/V {full['kv_bytes']} bytes, retrieval {needles(full)}")
print("| group | scheduler | codec | recall | budget | bytes | perplexity | vs full | agreement | K/V in use (digests included) | tier in host memory | digest recall (best pages / best page) | retrieval |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    d = 100 * (r["perplexity"] / full["perplexity"] - 1)
    print(f"| {r['group']} | {r['scheduler']} | {r.get('codec') or 'none'} | {r.get('recall') or '-'} | {r['budget']} | {r['bytes_share']} | {r['perplexity']:.4f} | {d:+.2f}% | "
          f"{100*r['greedy_agreement']:.1f}% | {100*r['kv_bytes']/full['kv_bytes']:.1f}% | {r.get('recall_host_bytes', 0) / 2**20:.1f} MiB | "
          + (f"{100*r['digest_recall']:.1f}% / {100*r['digest_top_recall']:.1f}%" if r.get('digest_recall') is not None else "-") + f" | {needles(r)} |")
PY
