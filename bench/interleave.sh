#!/usr/bin/env bash
# Run one benchmark from two checkouts in turn (A, B, A, B, ...), to compare code before
# and after a change on the same machine in the same hour. Each side runs its own copy
# of the benchmark with its own Python (a virtualenv with that checkout installed).
#
#   bash bench/interleave.sh A_TREE A_PYTHON B_TREE B_PYTHON BENCH RUNS [BENCH ARGS...]
#   e.g. git worktree add /tmp/before HEAD~1 && python3 -m venv /tmp/bv && \
#        /tmp/bv/bin/pip install -q torch==2.13.0 && /tmp/bv/bin/pip install -q -e /tmp/before && \
#        bash bench/interleave.sh /tmp/before /tmp/bv/bin/python . .venv/bin/python core 3 \
#            --reference "$PWD/../shared/reference/seed_kv_allocator.py"
#
# BENCH is core, rpc, prefix, memory or compat (bench/BENCH_bench.py). Give the reference's absolute path:
# a worktree elsewhere has no ../shared beside it. Each run's table and JSON go to
# $OUT (default: a new temporary folder); the ratio lines of every run are printed at the end.
set -euo pipefail
if [ $# -lt 6 ]; then
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
abs() { echo "$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"; }  # keeps a venv's python link
a_tree=$(cd "$1" && pwd); a_py=$(abs "$2"); b_tree=$(cd "$3" && pwd); b_py=$(abs "$4")
bench=$5; runs=$6; shift 6
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
for i in $(seq 1 "$runs"); do
  for side in A B; do
    if [ $side = A ]; then tree=$a_tree; py=$a_py; else tree=$b_tree; py=$b_py; fi
    log="$out/${bench}_${side}_$i"
    if [ "$bench" = compat ]; then  # its --json is a switch: the JSON on stdout instead of the table
      (cd "$tree" && "$py" "bench/${bench}_bench.py" --json "$@" > "$log.json" 2> "$log.txt") \
        || { echo "run $i of $side failed: $log.txt" >&2; exit 1; }
    else
      (cd "$tree" && "$py" "bench/${bench}_bench.py" --json "$log.json" "$@" > "$log.txt" 2>&1) \
        || { echo "run $i of $side failed: $log.txt" >&2; exit 1; }
    fi
    echo "[$(date +%T)] run $i of $side ($tree) done"
  done
done
"$a_py" - "$out" "$bench" "$runs" <<'PY'
import json, sys
out, bench, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
for side in ("A", "B"):
    for i in range(1, runs + 1):
        with open(f"{out}/{bench}_{side}_{i}.json") as f:
            report = json.load(f)
        scenarios = report.get("scenarios", [report])  # compat's report is its one scenario
        ratios = [f"{s['scenario']} {s['ratio']:.3g}" for s in scenarios if s.get("ratio") is not None]
        print(f"{side} run {i}: " + ", ".join(ratios))
PY
echo "tables and JSON in $out"
