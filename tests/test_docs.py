"""The documentation against the code: the README's Quickstart and distributed
snippet run as written, docs/api.md gives every public name its real
signature and its examples run, `help()` of the main entry points describes
every argument, and `kd.describe` prints no bare abbreviation."""

from __future__ import annotations

import ast
import inspect
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import kfac_jax_dist as kd

import helpers

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
API = ROOT / "docs" / "api.md"


def _python_blocks(markdown: str) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", markdown, re.S | re.M)


def _section(markdown: str, title: str, exact: bool = False) -> str:
  """The text under the first heading that names `` `title` `` (or, with
  `exact`, reads `title`), up to the next heading of the same or a higher
  level; lines inside code blocks are not headings."""
  lines, fenced, start, level = markdown.splitlines(), False, None, 0
  for i, line in enumerate(lines):
    if line.startswith("```"):
      fenced = not fenced
    heading = None if fenced else re.match(r"^(#+) (.*)$", line)
    if not heading:
      continue
    if start is not None and len(heading.group(1)) <= level:
      return "\n".join(lines[start:i])
    if start is None and (heading.group(2) == title if exact
                          else f"`{title}`" in heading.group(2)):
      start, level = i + 1, len(heading.group(1))
  assert start is not None, f"no heading for {title!r}"
  return "\n".join(lines[start:])


def _run(code: str, devices: int | None = None, **env_vars: str) -> str:
  """`code` in a fresh interpreter (this checkout's package first on the path,
  `env_vars` set); its stdout. With `devices`, that many host CPU devices."""
  env = dict(os.environ, **env_vars, PYTHONPATH=os.pathsep.join(
      [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                 env.get("XLA_FLAGS", ""))
  if devices is not None:
    flags += f" --xla_force_host_platform_device_count={devices}"
  env["XLA_FLAGS"] = flags.strip()
  done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-4000:]
  return done.stdout


# ---------------------------------------------------------------------------
# README.
# ---------------------------------------------------------------------------

def _readme_block(heading: str) -> str:
  """The first python block of the README section `heading`."""
  blocks = _python_blocks(_section(README.read_text(), heading, exact=True))
  assert blocks, f"README section {heading!r} has no python block"
  return blocks[0]


def _losses(stdout: str) -> list[float]:
  return [float(v) for v in re.findall(r"^step +\d+ +loss +(\S+)$", stdout, re.M)]


def test_readme_is_at_most_10_kb():
  assert len(README.read_bytes()) <= 10_000


def test_readme_quickstart_trains():
  """The Quickstart, as written, in a fresh interpreter on one device: it
  prints finite losses that fall."""
  losses = _losses(_run(_readme_block("Quickstart"), devices=1))
  assert len(losses) >= 3, losses
  assert np.all(np.isfinite(losses)), losses
  assert losses[-1] < 0.5 * losses[0], losses


def test_readme_distributed_snippet_trains():
  """The distributed snippet continues the Quickstart on 8 CPU devices (as
  the README says) and trains too."""
  marker = "--- distributed ---"
  out = _run(_readme_block("Quickstart") + f"\nprint({marker!r})\n"
             + _readme_block("Distributed K-FAC"), devices=8)
  losses = _losses(out.split(marker)[1])
  assert len(losses) >= 2 and np.all(np.isfinite(losses)), out
  assert losses[-1] < losses[0], losses


# ---------------------------------------------------------------------------
# docs/api.md: every public name with its signature.
# ---------------------------------------------------------------------------

class _Unqualify(ast.NodeTransformer):
  """`jax.Array` → `Array`: the docs may drop module prefixes of type names
  (which also change when the code moves)."""

  def visit_Attribute(self, node):
    return ast.copy_location(ast.Name(id=node.attr, ctx=node.ctx), node)


def _annotation(text: str | None) -> str | None:
  if text is None:
    return None
  return ast.unparse(_Unqualify().visit(ast.parse(text, mode="eval")))


def _code_signature(obj) -> tuple:
  """`(parameters, return annotation)` of `inspect.signature(obj)`:
  `(name, kind, annotation, default)` per parameter, private ones (a leading
  underscore) left out; no return annotation for a class."""

  def annotation(a):
    if a is inspect.Parameter.empty:
      return None
    return _annotation(a if isinstance(a, str) else inspect.formatannotation(a))

  sig = inspect.signature(obj)
  params = tuple((p.name, p.kind.name, annotation(p.annotation),
                  None if p.default is p.empty else ("=", p.default))
                 for p in sig.parameters.values() if not p.name.startswith("_"))
  ret = None if inspect.isclass(obj) else annotation(sig.return_annotation)
  return params, ret


def _value(node: ast.expr):
  """A documented default: a literal, or a public name of the package (a
  state class)."""
  if isinstance(node, ast.Name) and node.id in kd.__all__:
    return getattr(kd, node.id)
  return ast.literal_eval(node)


def _doc_signature(text: str) -> tuple:
  """The same, from a documented `name(...) -> ...` (Python syntax)."""
  fn = ast.parse(f"def {text}: pass").body[0]
  args = fn.args
  out = []

  def add(arg, kind, default):
    ann = None if arg.annotation is None else _annotation(ast.unparse(arg.annotation))
    out.append((arg.arg, kind, ann, None if default is None else ("=", _value(default))))

  positional = args.posonlyargs + args.args
  defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
  for i, (arg, default) in enumerate(zip(positional, defaults)):
    add(arg, "POSITIONAL_ONLY" if i < len(args.posonlyargs) else "POSITIONAL_OR_KEYWORD",
        default)
  if args.vararg:
    add(args.vararg, "VAR_POSITIONAL", None)
  for arg, default in zip(args.kwonlyargs, args.kw_defaults):
    add(arg, "KEYWORD_ONLY", default)
  if args.kwarg:
    add(args.kwarg, "VAR_KEYWORD", None)
  ret = None if fn.returns is None else _annotation(ast.unparse(fn.returns))
  return tuple(out), ret


def _documented_signature(section: str, name: str) -> str:
  """`name(...)` as written in the section's unlabelled code blocks: the line
  starting with `name(` and the indented lines after it."""
  for block in re.findall(r"^```\n(.*?)^```", section, re.S | re.M):
    lines = block.splitlines()
    for i, line in enumerate(lines):
      if line.startswith(f"{name}("):
        text = [line]
        for more in lines[i + 1:]:
          if not more[:1].isspace():
            break
          text.append(more)
        return " ".join(t.strip() for t in text)
  raise AssertionError(f"no signature `{name}(...)` in its section of docs/api.md")


def _public_names():
  """`(qualified name, object)`: `kd.<name>` for `__all__`, and the functions of
  `kd.tags` and `kd.losses`."""
  names = [(f"kd.{n}", getattr(kd, n)) for n in kd.__all__]
  names.append(("kd.Distribution.auto", kd.Distribution.auto))
  for module in (kd.tags, kd.losses):
    short = module.__name__.split(".")[-1]
    names += [(f"kd.{short}.{n}", f) for n, f in vars(module).items()
              if inspect.isfunction(f) and f.__module__ == module.__name__
              and not n.startswith("_")]
  return names


def test_find_states_is_public():
  assert "find_states" in kd.__all__ and kd.find_states is not None


@pytest.mark.parametrize("qualname,obj", [pytest.param(q, o, id=q) for q, o in _public_names()])
def test_api_md_documents_the_signature(qualname, obj):
  section = _section(API.read_text(), qualname)
  if inspect.ismodule(obj):
    assert section.strip(), f"the section of {qualname} is empty"
    return
  name = qualname.split(".")[-1]
  documented = _documented_signature(section, name)
  assert _doc_signature(documented) == _code_signature(obj), (
      f"docs/api.md: {documented}\ncode: {name}{inspect.signature(obj)}")


@pytest.mark.slow          # (.ci/run runs it on the oldest jax)
def test_api_md_examples_run(tmp_path):
  """The page's python blocks, in order, in one fresh interpreter (8 CPU
  devices, as its Distribution example assumes; its checkpoint goes to
  `tmp_path`)."""
  blocks = _python_blocks(API.read_text())
  _run("\n".join(blocks), devices=8, TMPDIR=str(tmp_path))


def test_concepts_md_examples_run():
  """concepts.md's python blocks, in order, in one fresh interpreter (8 CPU
  devices, as its SP-NGD example's mesh assumes), as docs/index.md says."""
  _run("\n".join(_python_blocks((ROOT / "docs" / "concepts.md").read_text())), devices=8)


# ---------------------------------------------------------------------------
# help(): every argument described.
# ---------------------------------------------------------------------------

def _described(obj) -> set[str]:
  """The names the `Args:` / `Attributes:` section of `obj`'s docstring
  describes (entries `name:` or `name, other:`)."""
  doc = inspect.getdoc(obj) or ""
  section = re.search(r"^(?:Args|Attributes):\n(.*?)(?=^\S|\Z)", doc, re.S | re.M)
  assert section, f"{obj.__name__}'s docstring has no Args: or Attributes: section"
  names = set()
  for entry in re.findall(r"^  (\w+(?:, \w+)*):", section.group(1), re.M):
    names.update(entry.split(", "))
  return names


@pytest.mark.parametrize("obj", [kd.kfac, kd.scale_by_kfac, kd.Distribution, kd.shampoo,
                                 kd.scale_by_shampoo, kd.soap, kd.scale_by_soap,
                                 kd.describe],
                         ids=lambda f: f.__name__)
def test_help_describes_every_argument(obj):
  params = set(inspect.signature(obj).parameters)
  described = _described(obj)
  assert params <= described, f"not described: {sorted(params - described)}"
  assert described <= params, f"described but not parameters: {sorted(described - params)}"


# ---------------------------------------------------------------------------
# kd.describe.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("fraction", [None, 1.0, 1 / 8])
def test_describe_prints_words_not_abbreviations(fraction):
  """No `key=value` pairs (such as the former `L2=`) and no storage code
  names (`chunked`, `owner factors`) in the summary; the legend explains the
  table's factor columns."""
  loss_fn, params, x, y = helpers.conv_dense_problem()
  layers = kd.value_and_grad(loss_fn).discover(params, x, y)
  dist = None if fraction is None else kd.Distribution(
      helpers.data_mesh(8), grad_worker_fraction=fraction)
  text = kd.describe(kd.kfac(0.1, layers=layers, distribution=dist).init(params),
                     print_table=False)
  summary = text[text.index("\n\n"):]
  assert not re.search(r"\w=", summary), summary
  assert "chunked" not in summary and "owner factors" not in summary, summary
  assert "A, G: " in summary and "owner: " in summary and "bytes: " in summary, summary
  assert "bytes per device" in summary, summary
  if fraction is not None:
    assert f"8 devices in {round(1 / fraction)} owner group" in summary, summary


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_describe_gives_the_second_order_padding(fraction):
  """COMM-OPT: the replicated array holds every owner's segment one after
  another in one row; describe gives the numbers the owners use, which for
  eigendecompositions of full factors are Σ d² + d over the factors (a split
  factor's column pieces hold its d columns once), and the array is exactly
  those. HYBRID (two groups of four): each device's array holds one slot per
  rank, each as long as the groups' longest segment of that rank; the
  numbers used are the busiest group's."""
  loss_fn, params, x, y = helpers.conv_dense_problem()
  layers = kd.value_and_grad(loss_fn).discover(params, x, y)
  dist = kd.Distribution(helpers.data_mesh(8), grad_worker_fraction=fraction)
  state = kd.kfac(0.1, layers=layers, distribution=dist).init(params)
  text = kd.describe(state, print_table=False)
  m = round(8 * fraction)
  found = re.search(rf"Second-order state \(eigenbases and eigenvalues\): ([\d,]+) numbers "
                    rf"per device \(the segments of its group's {m} owners: ([\d.]+)x the "
                    r"([\d,]+) they use\)", text)
  assert found, text
  array, ratio, used = (float(g.replace(",", "")) for g in found.groups())
  lay = kd.find_states(state)[0].layout
  # the global array: one copy (COMM-OPT) or each device's part (sharded)
  assert kd.find_states(state)[0].second_order.shape[0] // (1 if m == 8 else 8) == array
  assert array == lay.second_array and ratio == pytest.approx(array / used, abs=0.005)
  if m < 8:
    assert used == max(sum(lay.second_sizes[g * m:(g + 1) * m]) for g in (0, 1))
    assert array == sum(lay.second_capacity) < m * lay.second_segment
    return
  assert used == sum(d * d + d for layer in layers for d in (layer.a_dim, layer.g_dim))
  assert array == used
