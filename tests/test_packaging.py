"""What a release carries: the typing marker (PEP 561) in the wheel, the
licence text the metadata names, a source distribution whose tests run
(their support files and the directories they read), and a clear error where
an optional dependency is missing."""

from __future__ import annotations

import pathlib
import re
import sys
import tomllib

import numpy as np
import pytest

import kfac_jax_dist as kd

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
  return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_wheel_ships_the_typing_marker():
  """Type checkers read an installed package's annotations only with
  `py.typed` in it (mypy: "missing library stubs or py.typed marker")."""
  assert (ROOT / "kfac_jax_dist" / "py.typed").is_file()
  package_data = _pyproject()["tool"]["setuptools"]["package-data"]
  assert "py.typed" in package_data["kfac_jax_dist"]


def test_the_licence_text_is_the_one_the_metadata_names():
  assert _pyproject()["project"]["license"] == "Apache-2.0"
  text = (ROOT / "LICENSE").read_text()
  assert "Apache License" in text and "Version 2.0, January 2004" in text
  assert "END OF TERMS AND CONDITIONS" in text


def test_the_source_distribution_carries_what_the_tests_read():
  """setuptools puts `tests/test_*.py` in an sdist by default but not
  conftest.py or helpers.py, nor the directories the tests read: MANIFEST.in
  grafts them."""
  grafted = set(re.findall(r"^graft (\S+)$", (ROOT / "MANIFEST.in").read_text(), re.M))
  read = set()
  for path in (ROOT / "tests").glob("*.py"):
    read |= set(re.findall(r'ROOT / "(examples|benchmarks|notebooks|docs)"', path.read_text()))
  assert read and read | {"tests"} <= grafted, (read, grafted)


def test_checkpoints_without_orbax_name_the_extra(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)     # import fails
  with pytest.raises(ImportError, match=re.escape("kfac_jax_dist[checkpoint]")):
    kd.save_checkpoint(tmp_path / "ckpt", {"x": np.zeros(2)})
