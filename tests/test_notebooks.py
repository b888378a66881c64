"""Every notebook in notebooks/ runs top to bottom without error.

quickstart: tag, capture, kd.kfac vs Adam on the digits (well under a minute);
strategies: COMM/MEM/HYBRID/DP-KFAC on 8 host CPU devices, bytes from the compiled
HLO, state memory per device, equality with one device (about a minute on 2 cores;
the 8 devices come from conftest's XLA_FLAGS, or the notebook sets them itself).
"""

import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  notebook = nbformat.read(path, as_version=4)
  nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  errors = [o for cell in notebook.cells if cell.cell_type == "code"
            for o in cell.get("outputs", []) if o.get("output_type") == "error"]
  assert not errors


def test_every_notebook_is_executed():
  assert {"quickstart", "strategies"} <= {p.stem for p in NOTEBOOKS}
