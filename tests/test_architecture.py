"""The shape of the package: short functions, no import cycles, stages in order.

`python tests/test_architecture.py` prints the longest functions and the
module import graph's cycles (none); the tests enforce the limits.
"""

from __future__ import annotations

import ast
import pathlib
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "kfac_jax_dist"
MAX_FUNCTION_LINES = 150
# The data flow: a subpackage may import only from those before it.
STAGES = ("capture", "core", "kfac", "shampoo", "tools", "flax")


def _modules() -> dict[str, ast.Module]:
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    name = ".".join(("kfac_jax_dist",) + path.relative_to(PACKAGE).with_suffix("").parts)
    out[name.removesuffix(".__init__")] = ast.parse(path.read_text(), str(path))
  return out


def function_lengths() -> list[tuple[int, str]]:
  """`(lines, module:function)` of every top-level function and method, its
  nested functions counted in its span."""
  found = []
  for module, tree in _modules().items():
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        found.append((node.end_lineno - node.lineno + 1, f"{module}:{node.name}"))
  return sorted(found, reverse=True)


def import_graph() -> dict[str, set[str]]:
  """Module → the package modules it imports (at any depth of its code)."""
  modules = _modules()
  # A package's __init__ runs before any of its modules: not an edge.
  packages = {m.rsplit(".", 1)[0] for m in modules if "." in m} | {"kfac_jax_dist"}
  graph = {}
  for name, tree in modules.items():
    deps = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        deps |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module:
        deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    graph[name] = {d for d in deps if d in modules and d != name and d not in packages}
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The import cycles (Tarjan's strongly connected components of size > 1)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def _stage(module: str) -> int | None:
  parts = module.split(".")
  return STAGES.index(parts[1]) if len(parts) > 2 and parts[1] in STAGES else None


def test_functions_are_short():
  longest = [(n, f) for n, f in function_lengths() if n > MAX_FUNCTION_LINES]
  assert not longest, f"functions over {MAX_FUNCTION_LINES} lines: {longest}"


def untyped_nested_functions() -> list[str]:
  """Nested functions with an unannotated argument or return."""
  found = []
  for module, tree in _modules().items():
    for outer in ast.walk(tree):
      if not isinstance(outer, ast.FunctionDef):
        continue
      for inner in ast.walk(outer):
        if inner is outer or not isinstance(inner, ast.FunctionDef):
          continue
        args = inner.args.args + inner.args.kwonlyargs + [
            a for a in (inner.args.vararg, inner.args.kwarg) if a is not None]
        if inner.returns is None or any(a.annotation is None for a in args):
          found.append(f"{module}:{outer.name}.{inner.name}")
  return sorted(set(found))


def test_nested_functions_are_typed():
  assert untyped_nested_functions() == []


def test_no_import_cycles():
  assert cycles(import_graph()) == []


def test_stages_import_only_earlier_stages():
  """capture → core → kfac → shampoo → tools → flax: no module imports a later
  stage (shampoo may use core but not kfac; tools read both)."""
  wrong = []
  for module, deps in import_graph().items():
    mine = _stage(module)
    for dep in deps:
      theirs = _stage(dep)
      if mine is not None and theirs is not None and theirs > mine:
        wrong.append((module, dep))
      if mine == STAGES.index("shampoo") and theirs == STAGES.index("kfac"):
        wrong.append((module, dep))
  assert not wrong, wrong


if __name__ == "__main__":
  for lines, name in function_lengths()[:int(sys.argv[1]) if len(sys.argv) > 1 else 10]:
    print(f"{lines:5d}  {name}")
  print("import cycles:", cycles(import_graph()) or "none")
