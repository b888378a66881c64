"""benchmarks/gpu_check.sh, the script a lent GPU machine runs once: its shell
logic works here, so that a session's few device minutes are not spent on a
broken script (its parts are the benchmarks' and tests' own, run elsewhere)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")


def _run(out, *args, python=sys.executable, parts="none"):
  env = dict(os.environ, PYTHON=python, GPU_CHECK_PARTS=parts)
  return subprocess.run(["bash", SCRIPT, str(out), *args], env=env, capture_output=True,
                        text=True, timeout=120, check=False)


def test_rehearsal_without_parts_writes_the_summary(tmp_path):
  done = _run(tmp_path, "--cpu")
  assert done.returncode == 0, done.stdout + done.stderr
  summary = (tmp_path / "summary.md").read_text()
  assert summary.startswith("# GPU check (cpu)")
  assert "- device: cpu" in summary and "| part | status | seconds | limit s |" in summary
  log = (tmp_path / "gpu_check.log").read_text()
  assert "backend cpu" in log and "done: every part ok" in log


def test_an_interpreter_without_jax_fails_at_once(tmp_path):
  done = _run(tmp_path, "--cpu", python="false", parts="tests,step_time,digits")
  assert done.returncode == 1
  assert "FAILED: no jax in false" in (tmp_path / "summary.md").read_text()
  assert "==" not in (tmp_path / "gpu_check.log").read_text().split("== environment", 1)[1]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="this machine has an accelerator")
def test_gpu_mode_without_a_gpu_fails_and_says_why(tmp_path):
  done = _run(tmp_path)
  assert done.returncode == 1
  assert "FAILED: no GPU backend ('cpu')" in (tmp_path / "summary.md").read_text()


def test_unknown_arguments_are_refused(tmp_path):
  assert _run(tmp_path, "--gpu").returncode == 2
  assert "usage:" in _run(tmp_path, "--gpu").stderr


# benchmarks/gpu_probe.py --trace: the profiler's view of a plain step, which the
# next GPU run needs to say where K-FAC's gap to SGD goes (issue 16, item 4).

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_probe  # noqa: E402  pylint: disable=wrong-import-position


def test_busy_time_is_the_union_of_the_kernels_intervals():
  rng = np.random.default_rng(0)
  for _ in range(20):     # microseconds on a grid of 1: the union counted point by point
    starts = rng.integers(0, 200, size=rng.integers(1, 12))
    durs = rng.integers(0, 40, size=starts.size)
    covered = np.zeros(260, bool)
    for s, d in zip(starts, durs):
      covered[s:s + d] = True
    events = [{"ts": float(s), "dur": float(d)} for s, d in zip(starts, durs)]
    assert gpu_probe._busy_ms(events) == pytest.approx(covered.sum() / 1e3)


def test_kernels_are_named_by_their_innermost_library_file():
  import kfac_jax_dist as kd   # pylint: disable=import-outside-toplevel
  x = jnp.ones((4, 3))
  f = jax.jit(lambda x: kd.losses.softmax_cross_entropy(jnp.tanh(x) * 2.0, jnp.zeros(4, int)))
  text = f.lower(x).compile().as_text()
  sources = gpu_probe.op_sources(text)
  assert "capture/losses.py" in set(sources.values())
  assert set(sources.values()) <= {"outside"} | {
      s for s in sources.values() if os.path.exists(os.path.join(ROOT, "kfac_jax_dist", s))}


@pytest.mark.slow
def test_probe_trace_on_cpu():
  done = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_probe.py"), "--trace", "--quick",
       "--models", "mlp"], env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
      text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stdout + done.stderr
  rows = {line.split(" | ")[0].strip(): [float(v) for v in line.split(" | ")[1:]]
          for line in done.stdout.splitlines()[2:]}
  sgd, kfac, diff = zip(*[rows[k] for k in ("wall ms", "kernels", "device busy ms")])
  assert kfac[1] > sgd[1] > 0                        # more kernels run in K-FAC's step
  assert sgd[2] <= sgd[0] and kfac[2] <= kfac[0]     # busy within the wall time
  assert rows["kernel ms, kfac/linalg.py"][0] == 0 < rows["kernel ms, kfac/linalg.py"][1]
  assert diff[1] == kfac[1] - sgd[1]


def test_runs_split_by_id_or_at_the_widest_gaps():
  rng = np.random.default_rng(1)
  steps, events, t = 5, [], 0.0
  for step in range(steps):       # kernels 0-3 us apart (some overlapping), steps 50 us
    for _ in range(int(rng.integers(1, 8))):
      events.append({"ts": t, "dur": 2.0, "args": {"run_id": str(step)}, "step": step})
      t += float(rng.integers(0, 4))
    t += 50.0
  rng.shuffle(events)
  for drop_ids in (False, True):
    if drop_ids:
      for e in events:
        del e["args"]["run_id"]
    runs = gpu_probe._runs(events, steps)
    assert [sorted({e["step"] for e in run}) for run in runs] == [[i] for i in range(steps)]
    assert sum(map(len, runs)) == len(events)
