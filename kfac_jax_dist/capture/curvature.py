"""Exact curvature products of the registered loss: the Gauss-Newton matrix.

For a loss function whose registered loss (`kd.losses`) receives `z(θ)`
(logits / predictions, one row per example x) and averages its per-example
values over `n` examples (the mask's sum, as the loss's own mean does), the
Gauss-Newton matrix of the loss the function returns is

    C = (c/n) Σ_x w_x J_xᵀ H_x J_x,

`J_x = ∂z_x/∂θ`, `w_x` the example's mask weight (1 without a mask), and `H_x`
the Hessian of the per-example loss in `z_x` (see `losses`): softmax
cross-entropy `diag(p) − p pᵀ` (the Fisher), sigmoid cross-entropy
`diag(p(1 − p))`, squared error `I`, Poisson `diag(e^η)` (a Gaussian with a
predicted variance: the Hessian's expectation over the targets, its Fisher
`diag(1/σ², 1/(2σ⁴))`), and `c` the derivative of the returned value in the
registered loss (1 where the function returns it plus terms of
the parameters, `a` for `a · loss`: kfac-jax's loss weight). A loss function
that registers several losses `l` (a multi-task model's heads) has the sum
of theirs, `C = Σ_l (c_l/n_l) Σ_x w_lx J_lxᵀ H_lx J_lx` (kfac-jax's sum over
its registered losses). It is the exact curvature of the loss (whatever
`fisher=` the capture uses for its statistics) where every `c ≥ 0`. A
negative `c` (a likelihood maximised: a GAN's minimax generator, `L₁ − a·L₂`)
counts as `|c|`, as the Monte Carlo factors count it: that loss's Fisher
with weight `|c|`, so `C` stays positive semi-definite and adaptive K-FAC's
quadratic model bounded below (with `c` itself the model's minimum along a
descent direction is a maximum: its steps went uphill). `gram_matrix` returns
`G[i, j] = v_iᵀ C v_j` for a few parameter-shaped vectors `v_i`:

* one forward linearisation: `jax.linearize` of `θ → z` (the loss function run
  in a *curvature* trace, where the registered loss records its input and the
  tags are plain layers), which runs the forward pass once and keeps its
  linearisation; the linear map is then applied to each `v_i`, giving
  `u_i = J v_i` (one tangent pass per vector, sharing the primal: k separate
  `jax.jvp` calls would each recompute it unless XLA merged them);
* the quadratic forms `u_iᵀ H u_j` per example in closed form (no dense `H`,
  no backward pass), in `promote_types(dtype of z, float32)`;
* each `c_l` as the tangent of a zero added to that registered loss's value:
  forward mode around the whole (`jax.jacfwd`, one tangent per loss), which
  only the few operations after the losses carry.

Inside `shard_map` the local batches' sums are added over the mesh axes the
batch varies over: `G = Σ_l psum(c_l Σ_x w_x u_iᵀ H u_j) / psum(n_l)`, the matrix of the
global batch, typed invariant over those axes. `mean_loss` returns the global
batch's loss as `grad_fn` does: each local batch's registered loss weighted
by its share of the global batch's (`shares`), the plain mean of the losses.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from kfac_jax_dist import _compat
from kfac_jax_dist.capture import batches, shares
from kfac_jax_dist.capture import context as _context


def _global_mean(total: jax.Array, n: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """`Σ_l total_l / n_l` of the global batch over the registered losses `l`
  (`total` `[K, ...]`, `n` `[K]`), each summed over the batch's mesh `axes`
  (none outside `shard_map`); an empty batch gives 0, as the loss's mean does."""
  if axes:
    total, n = jax.lax.psum(_compat.as_varying((total, n), axes), axes)
  n = _context.denominator(n).reshape(n.shape + (1,) * (total.ndim - n.ndim))
  return jnp.sum(total / n, axis=0)


def _typed_like_params(params, vectors: tuple) -> tuple[Any, tuple]:
  """`params` and `vectors` with each leaf in its parameter's dtype and typed
  varying over the mesh axes that any of them varies over (forward-mode
  autodiff needs tangents typed like their primals)."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  try:
    vector_leaves = [treedef.flatten_up_to(v) for v in vectors]
  except (ValueError, TypeError) as error:
    raise ValueError("gauss_newton_gram: every vector must have the structure of the "
                     f"parameters ({treedef}): {error}") from None
  new_params, new_vectors = [], [[] for _ in vectors]
  for i, p in enumerate(leaves):
    vs = [jnp.asarray(v[i], jnp.result_type(p)) for v in vector_leaves]
    if any(jnp.shape(v) != jnp.shape(p) for v in vs):
      raise ValueError(f"gauss_newton_gram: a vector's leaf has shape "
                       f"{[jnp.shape(v) for v in vs]}, its parameter {jnp.shape(p)}")
    axes = _compat.varying_axes(p, *vs)
    new_params.append(_compat.as_varying(p, axes))
    for out, v in zip(new_vectors, vs):
      out.append(_compat.as_varying(v, axes))
  return (jax.tree_util.tree_unflatten(treedef, new_params),
          tuple(jax.tree_util.tree_unflatten(treedef, v) for v in new_vectors))


def _loss_gram(hessian: Callable, z: jax.Array, weights: Any, us: list) -> jax.Array:
  """`[k, k]` matrix `Σ_x w_x u_iᵀ H_x u_j` of one registered loss (input `z`,
  output Hessian products `hessian`, curvature weights `weights`), the
  tangents `u_i` of its input, in `promote_types(dtype of z, float32)`."""
  dtype = jnp.promote_types(z.dtype, jnp.float32)
  z, us = z.astype(dtype), [u.astype(dtype) for u in us]
  weights = (jnp.ones(z.shape[:-1], dtype) if weights is None
             else jnp.broadcast_to(weights, z.shape[:-1]).astype(dtype))
  entries = {(i, j): jnp.sum(weights * hessian(z, us[i], us[j]))
             for i in range(len(us)) for j in range(i, len(us))}
  return jnp.stack([jnp.stack([entries[min(i, j), max(i, j)] for j in range(len(us))])
                    for i in range(len(us))])


def _local_gram(fun: Callable, has_aux: bool, params, vectors: tuple, args: tuple,
                kwargs: dict, loss_weight: shares.LossWeight | None = None,
                num_losses: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`([K, k, k] c_l Σ_x w_x u_iᵀ H_x u_j, loss, [K] n_l)` over this call's
  batch for each of the `K = num_losses` registered losses `l`, `u_i = J_l
  v_i` and `c_l` the loss's derivative in that registered loss; the loss is
  the value `fun` returns (its registered losses weighted by `loss_weight`),
  from the same forward pass. `context.LossCountChanged` where `fun`
  registers another number of losses."""

  def gram_at(offsets: jax.Array) -> tuple:
    """The loss with `offsets` added to its registered losses, and the
    unscaled Gram matrices of that pass."""
    hessians = []

    def inputs_of(p: Any) -> tuple:
      out, trace = _context.run_plain(fun, p, args, kwargs, loss_weight, offsets)
      losses = _context.registered(trace)
      if len(losses) != num_losses:
        raise _context.LossCountChanged(len(losses))
      hessians.extend(loss.output_hessian for loss in losses)   # static functions
      value = out[0] if has_aux else out
      return ([loss.inputs for loss in losses],
              ([loss.weights for loss in losses], [loss.num_examples for loss in losses],
               value))

    zs, linear, (weights, ns, value) = jax.linearize(inputs_of, params, has_aux=True)
    us = [linear(v) for v in vectors]
    grams = jnp.stack([_loss_gram(hessians[l], zs[l], weights[l], [u[l] for u in us])
                       for l in range(num_losses)])
    return value, (value, grams, jnp.stack([jnp.asarray(n, grams.dtype) for n in ns]))

  # c_l: the derivative in a zero added to registered loss l, which only the
  # few operations after the losses carry (1 where `fun` returns the registered
  # loss plus terms of the parameters; `a` for `a · loss`): forward mode, one
  # tangent per loss.
  coefficients, (value, grams, n) = jax.jacfwd(gram_at, has_aux=True)(
      jnp.zeros([num_losses], jax.dtypes.canonicalize_dtype(jnp.float64)))
  weights = jnp.abs(coefficients).astype(grams.dtype)       # |c_l|: see the module docstring
  return grams * weights[:, None, None], value, n


def gram_matrix(fun: Callable, has_aux: bool, params, vectors: Sequence, args: tuple,
                kwargs: dict, micro_batches: int = 1) -> tuple[jax.Array, jax.Array]:
  """`([k, k] matrix v_iᵀ C v_j, loss)` for the `k` parameter-shaped `vectors`
  (see the module docstring) and the loss of the same forward pass. With
  `micro_batches`, the sums run over that many slices of `args`, one at a
  time. Traced for one registered loss first, again for as many as `fun`
  registers where that differs."""
  vectors = tuple(vectors)
  if not vectors:
    raise ValueError("gauss_newton_gram needs at least one vector.")
  k = batches.check(micro_batches, "gauss_newton_gram")
  params, vectors = _typed_like_params(params, vectors)
  try:
    return _gram_matrix(fun, has_aux, params, vectors, args, kwargs, k, 1)
  except _context.LossCountChanged as changed:
    return _gram_matrix(fun, has_aux, params, vectors, args, kwargs, k, changed.count)


def _gram_matrix(fun: Callable, has_aux: bool, params, vectors: tuple, args: tuple,
                 kwargs: dict, k: int, num_losses: int) -> tuple[jax.Array, jax.Array]:
  """`gram_matrix` for a `fun` registering `num_losses` losses."""
  axes = _compat.varying_axes(args, kwargs)
  if not axes and k == 1:                  # the loss exactly as `fun` returns it
    gram, value, n = _local_gram(fun, has_aux, params, vectors, args, kwargs,
                                 num_losses=num_losses)
    return _global_mean(gram, n, axes), value
  batches.check_keywords(kwargs, k, "gauss_newton_gram")
  weight = shares.loss_weight(fun, params, args, kwargs, k, "gauss_newton_gram")

  def one(ops: tuple, a: tuple, kw: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
    return _local_gram(fun, has_aux, *ops, a, kw, weight, num_losses)

  gram, total, n = batches.summed(one, (params, vectors), args, kwargs, k,
                                  "gauss_newton_gram",
                                  _compat.varying_axes(params, vectors, args, kwargs))
  return _global_mean(gram, n, axes), shares.mean_of_shares(total, k, axes)


def mean_loss(fun: Callable, has_aux: bool, params, args: tuple, kwargs: dict,
              micro_batches: int = 1) -> jax.Array:
  """The loss `fun(params, *args, **kwargs)` returns (without its aux): a
  forward pass; inside `shard_map` (or over `micro_batches` slices of `args`)
  the whole batch's: the plain mean of the local losses, their registered
  losses weighted as shares of the global batch's (`shares`)."""
  k = batches.check(micro_batches, "loss")
  axes = _compat.varying_axes(args, kwargs)
  batches.check_keywords(kwargs, k, "loss")
  weight = shares.loss_weight(fun, params, args, kwargs, k, "loss")

  def one(p: Any, a: tuple, kw: dict) -> jax.Array:
    out, _ = _context.run_plain(fun, p, a, kw, weight)
    return out[0] if has_aux else out

  if not axes and k == 1:              # the loss exactly as `fun` returns it
    return one(params, args, kwargs)
  total = batches.summed(one, params, args, kwargs, k, "loss",
                         _compat.varying_axes(params, args, kwargs))
  return shares.mean_of_shares(total, k, axes)
