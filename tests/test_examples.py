"""The examples' `--adaptive` path (adaptive K-FAC with the library's defaults):
a few steps of examples/digits.py, autoencoder.py and transformer_lm.py on
small settings, in this process (jax is already loaded). Each run learns, logs
a finite learning rate η = −α > 0, a finite μ and λ > 0 at every evaluation,
and writes its two output files into `--out` and nothing else (the working
directory stays empty, no bytecode lands in examples/).

The examples need scikit-learn, matplotlib and tqdm (the `examples` extra).
"""

from __future__ import annotations

import csv
import importlib.util
import math
import pathlib
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
OUTPUTS = {"digits": ("metrics.csv", "digits.png"),          # (CSV, plot) in --out
           "autoencoder": ("autoencoder.csv", "autoencoder.png"),
           "transformer_lm": ("transformer_lm.csv", "transformer_lm.png")}


def _run(name: str, argv: list[str], tmp_path, monkeypatch) -> list[dict[str, str]]:
  """Runs examples/`name`.py's main() with `argv` from an empty working
  directory; returns the rows of the CSV it wrote, after checking that the
  output folder holds exactly the CSV and the PNG and nothing else was written."""
  for module in ("sklearn", "matplotlib", "tqdm"):
    pytest.importorskip(module)
  work, out = tmp_path / "work", tmp_path / "out"
  work.mkdir()
  monkeypatch.chdir(work)
  monkeypatch.syspath_prepend(str(EXAMPLES))            # their `import _host_devices`, `_adaptive_log`
  monkeypatch.setattr(sys, "dont_write_bytecode", True)
  monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv, "--out", str(out)])
  before = sorted(p.name for p in EXAMPLES.iterdir())
  spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, spec.name, module)    # (its dataclasses look it up)
  spec.loader.exec_module(module)
  module.main()
  csv_name, _ = OUTPUTS[name]
  assert sorted(p.name for p in out.iterdir()) == sorted(OUTPUTS[name])
  assert list(work.iterdir()) == []
  assert sorted(p.name for p in EXAMPLES.iterdir()) == before
  with open(out / csv_name, newline="") as f:
    return list(csv.DictReader(f))


def _adapted(rows: list[dict[str, str]], method: str) -> list[dict[str, str]]:
  """The method's rows; its η = −α, μ and λ are checked."""
  mine = [r for r in rows if r["method"] == method]
  assert mine
  for r in mine[1:]:                          # (the first row is before any step)
    eta, mu, lam = float(r["learning_rate"]), float(r["momentum"]), float(r["damping"])
    assert math.isfinite(eta) and eta > 0, r
    assert math.isfinite(mu), r
    assert math.isfinite(lam) and lam > 0, r
  return mine


@pytest.mark.slow
def test_digits_adaptive_beside_fixed(tmp_path, monkeypatch):
  rows = _run("digits", ["--adaptive", "--skip-baselines", "--steps", "20",
                         "--batch-size", "64", "--eval-every", "5"], tmp_path, monkeypatch)
  assert {r["method"] for r in rows} == {"K-FAC", "K-FAC adaptive"}
  mine = _adapted(rows, "K-FAC adaptive")
  assert all(r["learning_rate"] == "" for r in rows if r["method"] == "K-FAC")
  first, last = float(mine[0]["test_accuracy"]), float(mine[-1]["test_accuracy"])
  assert first < 0.3 and last > 0.8, (first, last)
  # ρ is measured every 5 steps, so it is known at every evaluation after step 0.
  assert all(math.isfinite(float(r["rho"])) for r in mine[1:])


@pytest.mark.slow
def test_autoencoder_adaptive(tmp_path, monkeypatch):
  rows = _run("autoencoder", ["--adaptive", "--skip-fixed-kfac", "--skip-baselines",
                              "--steps", "20", "--batch-size", "128", "--eval-every", "5",
                              "--sizes", "64", "16"], tmp_path, monkeypatch)
  mine = _adapted(rows, "K-FAC adaptive")
  assert {r["method"] for r in rows} == {"K-FAC adaptive"}
  first, last = (float(mine[i]["train_loss_above_floor"]) for i in (0, -1))
  assert last < 0.5 * first, (first, last)


@pytest.mark.slow
def test_transformer_lm_adaptive(tmp_path, monkeypatch):
  rows = _run("transformer_lm", [
      "--adaptive", "--skip-fixed-kfac", "--skip-baselines", "--steps", "15",
      "--eval-every", "5", "--batch-size", "8", "--context", "16", "--width", "32",
      "--heads", "2", "--layers", "1", "--valid-sequences", "16", "--sample", "5"],
      tmp_path, monkeypatch)
  mine = _adapted(rows, "K-FAC adaptive")
  first, last = (float(mine[i]["valid_loss"]) for i in (0, -1))
  assert last < first - 0.5, (first, last)
