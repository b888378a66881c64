#!/usr/bin/env bash
# Every benchmark's smoke run (`--quick`), one after the other, so that none
# can rot: .ci/run calls it after the tests of the newest jax.
#
#   benchmarks/quick.sh OUT_DIR      # PYTHON=... to pick the interpreter
#
# Results and logs go to OUT_DIR (never to benchmarks/results). Stops at the
# first script that fails, showing the end of its log; prints each script's
# wall-clock and CPU seconds and the total. Peers that are not installed (kfac-jax, which needs an
# older jax; precondition-opt) are skipped by their scripts with a message.
set -euo pipefail
OUT=${1:?usage: benchmarks/quick.sh OUT_DIR}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export OPENBLAS_NUM_THREADS=1
# XLA:CPU compiles about a third faster without LLVM optimisation; the numbers
# of a smoke run do not matter (the HLO and its bytes are the same).
export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0"

SCRIPTS=(comm_volume layout_balance memory shampoo_memory step_time stale_statistics
         convergence vs_distributed_shampoo vs_kfac_jax)
TIMEFORMAT="%0R s (CPU %0U + %0S s)"
{ time for script in "${SCRIPTS[@]}"; do
  if ! { time "$PY" "benchmarks/$script.py" --quick --out "$OUT" > "$OUT/$script.log" 2>&1; } \
      2> "$OUT/$script.time"; then
    tail -n 40 "$OUT/$script.log"
    echo "benchmarks/$script.py --quick FAILED (log: $OUT/$script.log)"
    exit 1
  fi
  echo "benchmarks/$script.py --quick: $(cat "$OUT/$script.time")"
done; } 2> "$OUT/total.time"
echo "all quick benchmarks: $(cat "$OUT/total.time")"
