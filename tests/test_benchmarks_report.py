"""docs/benchmarks.md is what benchmarks/report.py generates from the committed
benchmarks/results/*.json: nobody edits its numbers by hand."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import report  # noqa: E402  pylint: disable=wrong-import-position


def test_docs_benchmarks_md_is_generated():
  with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
    written = f.read()
  assert written == report.render(), (
      "docs/benchmarks.md differs from `python benchmarks/report.py`'s output: rerun it")


def test_every_results_file_has_a_section():
  # (smoke runs' *_quick and layout_balance --alt-layout's *_alt files aside)
  stems = {name[:-len(".json")] for name in os.listdir(report.RESULTS)
           if name.endswith(".json") and not name.endswith(("_quick.json", "_alt.json"))}
  assert stems == {stem for stem, *_ in report.SECTIONS}
