#!/usr/bin/env bash
# The project's GPU check: one prepared run of at most about 8 minutes for a
# machine with one NVIDIA GPU and a CUDA jax already installed (no network
# there: the project is used from its checkout through PYTHONPATH).
#
#   benchmarks/gpu_check.sh OUT_DIR          # on the GPU machine
#   benchmarks/gpu_check.sh OUT_DIR --cpu    # rehearsal on a CPU machine
#   GPU_CHECK_PARTS=step_time,digits benchmarks/gpu_check.sh OUT_DIR   # a rerun of some
#
# Parts, each under its own time limit (a part that runs over is stopped and
# reported as such; the others still run):
#   1. the single-device tests (`pytest -m "not slow"`; the tests that need a
#      mesh of several devices skip: tests/helpers.py), at matmul precision
#      "highest": they check the math against float64 oracles, not TF32
#      rounding;
#   2. benchmarks/step_time.py --core: MLP, CNN and Transformer LM, amortised
#      K-FAC 10/100 (and each kind of its steps, and the pieces of a plain
#      step) against optax SGD and Adam in the same run, at jax's default
#      precision;
#   3. benchmarks/vs_distributed_shampoo.py's models (kd.shampoo against
#      Google's distributed_shampoo when the package `precondition` imports;
#      otherwise that part is reported as skipped);
#   4. examples/digits.py (K-FAC against Adam and SGD on sklearn's digits);
#   5. only when GPU_CHECK_PARTS names `probe`: benchmarks/gpu_probe.py
#      --command-buffer-ab, where a plain K-FAC step's time goes (kernels and
#      ms per piece), consecutive amortised steps timed one by one (in a plain
#      loop and in one that donates params and state) against each kind
#      alone, and the same with conditionals in XLA's command
#      buffers, into the log (its eigh table: `gpu_probe.py --eigh`);
#   6. only when GPU_CHECK_PARTS names `compile`: `gpu_probe.py --compile-ab
#      --models mlp,cnn,lm`, SGD's and amortised K-FAC's compile times at
#      XLA's defaults and with GPU autotuning off;
#   7. only when GPU_CHECK_PARTS names `trace`: `gpu_probe.py --trace`, the
#      CNN's and the LM's donated plain steps under jax.profiler, K-FAC's
#      against SGD's: wall, kernels, the GPU's busy and idle time and the
#      kernel time by library file (is the gap launches or work?).
# The tests compile with XLA's GPU autotuning off (--xla_gpu_autotune_level=0:
# they check values, not speed; compiles are most of their time there).
# OUT_DIR receives at most 8 files (what the lent device machines return):
#   summary.md, gpu_check.log, step_time.{md,json},
#   vs_distributed_shampoo.{md,json}, digits/{metrics.csv,digits.png}.
# --cpu runs the same parts on the CPU with one host device (the same test
# selection as one GPU) and shorter benchmark settings.
set -uo pipefail

usage() { echo "usage: $0 OUT_DIR [--cpu]" >&2; exit 2; }
[ $# -ge 1 ] || usage
OUT=$1; shift
MODE=gpu
for arg in "$@"; do
  case "$arg" in
    --cpu) MODE=cpu ;;
    *) usage ;;
  esac
done

ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT/digits"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
SUMMARY="$OUT/summary.md"
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export OPENBLAS_NUM_THREADS=1
# Several test processes share the one GPU: no process may take 75% of it.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

if [ "$MODE" = cpu ]; then
  export JAX_PLATFORMS=cpu
  export XLA_FLAGS="--xla_force_host_platform_device_count=1"
  STEP_ARGS=(--quick)
  SHAMPOO_ARGS=(--steps 60 --rounds 2 --round-steps 20 --agree-steps 20)
  DIGITS_ARGS=(--steps 100 --adam-lrs 3e-3 --sgd-lrs 0.1)
  LIMITS=(900 900 300 300 300 300 300)
  WORKERS=2
else
  STEP_ARGS=(--core --rounds 3 --reps 20 --cycles 1 --compile-reps 1)
  SHAMPOO_ARGS=(--steps 200 --rounds 2 --round-steps 40)
  DIGITS_ARGS=()
  # Measured on an H100 (16 host cores): at b887eaa 8 test workers were 87%
  # through in 190 s, 14 workers 92% (528 tests) in 144 s; step_time --core
  # took 137 s, digits 32 s. At 40a0ab0: 14 workers 96% (606 of 633 tests)
  # in 195 s with --dist loadfile (a heavy file pinned to one worker made the
  # tail; the tests now run --dist worksteal, which on this 2-core CPU passes
  # the same 632 not-slow tests), step_time --core 159 s, digits 41 s. At
  # fdb28b5 on an H200: all 701 not-slow tests in 150 s (554 passed, 147 skipped:
  # they need several devices), step_time --core 127 s, digits 28 s, the probe
  # 143 s. The shampoo part runs only
  # where precondition-opt is installed (the stock image has none), so the
  # default parts fit 8 minutes there.
  # The probe took 143 s at fdb28b5 (H200); its donating loop adds a compile of
  # each model's step, in both of its processes.
  LIMITS=(185 175 70 50 220 150 150)
  WORKERS=14
fi

: > "$LOG"
{
  echo "# GPU check ($MODE)"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ); commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
} > "$SUMMARY"

log() { echo "$*" | tee -a "$LOG"; }

# --- 0. the machine and the jax it has --------------------------------------
log "== environment"
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$LOG" 2>&1
fi
"$PY" - >> "$LOG" 2>&1 <<'EOF'
import platform, os
import jax, jaxlib, flax, optax
print("python", platform.python_version(), "| jax", jax.__version__, "| jaxlib",
      jaxlib.__version__, "| flax", flax.__version__, "| optax", optax.__version__)
print("backend", jax.default_backend(), "| devices", jax.devices(), "| cpus", os.cpu_count())
EOF
BACKEND=$("$PY" -c "import jax; print(jax.default_backend())" 2>> "$LOG")
DEVICE=$("$PY" -c "import jax; print(jax.devices()[0].device_kind)" 2>> "$LOG")
tail -n 2 "$LOG" | sed 's/^/- /' >> "$SUMMARY"
if [ -z "$BACKEND" ]; then
  log "$PY cannot import jax (set PYTHON to the interpreter that has it)"
  echo "- FAILED: no jax in $PY" >> "$SUMMARY"
  exit 1
fi
if [ "$MODE" = gpu ] && [ "$BACKEND" != gpu ]; then
  log "jax's default backend is '$BACKEND', not gpu: is a CUDA jax installed? (--cpu rehearses on CPU)"
  echo "- FAILED: no GPU backend ('$BACKEND')" >> "$SUMMARY"
  exit 1
fi
echo "- device: $DEVICE" >> "$SUMMARY"
echo >> "$SUMMARY"
echo "| part | status | seconds | limit s |" >> "$SUMMARY"
echo "|---|---|---|---|" >> "$SUMMARY"

FAILED=0
PARTS=",${GPU_CHECK_PARTS:-tests,step_time,shampoo,digits},"
# part KEY NAME LIMIT_S COMMAND...: runs COMMAND under `timeout`, output to the
# log, if KEY is in GPU_CHECK_PARTS (default: every part).
part() {
  local key=$1 name=$2 limit=$3; shift 3
  case "$PARTS" in *",$key,"*) ;; *) return 0 ;; esac
  log ""
  log "== $name (limit ${limit} s): $*"
  local start rc status
  start=$(date +%s)
  (cd "$ROOT" && timeout --signal="${PART_SIGNAL:-TERM}" --kill-after=10 "$limit" "$@") >> "$LOG" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status="stopped at the time limit"; FAILED=1 ;;
    *) status="failed (exit $rc)"; FAILED=1 ;;
  esac
  local took=$(( $(date +%s) - start ))
  log "== $name: $status after ${took} s"
  echo "| $name | $status | $took | $limit |" >> "$SUMMARY"
}

# --- 1. single-device tests ---------------------------------------------------
# (SIGINT at the limit: pytest then still prints the failures it has seen.)
JAX_DEFAULT_MATMUL_PRECISION=highest XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
  PART_SIGNAL=INT part tests "single-device tests" "${LIMITS[0]}" \
  "$PY" -m pytest -q -m "not slow" -p no:cacheprovider -n "$WORKERS" -o addopts="" --dist worksteal \
  --durations=15 -rf tests
grep -E "(passed|failed|error).* in [0-9.]+s" "$LOG" | tail -n 1 | sed 's/^=* */- tests: /; s/ *=*$//' >> "$SUMMARY"

# --- 2. step time -------------------------------------------------------------
part step_time "step_time (mlp, cnn, lm)" "${LIMITS[1]}" \
  "$PY" benchmarks/step_time.py --models mlp,cnn,lm --hang-timeout 60 "${STEP_ARGS[@]}" \
  --out "$OUT"

# --- 3. vs_distributed_shampoo's models -----------------------------------------
if "$PY" -c "import precondition.distributed_shampoo" > /dev/null 2>&1; then
  part shampoo "vs_distributed_shampoo (mlp, cnn)" "${LIMITS[2]}" \
    "$PY" benchmarks/vs_distributed_shampoo.py "${SHAMPOO_ARGS[@]}" --out "$OUT"
else
  log "== vs_distributed_shampoo: skipped (the package precondition-opt is not installed)"
  echo "| vs_distributed_shampoo | skipped: precondition-opt not installed | | |" >> "$SUMMARY"
fi

# --- 4. the main example ------------------------------------------------------
part digits "examples/digits.py" "${LIMITS[3]}" \
  "$PY" examples/digits.py "${DIGITS_ARGS[@]}" --out "$OUT/digits"

# --- 5. (on request) where the plain step's time goes -------------------------
part probe "gpu_probe (plain-step pieces, consecutive steps, command buffers)" "${LIMITS[4]}" \
  "$PY" benchmarks/gpu_probe.py --command-buffer-ab

# --- 6. (on request) where the compile goes ------------------------------------
part compile "gpu_probe (compile times, autotuning on and off)" "${LIMITS[5]}" \
  "$PY" benchmarks/gpu_probe.py --compile-ab --models mlp,cnn,lm

# --- 7. (on request) the plain step's gap to SGD's in the profiler -----------
part trace "gpu_probe (profiler trace of the plain steps, K-FAC against SGD)" "${LIMITS[6]}" \
  "$PY" benchmarks/gpu_probe.py --trace --models cnn,lm

echo >> "$SUMMARY"
for f in "$OUT"/step_time*.md; do
  [ -f "$f" ] || continue
  echo "## step time, amortised K-FAC vs SGD ($(basename "$f"))" >> "$SUMMARY"
  grep -E "^## |^\| (sgd|adam|kfac_every|kfac_amortised) " "$f" >> "$SUMMARY"
done
log ""
log "done: $( [ $FAILED = 0 ] && echo 'every part ok' || echo 'some parts failed: see summary.md' )"
exit $FAILED
