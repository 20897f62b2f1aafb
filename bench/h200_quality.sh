#!/usr/bin/env bash
# The quality targets on SmolLM2-135M, on the GPU machine: bench/data/harbour_town.txt (2,048
# tokens), the retrieval checks in 2,000 filler tokens (a fact at 10%, 50% and 90% depth, three
# facts in one context, the two-turn question; NEEDLE_ARGS overrides them), K/V bytes held at
# 25% and 10% of the full cache's (`eval --bytes`). One `eval` per configuration group, at most
# PARALLEL (default 2) at a time (several processes share one GPU badly: 14 at once finished
# nothing in 530 s); each also scores the full cache, its reference. JSON rows to
# $OUT/q_*.jsonl, then one table.
# Needs .bin/expertkv, the model in models/ and the MoEfication cache in models/.expertkv-cache.
set -u
. bench/lib.sh
h200_setup
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=.bin/expertkv
LIMIT=${LIMIT:-500}
C="--text bench/data/harbour_town.txt --tokens 2048 --needle-filler 2000 ${NEEDLE_ARGS:---needle-depth 10%,50%,90%} --json"
# SELECT="evict_25 int4_h2o_10 ...": only these groups (default: all). (Not GROUPS: bash keeps
# that name for the user's groups and ignores an assignment to it.)
SELECT=${SELECT:-all}
run() { # name, eval arguments...
  local name=$1; shift
  case " $SELECT " in *" all "*|*" $name "*) ;; *) return ;; esac
  while [ "$(jobs -rp | wc -l)" -ge "${PARALLEL:-2}" ]; do wait -n; done
  # shellcheck disable=SC2086
  timeout "$LIMIT" $B eval $C "$@" > "$OUT/q_$name.jsonl" 2> "$OUT/q_$name.err" &
}
for share in 25 10; do
  run "evict_$share" --schedulers h2o:sinks=4,streaming-llm:sinks=4 --bytes "$share%"
  run "int4_h2o_$share" --schedulers h2o:sinks=4 --codecs int4 --bytes "$share%"
  run "int4_sllm_$share" --schedulers streaming-llm:sinks=4 --codecs int4 --bytes "$share%"
  run "int4_pyramid_$share" --schedulers h2o:sinks=4 --codecs int4 --pyramid 2 --bytes "$share%"
done
run "int4_adakv_10" --schedulers adakv:sinks=4 --codecs int4 --bytes 10%
# Expert-aware (cache-aware router, experts' own shards, EKVA) against expert-blind (top-k
# router, token-block shards, no allocator) at equal bytes, per routing source.
for src in "labels 8:2" "moe 8:2"; do
  set -- $src
  run "aware_$1_10" --"$1" "$2" --shards 4 --shard-maps expert --kv-routers cache-aware,topk --allocators ekva,none --schedulers h2o:sinks=4 --bytes 10%
  run "blind_$1_10" --"$1" "$2" --shards 4 --shard-maps token-block --kv-routers topk --allocators none --schedulers h2o:sinks=4 --bytes 10%
done
wait
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows, full = [], None
for f in sorted(glob.glob(f"{out}/q_*.jsonl")):
    name = os.path.basename(f)[2:-6]
    for line in open(f):
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        r["group"] = name
        if r["scheduler"] == "none" and r["codec"] == "none" and r["ffn"] == "dense":
            full = full or r
            continue
        rows.append(r)
    err = open(f"{out}/q_{name}.err").read().strip().splitlines()
    if err and "Error" in "\n".join(err):
        print(f"{name}: {err[-1]}")
if not full:
    sys.exit("no full-cache row")
def needles(r):
    n = r.get("needles") or []
    missed = [f"{x['case']}: {x['answers']!r}" for x in n if not x["found"]]
    return f"{sum(x['found'] for x in n)}/{len(n)} found" + (f"; missed {'; '.join(missed)}" if missed else "")
print(f"full cache: perplexity {full['perplexity']:.4f}, K/V {full['kv_bytes']} bytes, retrieval {needles(full)}")
print("| group | FFN | routing | codec | scheduler | budget | bytes | perplexity | vs full | agreement | K/V in use | needle |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
seen = set()
for r in rows:
    key = (r["ffn"], r["routing"], r["codec"], r["scheduler"], r["budget"], r["bytes_share"])
    if key in seen:
        continue
    seen.add(key)
    d = 100 * (r["perplexity"] / full["perplexity"] - 1)
    print(f"| {r['group']} | {r['ffn']} | {r['routing']} | {r['codec']} | {r['scheduler']} | {r['budget']} | {r['bytes_share']} | "
          f"{r['perplexity']:.4f} | {d:+.2f}% | {100*r['greedy_agreement']:.1f}% | {100*r['kv_bytes']/full['kv_bytes']:.1f}% | "
          f"{needles(r)} |")
PY
