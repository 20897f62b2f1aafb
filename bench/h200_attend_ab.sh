#!/usr/bin/env bash
# The split attention kernels, an earlier binary against this one, in one call on the GPU
# machine: `expertkv bench attend` for each split kernel with .bin/old.xz (`old`) and
# .bin/expertkv.xz (`new`) interleaved, the two binaries' order alternating by round, REPEAT
# rounds (default 3). Made to check that sharing the online softmax, the merge and the chunk's
# prologue (attend/softmax.wgsl, attend/lanes.wgsl, attend/chunk.wgsl, attend/online_softmax.wgsl,
# attend/raw_pairs.wgsl) slowed no kernel. Groups, each one process a binary (a row's variant
# names the kernel that ran):
#   tiled        f16 pool: attend/split_tiled; int8 pages: attend/split_codec (no subgroup kernel)
#   subgroup     f16 pool: attend/split_subgroup (TRANSPOSE); int8 and int4 pages at 16 slots:
#                attend/split_quant; fastv-dims: attend/split_codec; low-rank: attend/split_lowrank
#   notranspose  split_subgroup and split_quant (int8, int4) without TRANSPOSE
#   tile         int4 pages of 32 slots: attend/split_quant_tile
#   coop         int4 pages of 64 slots on the tensor cores: attend/split_quant_coop, where the
#                adapter offers wgpu's cooperative matrices (else one line says why not)
# One line per (round, binary, group, shape; the shape names the codec): the measured kernel's
# median ms (the compressed pages' kernel alone for a codec, `codec_split_ms`; the split pass for
# the f16 pool), the whole attention's, the kernel's description. Then per (group, shape) the
# medians over the rounds, new / old for both. All records go to $OUT/attend_ab.jsonl.
# SHAPES ("B:T ...", default "8:32768"; the long shape too: "8:32768 1:131072" with REPEAT=2),
# KERNELS (the groups, default all five), REPEAT, MAX_S (no new run starts past this many
# seconds, default 300: the call stays near 6 minutes) and EXTRA (more `bench attend` flags,
# e.g. "--reps 20") override. Needs .bin/expertkv.xz, .bin/old.xz and the Vulkan loader in
# .gl/. Elsewhere (a dry run on lavapipe), NEW_BIN and OLD_BIN name the binaries and no driver
# is set up:
#   NEW_BIN=target/debug/expertkv OLD_BIN=/tmp/old SHAPES=1:1024 REPEAT=1 EXTRA="--quick --reps 3" bash bench/h200_attend_ab.sh
set -u
. bench/lib.sh
if [ -n "${NEW_BIN:-}" ] && [ -n "${OLD_BIN:-}" ]; then
  bins="old:$OLD_BIN new:$NEW_BIN"
else
  h200_binary || exit 1
  h200_bins
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
fi
case $bins in
  old:*) ;;
  *) echo "no old binary (.bin/old.xz): nothing to compare against" >&2; exit 1 ;;
esac
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
J=$OUT/attend_ab.jsonl
: > "$J"

group_args() {
  case $1 in
    tiled) echo "--variant tiled --codecs none,int8" ;;
    subgroup) echo "--variant subgroup --codecs none,int8,int4,fastv-dims,low-rank:rank=32" ;;
    notranspose) echo "--variant subgroup --no-transpose --codecs none,int8,int4" ;;
    tile) echo "--variant subgroup --page-size 32 --codecs int4 --quant-kernel tile" ;;
    coop) echo "--variant subgroup --page-size 64 --codecs int4 --quant-kernel coop" ;;
    *) return 1 ;;
  esac
}
for g in ${KERNELS:-tiled subgroup notranspose tile coop}; do
  group_args "$g" > /dev/null || { echo "unknown group $g (tiled, subgroup, notranspose, tile, coop)" >&2; exit 1; }
done

# run ROUND LABEL BIN GROUP B:T: one process, its records tagged and appended to $J, one line each.
run() {
  local b=${5%%:*} t=${5#*:} t0=$SECONDS
  # shellcheck disable=SC2046,SC2086
  if ! "$3" bench attend --json --batch "$b" --tokens "$t" $(group_args "$4") ${EXTRA:-} > /tmp/attend_ab.out 2> /tmp/attend_ab.err; then
    echo "round $1 $2 $4 b$b x $t: failed: $(grep -v '^\s*$' /tmp/attend_ab.err | tail -1)"
    return
  fi
  python3 - "$1" "$2" "$4" "$((SECONDS - t0))" /tmp/attend_ab.out "$J" <<'PY'
import json, sys
rnd, label, group, secs, src, path = sys.argv[1:]
with open(path, "a") as out:
    for line in open(src):
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if r.get("kernel") != "attend_decode":
            continue
        kernel_ms = r["codec_split_ms"] if r.get("codec", "none") != "none" else r["split_ms"]
        r.update(round=int(rnd), label=label, group=group, kernel_ms=kernel_ms)
        out.write(json.dumps(r) + "\n")
        print(f"round {rnd} {label:3} {group:11} {r['shape']:46} kernel {kernel_ms:.4f} ms "
              f"total {r['median_ms']:.4f} ms ({secs} s)  {r['variant'][-80:]}")
PY
}

start=$SECONDS
stopped=""
for r in $(seq "${REPEAT:-3}"); do
  # Alternate which binary goes first, so a drift over the call weighs on both.
  order=$bins
  if [ $((r % 2)) = 0 ]; then order=$(echo "$bins" | tr ' ' '\n' | tac | tr '\n' ' '); fi
  for g in ${KERNELS:-tiled subgroup notranspose tile coop}; do
    for s in ${SHAPES:-8:32768}; do
      for lb in $order; do
        if [ $((SECONDS - start)) -ge "${MAX_S:-300}" ]; then
          stopped="past ${MAX_S:-300} s in round $r (group $g): no more runs started"
          break 4
        fi
        run "$r" "${lb%%:*}" "${lb#*:}" "$g" "$s"
      done
    done
  done
done
[ -n "$stopped" ] && echo "$stopped"
echo "$((SECONDS - start)) s in all"

# Medians over the rounds, old against new.
python3 - "$J" <<'PY'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    key = (r["group"], r["shape"])
    rows.setdefault(key, {}).setdefault(r["label"], []).append((r["kernel_ms"], r["median_ms"]))
print(f"{'group':11} {'shape':46} {'kernel old':>10} {'new':>8} {'new/old':>7}   {'total old':>9} {'new':>8} {'new/old':>7}  rounds")
for (group, shape), by in rows.items():
    if "old" not in by or "new" not in by:
        print(f"{group:11} {shape:46} only {', '.join(by)}")
        continue
    ko, kn = (statistics.median(x[0] for x in by[l]) for l in ("old", "new"))
    to, tn = (statistics.median(x[1] for x in by[l]) for l in ("old", "new"))
    print(f"{group:11} {shape:46} {ko:10.4f} {kn:8.4f} {kn / ko:7.3f}   {to:9.4f} {tn:8.4f} {tn / to:7.3f}  {len(by['old'])}/{len(by['new'])}")
PY
