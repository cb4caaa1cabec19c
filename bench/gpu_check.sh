#!/usr/bin/env bash
# bench/gpu_check.sh -- every check of kvmem that needs a GPU, in one run that ends
# within 5 minutes on one H200 (each part is bounded by `timeout`).
#
# How to run: on a machine with an NVIDIA GPU, in a Python environment that already has
# kvmem installed with its test extras and a CUDA build of torch
# (`pip install -e '.[test]'`), from any directory:
#
#     bash bench/gpu_check.sh                              # uses `python` on PATH
#     PYTHON=/path/to/venv/bin/python bash bench/gpu_check.sh
#
# It never installs anything. Logs and the benchmark's JSON go to $GPU_CHECK_OUT
# (default: $OUT if set, else a new directory under /tmp); everything is printed too.
#
# Parts:
#   0. environment: torch, its CUDA, the GPU; stops here (exit 3) without a usable GPU,
#      since everything after would only skip.                        (timeout 60 s)
#   1. tests: tests/test_memory_cuda.py (the cuda backend: IPC handles opened in other
#      processes, device block tables) and tests/test_service_memory.py (real servers
#      and client processes; with a GPU its --device cuda:0 two-process write/read test
#      runs too), and tests/test_recovery.py's cuda variant (a restarted server waits
#      for device memory a client still maps through CUDA IPC). Skip reasons are
#      printed: with one GPU only the two-GPU tensor-parallel test may skip. (170 s)
#   2. benchmark: bench/memory_bench.py --gpu-only -- the Step round trip (256 decode
#      allocs of 1 token, pages of 16) against --device cuda:0 vs --device none,
#      interleaved; target <= 1.3x (PASS/MISS in the table).           (timeout 100 s)
#
# Exit status: 0 when the tests pass and the benchmark ran (a MISS is reported, not a
# failure); 1 when a part failed or timed out; 3 without a GPU.

set -u
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
OUT_DIR="${GPU_CHECK_OUT:-${OUT:-$(mktemp -d /tmp/kvmem-gpu-check-XXXXXX)}}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
unset KVMEM_DEBUG  # the tests set what they need; the benchmark's servers run without it
started=$(date +%s)
status=0
results=()

stamp() { echo "[$(( $(date +%s) - started ))s] $*"; }

run_part() {  # name, timeout seconds, command...
    local name=$1 limit=$2
    shift 2
    stamp "== $name (timeout ${limit}s): $*"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        results+=("$name: TIMED OUT after ${limit}s")
        status=1
    elif [ "$rc" -ne 0 ]; then
        results+=("$name: FAILED (exit $rc)")
        status=1
    else
        results+=("$name: ok")
    fi
    stamp "== $name: exit $rc"
}

stamp "kvmem GPU check in $(pwd), python $PYTHON, logs in $OUT_DIR"
run_part environment 60 "$PYTHON" - <<'EOF'
import sys
import torch
import kvmem.server.memory as memory
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA build {torch.version.cuda}")
if not torch.cuda.is_available():
    print("NO GPU: torch.cuda.is_available() is False -- the GPU checks cannot run here")
    sys.exit(3)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    free, total = torch.cuda.mem_get_info(i)
    print(f"cuda:{i} {p.name}, {total / 2**30:.0f} GiB ({free / 2**30:.0f} GiB free), uuid {memory.device_uuid(i)}")
EOF
if [ "${results[0]}" != "environment: ok" ]; then
    stamp "stopping: no usable GPU (${results[0]})"
    exit 3
fi

run_part tests 170 "$PYTHON" -m pytest tests/test_memory_cuda.py tests/test_service_memory.py \
    "tests/test_recovery.py::test_the_cuda_variant_waits_for_device_memory_clients_still_map" \
    -q -rs --timeout 120 -p no:cacheprovider
run_part benchmark 100 "$PYTHON" bench/memory_bench.py --gpu-only --reps 3000 --budget 30 \
    --json "$OUT_DIR/memory_bench.json"

echo
stamp "summary:"
for r in "${results[@]}"; do echo "  $r"; done
grep -E "passed|failed|error" "$OUT_DIR/tests.log" | tail -n 1 | sed 's/^/  tests: /'
grep -E "^Step 256 decode allocs, cuda:0" "$OUT_DIR/benchmark.log" | sed 's/^/  benchmark: /'
stamp "done, exit $status"
exit $status
