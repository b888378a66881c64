"""benchmarks/gpu_check.sh, the script a lent GPU machine runs once: its shell
logic works here, so that a session's few device minutes are not spent on a
broken script (its parts are the benchmarks' and tests' own, run elsewhere)."""

import os
import subprocess
import sys

import jax
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
