#!/usr/bin/env bash
# Every benchmark's smoke run (`--quick`), in two lanes at once, so that none
# can rot: .ci/run calls it after the tests of the newest jax.
#
#   benchmarks/quick.sh OUT_DIR      # PYTHON=... to pick the interpreter
#
# Results and logs go to OUT_DIR (never to benchmarks/results). A lane stops at
# its first script that fails, showing the end of its log, and the run fails; prints each script's
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

# Two lanes at once (2 cores; each script is mostly single-threaded compile),
# each about half of the total.
# (stop 66's CI, seconds: step_time 326, comm_volume 84, convergence 82, scan_depth
# 64, stale_statistics 55, layout_balance 39, tied_embedding 38, vs_distributed_shampoo
# 36, ir_census 22, memory 22, shampoo_memory 8, vs_kfac_jax 3; step_time's chained
# blocks then shortened from 100 steps to 11, 0.4x its CPU time)
LANE_A=(step_time comm_volume layout_balance memory shampoo_memory vs_kfac_jax)
LANE_B=(convergence stale_statistics vs_distributed_shampoo ir_census tied_embedding
        scan_depth)
TIMEFORMAT="%0R s (CPU %0U + %0S s)"

run_one() {  # one script; on failure the end of its log
  local script=$1
  if ! { time "$PY" "benchmarks/$script.py" --quick --out "$OUT" > "$OUT/$script.log" 2>&1; } \
      2> "$OUT/$script.time"; then
    tail -n 40 "$OUT/$script.log"
    echo "benchmarks/$script.py --quick FAILED (log: $OUT/$script.log)"
    return 1
  fi
  echo "benchmarks/$script.py --quick: $(cat "$OUT/$script.time")"
}

run_lane() {  # the scripts one after the other, stopping at the first failure
  local script
  for script in "$@"; do run_one "$script" || return 1; done
}

status=0
{ time {
  run_lane "${LANE_A[@]}" & lane_a=$!
  run_lane "${LANE_B[@]}" & lane_b=$!
  wait "$lane_a" || status=1
  wait "$lane_b" || status=1
}; } 2> "$OUT/total.time"
echo "all quick benchmarks: $(cat "$OUT/total.time")"
exit "$status"
