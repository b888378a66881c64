"""docs/benchmarks.md is what benchmarks/report.py generates from the committed
benchmarks/results/*.json: nobody edits its numbers by hand. And the benchmarks'
host allocator keeps freed memory for the next step (PERF_NOTES §43)."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

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


# Allocates and frees a 48 MB array 10 times after a warm-up; prints the page
# faults those 10 took. glibc maps a block that large afresh each time by default.
_FAULTS_SCRIPT = textwrap.dedent("""
    import resource, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import _report
    print(_report.steady_host_allocator())
    faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
      a = np.ones(12 << 20, np.float32); del a
    before = faults()
    for _ in range(10):
      a = np.ones(12 << 20, np.float32); del a
    print(faults() - before)
""")


def _faults(env_value: str) -> tuple[str, int]:
  # (the caller's own glibc malloc settings left out: the defaults are the case)
  env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
  env["BENCH_DEFAULT_MALLOC"] = env_value
  out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, os.path.join(ROOT, "benchmarks")],
                       env=env, capture_output=True, text=True, check=True).stdout.split("\n")
  return out[0], int(out[1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="glibc's mallopt")
def test_steady_host_allocator_ends_the_page_faults_of_freed_blocks():
  default_setting, default_faults = _faults("1")
  steady_setting, steady_faults = _faults("0")
  assert default_setting.startswith("glibc defaults")
  assert steady_setting.startswith("glibc, mmap and trim thresholds fixed at")
  # 10 blocks mapped and faulted in anew: ≥ 24 faults each even in 2 MB pages
  assert default_faults >= 200
  assert steady_faults < 20             # served from the heap, its pages kept
