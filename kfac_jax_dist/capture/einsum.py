"""Einsum equations read as Dense layers: which axes are contracted, and the
transpositions that bring the input, the kernel and the output to
`kd.tags.dense_general`'s order (the Flax wrappers' `Einsum` and
`kd.tags.einsum` share it)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax.numpy as jnp


def _expand_ellipsis(term: str, ndim: int, fill: str) -> str | None:
  """`term` with its `...` replaced by the first `ndim − (its letters)` letters
  of `fill`; None where it cannot index `ndim` axes."""
  letters = term.replace("...", "")
  extra = ndim - len(letters)
  if "." in letters or extra < 0 or (extra and "..." not in term):
    return None
  return term.replace("...", fill[:extra])


class EinsumLayout(NamedTuple):
  """How an einsum whose equation is a Dense layer's runs as
  `kd.tags.dense_general`: the input transposed by `input_axes` (its other
  axes, then the contracted ones), the kernel by `kernel_axes` (the contracted
  axes in the input's order, then the output's features in the output's
  order), `in_dims` of them contracted, and the tag's output (the input's
  other axes, then the features) transposed by `output_axes`. An axis order
  that is already the tag's is `None`."""

  in_dims: int
  input_axes: tuple[int, ...] | None
  kernel_axes: tuple[int, ...] | None
  output_axes: tuple[int, ...] | None

  def features(self, kernel_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The output features' shape, in the output's order: the bias's (Flax's
    `Einsum`'s), of a kernel stored as `kernel_shape`."""
    axes = self.kernel_axes or range(len(kernel_shape))
    return tuple(kernel_shape[i] for i in axes)[self.in_dims:]

  def run(self, inputs, tag: Callable[..., Any]):
    """`tag(input, kernel_axes=...)`'s output, in the equation's order."""
    x = inputs if self.input_axes is None else jnp.transpose(inputs, self.input_axes)
    y = tag(x, kernel_axes=self.kernel_axes)
    return y if self.output_axes is None else jnp.transpose(y, self.output_axes)


def _order(term: str, letters: str) -> tuple[int, ...] | None:
  """The axes of `term` in the order `letters` names them; None where that is
  `term`'s own order."""
  axes = tuple(term.index(c) for c in letters)
  return None if axes == tuple(range(len(term))) else axes


def dense_layout(equation, x_ndim: int, kernel_ndim: int) -> EinsumLayout | str:
  """The `EinsumLayout` of an einsum equation that is a Dense layer's: every
  input axis either contracted with the kernel or kept in the output, every
  kernel axis contracted or an output feature, in any order (`BC,CF->BF` up
  to letters and axis order: Gemma's `BTD,NDH->BTNH` and `BTD,SNDH->SBTNH`);
  else why it is not, or "" for an equation that jnp.einsum refuses."""
  if not isinstance(equation, str) or equation.count(",") != 1 or "->" not in equation:
    return ""
  lhs, out = equation.replace(" ", "").split("->", 1)
  xs, ks = lhs.split(",")
  if "..." in ks:
    return "an ellipsis in the kernel's indices"
  fill = "".join(chr(0x3b1 + i) for i in range(x_ndim))   # letters no equation uses
  xs = _expand_ellipsis(xs, x_ndim, fill)
  if xs is None or len(ks) != kernel_ndim:
    return ""
  out = out.replace("...", "".join(c for c in xs if c in fill))
  if any(len(set(term)) != len(term) for term in (xs, ks, out)):
    return "an index repeated within an operand"
  contracted = "".join(c for c in xs if c in ks)
  batch = "".join(c for c in xs if c not in ks)
  features = "".join(c for c in out if c in ks)
  stacked = "".join(c for c in contracted if c in out)
  if (stacked and features and len(stacked) < len(contracted)
      and set(ks) == set(contracted + features)):    # a Dense layer per index of `stacked`
    return (f"the equation {equation!r}, whose kernel axis {stacked!r} is also an input "
            "axis kept in the output (a batched matmul: a stack of Dense layers such as a "
            "mixture's experts; apply each block with kd.tags.dense(..., stack_index=i), in "
            "a loop or under jax.vmap over that axis: docs/concepts.md, 'Mixture of "
            "experts')")
  if (not contracted or not features or set(out) != set(batch + features)
      or set(ks) != set(contracted + features) or stacked):
    return f"the equation {equation!r}, not a Dense layer's"
  return EinsumLayout(len(contracted), _order(xs, batch + contracted),
                      _order(ks, contracted + features),
                      _order(batch + features, out))
