"""`kd.value_and_grad`: gradients plus the curvature statistics of tagged layers.

The loss function is traced once abstractly to discover its tagged layers and
its registered loss, then evaluated under `jax.vjp` with one zero "probe" per
factor: the probes' cotangents are the statistics (see `tags`). Gradients are
exactly `jax.value_and_grad`'s.

Fisher estimates (Martens & Grosse, 2015):

* "empirical": `G` from the gradients of the loss on the true targets (one
  backward pass serves gradients and statistics);
* "mc": `G` from the gradients of the loss on targets drawn from the model's
  predictive distribution (one more backward pass over the same forward).

Several registered losses (one per head) add their curvatures, each times the
returned value's derivative in it: each loss seeds the statistics' backward
pass with its own weight (`_backward_per_loss`), one more pass under
"empirical" unless every loss averages over the same number of examples
unmasked.

Given `opt_state`, the statistics are skipped at run time unless the K-FAC
state's `update_factors` is set (the returned statistics are then NaN
placeholders: consumed on a factor step, e.g. when captured with another
step's `opt_state`, they make the step faulty and it is skipped), and diagonal
factors are computed as diagonals. A state that consumes them at every step
(`statistics_every_step`: factors updated every step, no stale statistics)
gets them with no conditional. Where the skip happens otherwise is
`skip_statistics`:

* "layer": one `lax.cond` per tagged layer in the backward pass, around its
  statistics (the model's forward and backward are compiled once);
* "pass": one `lax.cond` around the whole forward and backward pass, one
  branch with the statistics and one without (the model compiled twice).

On a GPU every `lax.cond` copies its predicate to the host and waits for the
device to drain (XLA's conditional thunk), about 70 µs each measured on an
H100 (benchmarks/results/gpu): "layer" pays it once per tagged layer per
step, "pass" once per step. "auto" (default) is "layer" on CPU, where a
conditional costs nothing and compile time is what users wait for, and
"pass" on other backends (`jax.default_backend()` when traced).

Inside `shard_map` both the statistics and the gradients are the device's
local ones (of its local batch): replicated parameters are cast to varying
before differentiation, so autodiff does not sum their gradients over the
axis. Average them yourself (`lax.pmean`) or let `kd.Distribution`'s
`gradient_reduction` do it. Where the devices' numbers of examples differ (a
loss mask), the registered loss is weighted as the device's share of the
global batch's, so that the plain means of the loss and gradients are the
global batch's, its other terms included (`shares`).

Outside `shard_map`, on arrays lying on a mesh with `Explicit` axes
(`jax.make_mesh`'s default on jax 0.10.2 and 0.12), each entry point runs
with those axes `Auto` (`_compat.on_auto_axes`): the loss and statistics come
back replicated, the gradients laid out as the parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from kfac_jax_dist import _compat
from kfac_jax_dist.capture import batches, curvature, registry, shares, stacking
from kfac_jax_dist.capture import context as _context
from kfac_jax_dist.capture import statistics as factors

FISHERS = ("empirical", "mc")
SKIPS = ("auto", "layer", "pass")
# How the layers of the loss are captured (`value_and_grad(capture=...)`):
# name -> a wrapper of the loss function, None for the tags alone. Later stages
# register theirs (`kfac_jax_dist.flax.intercept`: "flax"), so that the capture
# imports none of them.
CAPTURES: dict[str, Callable[[Callable], Callable] | None] = {"tags": None}


def register_capture(name: str, wrap: Callable[[Callable], Callable]) -> None:
  """Makes `value_and_grad(fun, capture=name)` trace `wrap(fun)`."""
  CAPTURES[name] = wrap


def _new_trace(mode: str, params, **fields) -> _context.Trace:
  """A trace whose leaf tables describe `params` (as given, before
  `stacking.prepare`, which keeps the leaves themselves)."""
  named = registry.named_leaves(params)
  return _context.Trace(
      mode=mode, leaf_paths={id(leaf): name for name, leaf in named},
      leaf_shapes={name: tuple(jnp.shape(leaf)) for name, leaf in named},
      leaf_dtypes={name: jnp.result_type(leaf) for name, leaf in named}, **fields)


def _probes(layer: registry.TaggedLayer, forms: tuple[str, str],
            dtype: Any = jnp.float32, repeats: bool = False) -> dict:
  """Zero probes shaped like the layer's statistics (see `value_and_grad`),
  with the leading stack axes of a stacked layer, in the statistics' `dtype`
  (`factors.statistics_dtype`, recorded by the discovery); `repeats`: a
  probe counts the layer's positions (it may run several times in a pass, or
  sit out one, or run under a row mask)."""
  stack = tuple(layer.stack)
  counted = {factors.POSITIONS: jnp.zeros(stack, dtype)} if repeats else {}
  if layer.unitwise:
    return {"F": jnp.zeros(stack + (layer.g_dim, 3), dtype)} | counted
  a_form = factors.DIAG if layer.a_diagonal else forms[0]
  return {key: jnp.zeros(stack + factors.statistic_shape(d, form), dtype)
          for key, d, form in (("A", layer.a_dim, a_form), ("G", layer.g_dim, forms[1]))
          } | counted


def _correction_probes(layer: registry.TaggedLayer, state: Any, dtype: Any) -> dict:
  """EK-FAC: the eigenbases `QA`, `QG` the state asks the layer's `S` in
  (stacked like the layer) and a zero probe for `S`; `{}` otherwise."""
  bases_of = getattr(state, "correction_block_bases", None)
  bases = None if bases_of is None else bases_of(tuple(b.name for b in layer.blocks()))
  if bases is None:
    return {}
  stack = tuple(layer.stack)
  qa, qg = (q.reshape(stack + q.shape[1:]).astype(dtype) for q in bases)
  return {factors.BASES[0]: qa, factors.BASES[1]: qg,
          factors.CORRECTED: jnp.zeros(stack + (layer.a_dim, layer.g_dim), dtype)}


def _statistics_consumer(opt_state: Any) -> Any:
  """The optimizer state in `opt_state` that consumes the statistics, or None:
  K-FAC's, found by what it offers (`statistic_forms`, `update_factors`), so
  that the capture, upstream of the optimizers, imports none of them. Two
  that precondition one layer (a chain preconditioning twice) are refused."""
  consumes = lambda x: hasattr(x, "statistic_forms") and hasattr(x, "update_factors")
  found = [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=consumes)
           if consumes(x)] if opt_state is not None else []
  if len(found) > 1:
    shared = set.intersection(*({plan.layer.name for plan in x.layout.plans} for x in found))
    if shared:
      raise ValueError(
          f"opt_state holds {len(found)} K-FAC states that precondition the same layers "
          f"({', '.join(sorted(shared))}): each of the chain's K-FAC transforms would "
          "precondition their gradients again. Keep one K-FAC transform per layer (skip= "
          "its layers in the others).")
    raise ValueError("opt_state holds several K-FAC states; pass the one to use.")
  return found[0] if found else None


def _unbound_axis(error: NameError) -> str | None:
  match = re.search(r"unbound axis name: ([^\s.]+)", str(error))
  return match.group(1) if match else None


def _binding_axes(fun: Callable, axis_names: Sequence[str]) -> Callable:
  """`fun` with each of `axis_names` bound as a size-1 axis (a `vmap` over no
  argument), so that a loss using collectives over mesh axes (synchronised
  BatchNorm's `pmean`) can be traced outside `shard_map`; a collective over a
  size-1 axis is the identity, and the unbatched arguments pass through as the
  same tracers (the tags match parameters by identity)."""
  for name in axis_names:
    fun = jax.vmap(fun, in_axes=None, axis_size=1, axis_name=name)
  return fun


# The keyword arguments of `ValueAndGrad`'s calls that are its own, not the
# loss function's (what each is for, for the error of `_check_own_keywords`).
OWN_KEYWORDS = {"rng": "the Monte Carlo Fisher's key",
                "opt_state": "the optimizer state the statistics are shaped for",
                "loss_scale": "the mixed-precision loss scale"}


def _keyword_parameters(fun: Callable) -> frozenset[str]:
  """The names of `fun`'s parameters that a keyword argument would bind
  (none where its signature cannot be read)."""
  try:
    parameters = inspect.signature(fun).parameters.values()
  except (TypeError, ValueError):
    return frozenset()
  return frozenset(p.name for p in parameters
                   if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


class ValueAndGrad:
  """Callable returned by `kd.value_and_grad`; see there."""

  def __init__(self, fun: Callable, has_aux: bool, fisher: str, capture: str = "tags",
               skip_statistics: str = "auto"):
    if fisher not in FISHERS:
      raise ValueError(f"fisher must be one of {FISHERS}, got {fisher!r}")
    if skip_statistics not in SKIPS:
      raise ValueError(f"skip_statistics must be one of {SKIPS}, got {skip_statistics!r}")
    if capture not in CAPTURES:
      raise ValueError(f"capture must be one of {tuple(CAPTURES)}, got {capture!r}")
    wrap = CAPTURES[capture]
    self.fun = fun if wrap is None else wrap(fun)
    self.has_aux, self.fisher, self.capture = has_aux, fisher, capture
    self.skip_statistics = skip_statistics
    self._shadowed = _keyword_parameters(fun) & set(OWN_KEYWORDS)
    functools.update_wrapper(self, fun)

  def _check_own_keywords(self, call: str, **given: Any) -> None:
    """A keyword that is this object's own (`OWN_KEYWORDS`) but also names a
    parameter of the loss function would never reach it: refused (a
    diffusion loss's `rng=key` trained on the noise of its default)."""
    for name in sorted(self._shadowed):
      if given.get(name) is not None:
        raise ValueError(
            f"grad_fn{call}(..., {name}=...): {name}= is kd.value_and_grad's own "
            f"keyword ({OWN_KEYWORDS[name]}), and the loss function's parameter "
            f"'{name}' would not receive it. Rename that parameter (e.g. key), or "
            f"pass the loss function's {name} positionally (not to accumulate or "
            "micro_batches=, which split every positional argument).")

  def discover(self, params: Any, *args: Any, distribution: Any = None,
               **kwargs: Any) -> registry.LayerRegistry:
    """The tagged layers of `fun(params, *args, **kwargs)` (an abstract trace;
    parameters and batch may be `jax.ShapeDtypeStruct`s).

    A stacked layer (scanned blocks, see `stacking`) is one record with
    `stack = (L,)`; `TaggedLayer.blocks()` lists its blocks. A loss with
    collectives over mesh axes (synchronised BatchNorm, `axis_name="data"`)
    can be discovered outside `shard_map`: each unbound axis is bound with
    size 1 for the trace (with global parameter shapes).

    With a tensor-parallel `distribution` (`model_axis` set), `fun` is traced
    inside `shard_map` over its mesh (the global `params` sharded by its
    `param_specs`, the batch replicated), so the layers have the local shard
    shapes that `update` sees (and `fun` may use collectives over the mesh
    axes)."""
    if distribution is None or not distribution.model_axes:
      return self._discover(params, *args, **kwargs).layers
    distribution.check_params(params)     # its errors, not shard_map's
    found = []

    def local(p: Any, a: tuple, k: dict) -> Any:
      found.append(self._discover(p, *a, **k).layers)
      return jnp.zeros([])
    spec = jax.sharding.PartitionSpec()
    if not all(hasattr(x, "shape") and hasattr(x, "dtype")
               for x in jax.tree_util.tree_leaves((args, kwargs))):
      raise ValueError("discover(distribution=...) traces the batch inside shard_map: "
                       "pass array arguments only (bind the others with "
                       "functools.partial).")
    mesh = distribution.mesh
    is_spec = lambda s: isinstance(s, jax.sharding.PartitionSpec)
    # Placed as the in_specs say: on `Explicit` mesh axes shard_map checks them.
    placed = jax.tree_util.tree_map(lambda s, sub: _placed(sub, mesh, s),
                                    distribution.param_specs, params, is_leaf=is_spec)
    jax.eval_shape(jax.shard_map(
        local, mesh=mesh, in_specs=(distribution.param_specs, spec, spec),
        out_specs=spec), placed, _placed(args, mesh, spec), _placed(kwargs, mesh, spec))
    return found[0]

  def _discover(self, params, *args, **kwargs) -> "_Discovered":
    registry.check_array_leaves("kd.value_and_grad", params)
    found = []
    # Array-like arguments (arrays, tracers, ShapeDtypeStructs) are traced
    # abstractly; anything else (flags, modules) is passed through as is.
    flat, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [hasattr(x, "shape") and hasattr(x, "dtype") for x in flat]

    def traced(p: Any, arrays: list, differentiated: bool) -> Any:
      arrays = iter(arrays)
      a, k = jax.tree_util.tree_unflatten(
          treedef, [next(arrays) if d else x for x, d in zip(flat, dynamic)])

      def run(p: Any) -> Any:
        trace = _new_trace(_context.DISCOVER, p, top=_compat.current_trace(),
                           differentiated=differentiated)
        with _context.active(trace):
          out = self.fun(stacking.prepare(p), *a, **k)
        _context.registered(trace)
        _check_output(out, self.has_aux)
        found.append(_Discovered.of(trace))    # what it found, not its tracers
        return out
      return jax.vjp(run, p)[0] if differentiated else run(p)

    arrays = [x for x, d in zip(flat, dynamic) if d]
    try:
      _eval_binding_axes(functools.partial(traced, differentiated=False), params, arrays)
    except _context.DependenceUnknown:
      # Once more under a derivative in the parameters, as the capture runs the
      # loss: the values that depend on them are its tracers.
      found.clear()
      _eval_binding_axes(functools.partial(traced, differentiated=True), params, arrays)
    discovered = found[-1]          # (the run that completed)
    if not discovered.layers:
      left = "".join(f"; uncaptured: {u.where} ({u.kind}: {u.reason})"
                     for u in discovered.layers.uncaptured)
      raise ValueError("The loss function ran no tagged layer (kd.tags / kd.linen / "
                       "kd.nnx, or a supported Flax layer with capture=\"flax\"); K-FAC "
                       f"has nothing to precondition{left}.")
    return discovered

  def __call__(self, params, *args, rng=None, opt_state=None, loss_scale=None, **kwargs):
    self._check_own_keywords("", rng=rng, opt_state=opt_state, loss_scale=loss_scale)
    return _compat.on_auto_axes(
        self._value_and_grad, (params, *args),
        dict(rng=rng, opt_state=opt_state, loss_scale=loss_scale, **kwargs),
        _value_grads_stats(params))

  def _value_and_grad(self, params, *args, rng=None, opt_state=None, loss_scale=None,
                      **kwargs):
    _check_not_a_schedule(params, args, kwargs)
    weight = shares.loss_weight(self.fun, params, args, kwargs, 1, "grad_fn")
    value, grads, stats, _, weight = self._evaluate(params, args, kwargs, rng,
                                                    opt_state, loss_scale, weight)
    return value, grads, self._shares(stats, weight, args, kwargs, opt_state)

  def _shares(self, stats, weight, args, kwargs, opt_state) -> dict:
    """`shares.weigh_statistics` over the axes the batch varies over; a
    DP-KFAC state's factor statistics (its owners' own) left as they are, but
    EK-FAC's `S` (averaged over the devices as the whole batch's) weighted."""
    local = getattr(_statistics_consumer(opt_state), "local_statistics", False)
    weighed = frozenset({factors.CORRECTED}) if local else factors.SCALED_BY_NUM_EXAMPLES
    return shares.weigh_statistics(stats, weight, _compat.varying_axes(args, kwargs),
                                   weighed)

  def accumulate(self, params, *args, micro_batches: int, rng=None, opt_state=None,
                 loss_scale=None, **kwargs):
    """`self(params, *args, ...)` computed over `micro_batches` slices of the
    batch, one after the other (`lax.scan`: activations of one slice at a time).

    Every positional argument after `params` is split along its leading axis
    (keyword arguments are passed whole). The results equal those of the whole
    batch (for a loss linear in its registered losses: a `log L` or `L₁·L₂` is
    each slice's): with `n_i` the examples of slice i (its registered loss's
    denominator, e.g. a mask's sum) and `N = Σ n_i`, each slice's registered
    loss is weighted by its share `k·n_i/N` (`shares`: with a mask, `N` is
    counted first, by a pass that `jit` compiles down to the masks' sums), so
    that the loss and the gradients are the plain means of the slices', every
    other term of the loss included; `G`/`F` are the `n_i/N`-weighted sums of
    the slices', and `A`, a mean over positions (masked ones included), is
    their plain mean. `aux` comes back stacked over the slices (a registered
    loss's value in it weighted as above: its mean over the slices is the
    whole batch's). Call the optimizer once with the results.
    """
    self._check_own_keywords(".accumulate", rng=rng, opt_state=opt_state,
                             loss_scale=loss_scale)
    return _compat.on_auto_axes(
        self._accumulate, (params, *args),
        dict(micro_batches=micro_batches, rng=rng, opt_state=opt_state,
             loss_scale=loss_scale, **kwargs), _value_grads_stats(params))

  def _accumulate(self, params, *args, micro_batches: int, rng=None, opt_state=None,
                  loss_scale=None, **kwargs):
    k = batches.check(micro_batches, "accumulate")
    sliced = batches.split(args, k, "accumulate")
    batches.check_keywords(kwargs, k, "accumulate")
    rngs = None if rng is None else jax.random.split(rng, k)
    weight = shares.loss_weight(self.fun, params, args, kwargs, k, "accumulate")

    def one(i: jax.Array) -> tuple:
      micro = jax.tree_util.tree_map(lambda x: x[i], sliced)
      value, grads, stats, n, share = self._evaluate(
          params, micro, batches.keywords_of_slice(kwargs, i),
          None if rngs is None else rngs[i], opt_state,
          loss_scale, weight)
      loss, aux = value if self.has_aux else (value, None)
      n = jnp.asarray(n, factors.statistics_dtype(n))   # float64 weights in float64
      weighted = {name: _summable(layer, n) for name, layer in stats.items()}
      return loss, grads, weighted, n, share, aux

    def body(carry: tuple, i: jax.Array) -> tuple:
      out = one(i)
      return jax.tree_util.tree_map(jnp.add, carry, out[:5]), out[5]

    # Sums start at zero, typed varying like the local results in shard_map.
    zeros = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype),
                                   jax.eval_shape(one, 0)[:5])
    zeros = _compat.as_varying(zeros, _compat.varying_axes(params, args, kwargs))
    (loss, grads, stats, n, share), aux = jax.lax.scan(body, zeros, jnp.arange(k))
    # The slices' losses and gradients are weighted shares: their plain means.
    # Summed in float32 at least; returned in the parameters' dtypes, as `grad_fn`'s.
    grads = jax.tree_util.tree_map(lambda g, p: (g / k).astype(jnp.result_type(p)),
                                   grads, params)
    total = _context.denominator(n)
    stats = {name: _summed_means(layer, total, k) for name, layer in stats.items()}
    value = (loss / k, aux) if self.has_aux else loss / k
    # The device's share of the global batch: the mean of its slices' shares.
    share = None if share is None else share / k
    return value, grads, self._shares(stats, share, args, kwargs, opt_state)

  def gauss_newton_gram(self, params, vectors, *args, micro_batches: int = 1,
                        with_loss: bool = False, rng=None, opt_state=None,
                        loss_scale=None, **kwargs) -> Any:
    """`[k, k]` matrix `G[i, j] = v_iᵀ C v_j` for the `k` parameter-shaped
    pytrees in `vectors` (a tuple), C the exact Gauss-Newton matrix of the
    loss `fun(params, *args, **kwargs)` returns:

        C = (c/n) Σ_x w_x J_xᵀ H_x J_x,

    `J_x` the Jacobian of example x's row of the registered loss's input
    (logits / predictions) in the parameters, `H_x` the loss's Hessian in that
    row (softmax cross-entropy `diag(p) − p pᵀ`, equal to the Fisher; sigmoid
    cross-entropy `diag(p(1 − p))`; squared error `I`; Poisson `diag(e^η)`;
    for `gaussian_nll` its expectation over the targets, the Fisher
    `diag(1/σ², 1/(2σ⁴))`), `w_x` the loss's mask
    (1 without), `n = Σ w_x` (the loss's denominator) and `c` the derivative
    of the returned loss in the registered loss (1 for the registered loss
    plus terms of the parameters, `a` for `a · loss`; a negative one counts
    as `|c|`; several registered losses: the sum of theirs, see
    `capture.curvature`). The same for either
    `fisher=`: the exact curvature, not the capture's statistics; `rng`,
    `opt_state` and `loss_scale` are accepted and ignored.

    Computed with one `jax.linearize` of the parameters → the loss's input
    (the loss function run once, its tags as plain layers), its linear map
    applied to each vector, then `(J v_i)ᵀ H (J v_j)` per example in closed
    form in `promote_types(dtype, float32)`. Vectors are cast to their
    parameters' dtypes. Cost: one forward pass plus one tangent pass per
    vector (a tangent pass costs about a backward pass: two products per
    matmul), i.e. about one forward+backward for k = 1 and 5/3 of one for
    k = 2 (measured on CPU, a float32 MLP of four 1024-wide tanh layers,
    batch 512: 0.87× and 1.45× a `jax.value_and_grad`; `loss` 0.40×), with
    the memory of a forward+backward (the linearisation's residuals). Inside
    `shard_map` (parameters and vectors replicated, the batch sharded) it is
    the matrix of the global batch, `psum` of the local sums over the axes
    the batch varies over, typed invariant over them. `micro_batches=k`
    computes the same over `k` slices of the positional batch arguments, one
    at a time (the memory of one slice; as `accumulate`). `with_loss=True`
    returns `(gram, loss)`, the loss (as `loss`) from the same forward pass.
    See `capture.curvature`.
    """
    self._check_own_keywords(".gauss_newton_gram", rng=rng, opt_state=opt_state,
                             loss_scale=loss_scale)
    del rng, opt_state, loss_scale
    gram, loss = _compat.on_auto_axes(
        curvature.gram_matrix, (self.fun, self.has_aux, params, vectors, args, kwargs,
                                micro_batches), {}, _compat.replicated)
    return (gram, loss) if with_loss else gram

  def loss(self, params, *args, micro_batches: int = 1, rng=None, opt_state=None,
           loss_scale=None, **kwargs) -> jax.Array:
    """The loss `fun(params, *args, **kwargs)` returns (without its aux with
    `has_aux`): one forward pass, the tags as plain layers. Inside
    `shard_map` the loss of the global batch: the devices' losses weighted by
    their numbers of examples n_d (the registered loss's denominator),
    `psum(n_d · loss_d) / psum(n_d)`, typed invariant over the batch's axes;
    with `micro_batches=k` the same over `k` slices of the positional batch
    arguments, one at a time. `rng`, `opt_state` and `loss_scale` are
    accepted and ignored."""
    self._check_own_keywords(".loss", rng=rng, opt_state=opt_state, loss_scale=loss_scale)
    del rng, opt_state, loss_scale
    return _compat.on_auto_axes(
        curvature.mean_loss, (self.fun, self.has_aux, params, args, kwargs,
                              micro_batches), {}, _compat.replicated)

  def _evaluate(self, params, args, kwargs, rng, opt_state, loss_scale,
                loss_weight: shares.LossWeight | None):
    """(value, grads, stats, n, weight) of one batch, its registered loss
    weighted by `loss_weight` (`shares`; `weight` the weight it took, None
    for none); see `value_and_grad`. With a K-FAC state, statistics only
    where its `update_factors` is set: skipped per layer or for the whole
    pass (`skip_statistics`)."""
    if self.fisher == "mc" and rng is None:
      raise ValueError('fisher="mc" samples targets from the model: pass rng=.')
    if self.fisher == "mc":
      rng = _per_data_shard(rng, (args, kwargs))
    if isinstance(loss_scale, (int, float)) and not (
        math.isfinite(loss_scale) and loss_scale > 0):   # an array of 0: a faulty step
      raise ValueError(f"loss_scale must be finite and > 0, got {loss_scale!r}")
    discovered = self._discover(params, *args, **kwargs)
    state = _statistics_consumer(opt_state)
    run = functools.partial(self._capture, discovered, params, args, kwargs, rng, state,
                            loss_scale, loss_weight)
    if state is None or getattr(state, "statistics_every_step", False):
      return run(True)
    skip = self.skip_statistics
    if skip == "auto":
      skip = "layer" if jax.default_backend() == "cpu" else "pass"
    # An array, not the Variable that holds it in an `nnx.Optimizer`'s state
    # (newer jax refuses to abstract such an object implicitly).
    update_factors = jnp.asarray(state.update_factors)
    if skip == "layer":
      return run(update_factors)
    static_n = []          # a Python number of examples stays one

    def branch(flag: bool) -> Callable:
      def capture() -> tuple:
        value, grads, stats, n, weight = run(flag)
        if isinstance(n, (int, float)):
          static_n.append(n)
          n = None
        return value, grads, stats, n, weight
      return capture
    value, grads, stats, n, weight = _compat.cond(update_factors, branch(True),
                                                  branch(False))
    return value, grads, stats, (static_n[0] if static_n else n), weight

  def _check_stack_axes(self, discovered: "_Discovered", params, args, kwargs,
                        error: Exception) -> None:
    """After a failed capture, raises for the first stacked linen / NNX layer
    whose parameters the model slices along an axis other than the leading
    ones. Discovery takes a leaf's leading axes for the stack (`[d, L, d]`
    with `L = d` passes as `L` leading); the probes, stacked along them, then
    fail to slice like the parameters. The test, exact: the loss run with only
    a `[*stack]` entry carried for that layer, which flax / NNX slice along
    the leading axes or fail to slice."""
    if isinstance(error, (AttributeError, TypeError)) and "'Probed'" in str(error):
      raise ValueError(
          f"The model uses a stacked NNX layer's kernel outside the layer ({error}): "
          "inside kd.value_and_grad's capture it carries the layer's probes through "
          "nnx.scan / nnx.vmap, so only its shape, dtype, ndim, size, len and [...] can be read "
          "there. Compute the rest from the layer's output, or pass it as an argument "
          "of the model.") from error
    for layer in discovered.layers:
      if not layer.stack or layer.name not in discovered.carriers:
        continue
      carried = {layer.name: (discovered.carriers[layer.name], jnp.zeros(layer.stack))}
      if not self._runs_carrying(carried, params, args, kwargs):
        raise ValueError(
            f"Stacked layer '{layer.name}': the model slices its parameters "
            f"('{layer.kernel_path}') along an axis other than the leading "
            f"{len(layer.stack)}, which discovery took for the stack {layer.stack} "
            "(a stack's length equal to a feature dimension). Keep the stack axis "
            "leading: nn.scan / nn.vmap with variable_axes={'params': 0}, nnx.vmap / "
            "nnx.scan over axis 0.") from error

  def _runs_carrying(self, carried: dict, params, args, kwargs) -> bool:
    """Whether the loss runs (abstractly) with `carried` in its parameter tree
    (`stacking.prepare`'s)."""
    def run(p: Any) -> Any:
      trace = _new_trace(_context.DISCOVER, p, top=_compat.current_trace())
      with _context.active(trace):
        return self.fun(stacking.prepare(p, carried), *args, **kwargs)
    try:
      jax.eval_shape(run, params)
    except Exception:    # pylint: disable=broad-except
      return False
    return True

  def _capture(self, discovered: "_Discovered", params, args, kwargs, rng, state,
               loss_scale, loss_weight, compute_stats) -> tuple:
    """(value, grads, stats, n, weight) with the statistics where
    `compute_stats` (a Python bool, or a traced one that each tag's backward
    pass reads); the statistics are the unweighted loss's whatever the
    `weight` its registered loss took (`loss_weight`; None: none)."""
    carriers = discovered.carriers
    probes = _all_probes(discovered, state)
    # Inside shard_map the statistics vary with the local batch: so must the
    # probes. Parameters are made varying too, so that the gradients are the
    # local ones (autodiff would otherwise psum the gradient of a replicated
    # parameter); `kd.Distribution.gradient_reduction` says who averages them.
    # Only over the batch's axes: a parameter replicated over a tensor-parallel
    # axis (the batch is replicated there too) keeps autodiff's sum over it.
    probes = _compat.as_varying(probes, _compat.varying_axes(params, args, kwargs))
    params = _compat.as_varying(params, _compat.varying_axes(args, kwargs))
    # Under "mc", a zero added to the registered loss: its cotangent is `c`, the
    # returned value's derivative in the registered loss (`a` for `a · loss`),
    # in float64 where enabled (a float64 model's statistics stay exact). One
    # per loss where several seed the statistics' pass each.
    per_loss = discovered.seeds_each_loss(self.fisher)
    offset = None if self.fisher == "empirical" and not per_loss else _compat.as_varying(
        jnp.zeros([len(discovered.loss_examples)] if per_loss else [],
                  jax.dtypes.canonicalize_dtype(jnp.float64)),
        _compat.varying_axes(args, kwargs))
    local = getattr(state, "local_statistics", False)

    def evaluate(p: Any, probes: dict, offset: jax.Array | None) -> tuple:
      # Stacked linen / NNX layers get their probes through the parameter tree
      # (sliced per block by flax / NNX); the others by name.
      carried = {n: (carriers[n], v) for n, v in probes.items() if n in carriers}
      trace = _new_trace(_context.CAPTURE, p, top=_compat.current_trace(),
                         differentiated=True, compute_stats=compute_stats,
                         probes={n: v for n, v in probes.items() if n not in carried},
                         carriers={n: carriers[n] for n in carried},
                         loss_weight=loss_weight, loss_offset=offset)
      traces.append(trace)
      with _context.active(trace):
        out = self.fun(stacking.prepare(p, carried), *args, **kwargs)
      loss, aux = out if self.has_aux else (out, None)
      losses = _context.registered(trace)
      if per_loss:
        values, seeds = _per_loss_seeds(losses, self.fisher, rng, local)
        trace.forget_values()
        return (loss, values), (aux, seeds, None)
      sampled = losses[0].sampled_loss(rng) if self.fisher == "mc" else None
      # A scale known when tracing is applied by the tags' backward passes,
      # traced by the calls of `vjp` below (`tags._scaled_inside`).
      if loss_scale is None:
        trace.statistics_scale = losses[0].static_num_examples
      trace.forget_values()
      return (loss, sampled), (aux, losses[0].num_examples, losses[0].share)

    traces: list[_context.Trace] = []
    try:
      (loss, second), vjp, (aux, counts, weight) = jax.vjp(evaluate, params, probes, offset,
                                                           has_aux=True)
    except Exception as error:    # flax's or JAX's, slicing a stacked layer's probes
      self._check_stack_axes(discovered, params, args, kwargs, error)
      raise
    if per_loss:        # each loss's value and seed: the statistics are the batch's as
      grads, probe_bar, g_scale = self._backward_per_loss(       # they are (n = 1)
          vjp, loss, second, counts, loss_scale, compute_stats)
      coefficient, n = None, 1
    else:               # the drawn targets' loss (or None) and the examples
      grads, probe_bar, g_scale, coefficient = self._backward(vjp, loss, second, counts,
                                                              weight, loss_scale)
      n = counts
    value = (loss, aux) if self.has_aux else loss
    counted = frozenset(layer.name for layer in discovered.layers if layer.counted)
    stats = _statistics(probe_bar, g_scale, traces[0].scaled, counted, coefficient)
    for name in set(stats) - traces[0].reached:        # the loss does not use its output
      stats[name][factors.UNREACHED] = jnp.zeros([], jnp.int32)
    return value, grads, stats, n, weight

  def _backward(self, vjp: Callable, loss: jax.Array, sampled: jax.Array | None, n: Any,
                weight: Any, loss_scale: Any) -> tuple:
    """`(grads, probes' cotangents, g_scale, coefficient)` of the capture's
    `vjp`: the gradients of the returned loss and the statistics from the
    true targets' cotangents ("empirical"), which carry the loss's `weight`
    and the returned value's coefficient `c` in the registered loss (the
    empirical Fisher of `c · loss`: `c²` times the loss's), or from the
    samples' ("mc"), which carry neither: scaled by `|c|` (the cotangent of
    the zero added to the registered loss), as the Gauss-Newton matrix of
    `c · loss` is (kfac-jax's loss weight). Loss scaling: the backward pass
    starts from `loss_scale` instead of 1, so low-precision cotangents stay
    representable; gradients are divided by it, `G`/`F` (quadratic in the
    cotangents) by its square."""
    seed = _seed(loss, loss_scale)
    if self.fisher == "empirical":
      grads, probe_bar, _ = vjp((seed, None))
      g_scale, coefficient = shares.unweighted_scale(n, weight), None
    else:
      grads, _, c = vjp((seed, jnp.zeros_like(sampled)))
      _, probe_bar, _ = vjp((jnp.zeros_like(loss), seed.astype(sampled.dtype)))
      g_scale, coefficient = shares.unweighted_scale(n, None), jnp.abs(c / seed.astype(c.dtype))
    grads, g_scale = _unscaled(grads, g_scale, loss, loss_scale)
    return grads, probe_bar, g_scale, coefficient

  def _backward_per_loss(self, vjp: Callable, loss: jax.Array, values: jax.Array,
                         seeds: jax.Array, loss_scale: Any, compute_stats: Any) -> tuple:
    """`(grads, probes' cotangents, g_scale)` where several registered losses
    `l` make the statistics (`_per_loss_seeds`: `values` their means on the
    true or the drawn targets, `seeds` `n_l w_l`, `w_l` the loss's share of
    the global batch, `shares`; 1 without one): a second backward pass seeded
    with `s_l` on `values[l]`, `c_l` the returned value's derivative in loss
    `l` (the cotangent of the zero it added). `G = Σ_rows ĝ ĝᵀ`, `ĝ = Σ_l s_l
    ∂values[l]/∂o`, is then, for the true targets (`s_l = c_l √(n_l w_l)`),
    `Σ_l c_l² w_l G_l` plus the cross terms between the losses (kept, as one
    loss's between its examples), `G_l` loss l's alone as `_backward` makes
    it; for drawn targets (`s_l = √(|c_l| n_l w_l)`) an estimate of `Σ_l
    |c_l| w_l G_l` (cross terms zero in expectation). A step that computes no
    statistics (`compute_stats` False) takes the first pass's placeholders."""
    seed = _seed(loss, loss_scale)
    grads, placeholders, c = vjp((seed, jnp.zeros_like(values)))
    if compute_stats is False:
      probe_bar = placeholders
    else:
      c = c / seed.astype(c.dtype)
      s = (c * jnp.sqrt(seeds) if self.fisher == "empirical"
           else jnp.sqrt(jnp.abs(c) * seeds))
      _, probe_bar, _ = vjp((jnp.zeros_like(loss), (seed.astype(s.dtype) * s
                                                     ).astype(values.dtype)))
    grads, g_scale = _unscaled(grads, None, loss, loss_scale)
    return grads, probe_bar, g_scale


def _seed(loss: jax.Array, loss_scale: Any) -> jax.Array:
  """What the backward pass starts from: 1, or the `loss_scale` (so that
  low-precision cotangents stay representable)."""
  return jnp.ones_like(loss) if loss_scale is None else jnp.asarray(
      loss_scale, loss.dtype) * jnp.ones_like(loss)


def _unscaled(grads: Any, g_scale: Any, loss: jax.Array, loss_scale: Any) -> tuple:
  """`(grads, g_scale)` of a backward pass seeded with `loss_scale`: the
  gradients divided by it, the statistics' scale (quadratic in the
  cotangents; None: 1) by its square."""
  if loss_scale is None:
    return grads, g_scale
  inv = 1.0 / jnp.asarray(loss_scale, factors.statistics_dtype(loss))
  grads = jax.tree_util.tree_map(lambda g: (g * inv.astype(g.dtype)).astype(g.dtype), grads)
  return grads, (inv * inv if g_scale is None else g_scale * inv * inv)


def _per_loss_seeds(losses: list, fisher: str, rng: Any, local: bool
                    ) -> tuple[jax.Array, jax.Array]:
  """`([K] values, [K] n_l w_l)` of several registered losses for
  `_backward_per_loss`: each loss's mean on the true targets (before its
  share weight) or on targets drawn with its own key, its examples `n_l` and
  share `w_l` (1 without one). DP-KFAC's `local` statistics (each device's
  own, unweighted) have no place for a share: refused where one is."""
  shared = [loss.name for loss in losses if loss.share is not None]
  if local and shared:
    raise ValueError(
        f"Several registered losses, {shared} masked: DP-KFAC's local statistics "
        "(each device's own factors) cannot weigh each loss by its share of the global "
        "batch's examples. Use another strategy, or masks of one number of examples on "
        "every device and micro-batch.")
  keys = None if fisher == "empirical" else jax.random.split(rng, len(losses))
  values = [loss.unweighted if keys is None else loss.sampled_loss(keys[i])
            for i, loss in enumerate(losses)]
  dtype = jnp.result_type(*values)
  seeds = [jnp.asarray(loss.num_examples, jnp.promote_types(dtype, jnp.float32))
           * (1 if loss.share is None else loss.share) for loss in losses]
  return (jnp.stack([v.astype(dtype) for v in values]),
          jax.lax.stop_gradient(jnp.stack(seeds)))


def _eval_binding_axes(fun: Callable, *args: Any) -> None:
  """`jax.eval_shape(fun, *args)`, binding the mesh axes that its collectives
  name (e.g. synced BatchNorm's) as they turn up unbound."""
  bound: list[str] = []
  while True:
    try:
      jax.eval_shape(_binding_axes(fun, bound), *args)
      return
    except NameError as error:
      name = _unbound_axis(error)
      if name is None or name in bound:
        raise
      bound.append(name)


def _placed(tree: Any, mesh: Any, spec: jax.sharding.PartitionSpec) -> Any:
  """`tree`'s leaves as `jax.ShapeDtypeStruct`s laid out on `mesh` as `spec`."""
  sharding = jax.sharding.NamedSharding(mesh, spec)
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sharding),
      tree)


def _value_grads_stats(params: Any) -> Callable[[Any], tuple]:
  """Where `grad_fn` runs on `Explicit` mesh axes (`_compat.on_auto_axes`):
  the loss (and aux) and the statistics replicated, the gradients laid out
  as their parameters."""
  return lambda mesh: (_compat.replicated(mesh), _compat.sharding_as_given(params, mesh),
                       _compat.replicated(mesh))


def _summable(layer: dict, n: Any) -> dict:
  """One slice's statistics of a layer as terms of `accumulate`'s sums:
  those over examples times the slice's `n`, a counted layer's `A` (with
  `POSITIONS`: one that may sit out a pass) times its positions."""
  out = {key: ((v * n).astype(v.dtype) if key in factors.SCALED_BY_NUM_EXAMPLES else v)
         for key, v in layer.items()}
  if factors.POSITIONS in layer and "A" in layer:
    a = layer["A"]
    out["A"] = (a * factors.per_block(layer[factors.POSITIONS], a)).astype(a.dtype)
  return out


def _summed_means(layer: dict, total: Any, k: int) -> dict:
  """`_summable`'s sums over `k` slices back to the whole batch's: over
  examples divided by their `total`, a counted `A` by its positions, any
  other `A` by `k`; the positions stay summed."""
  out = {key: (v / total if key in factors.SCALED_BY_NUM_EXAMPLES
               else v if key == factors.POSITIONS else v / k).astype(v.dtype)
         for key, v in layer.items()}
  if factors.POSITIONS in layer and "A" in layer:
    out["A"] = factors.mean_over_positions(layer["A"], layer[factors.POSITIONS])
  return out


def _check_not_a_schedule(params: Any, args: tuple, kwargs: dict) -> None:
  """`grad_fn(count)`: optax called it as a schedule of the step count (a
  callable hyperparameter of `optax.inject_hyperparams`), not as the loss's
  gradient: say so, where the loss function would fail on its arguments."""
  if (not args and not kwargs and hasattr(params, "dtype") and jnp.ndim(params) == 0
      and jnp.issubdtype(params.dtype, jnp.integer)):
    raise TypeError("grad_fn was called with an integer scalar alone, as optax calls a "
                    "schedule with the step count: with optax.inject_hyperparams, name "
                    "grad_fn in its static_args, e.g. optax.inject_hyperparams(kd.kfac, "
                    "static_args=('grad_fn', 'layers')).")


def _check_output(out: Any, has_aux: bool) -> None:
  """The loss function returns a scalar loss (`(loss, aux)` with `has_aux`),
  as `jax.value_and_grad` requires."""
  if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
    raise TypeError("value_and_grad(..., has_aux=True): the loss function must return "
                    f"a pair (loss, aux), got {type(out).__name__}.")
  if not has_aux and isinstance(out, (tuple, list)):
    raise TypeError(f"The loss function returned a {type(out).__name__} of {len(out)}, not "
                    "a scalar: for (loss, aux), pass value_and_grad(..., has_aux=True).")
  loss = out[0] if has_aux else out
  if jnp.shape(loss) != ():
    raise TypeError("The loss function must return a scalar (the registered mean loss, "
                    f"plus any regularisation), got shape {jnp.shape(loss)}.")


def _per_data_shard(rng: jax.Array, batch: Any) -> jax.Array:
  """`rng` folded with this device's index over the mesh axes the `batch`
  varies over inside `shard_map` (its data shards; row-major in the mesh's
  order of those axes, so not changed by renaming them): each shard draws its own
  targets, as one device does for every example of the global batch, while
  the devices holding the same examples (a tensor-parallel axis) draw the
  same ones. Inside `jax.pmap` or `shard_map(check_vma=False)`, where JAX types
  nothing, over the axes bound there (`_compat.untyped_device_axes`). Outside
  both, `rng` itself."""
  axes = _compat.varying_axes(batch) or _compat.untyped_device_axes()
  if not axes:
    return rng
  index = jnp.zeros([], jnp.int32)
  for axis in _compat.in_mesh_order(axes):
    index = index * jax.lax.axis_size(axis) + jax.lax.axis_index(axis)
  return jax.random.fold_in(rng, index)


def _all_probes(discovered: "_Discovered", state: Any) -> dict:
  """Layer name -> its zero probes, for every layer the optimizer `state`
  preconditions (all, without a state), in the forms it uses (its first
  block's, for a stacked layer: every block has the same forms)."""
  probes = {}
  for layer in discovered.layers:
    forms = ((factors.FULL, factors.FULL) if state is None
             else state.statistic_forms(layer.blocks()[0].name))
    if forms is None:               # skipped: no statistics
      state.check_skipped(layer.name)
    else:
      dtype = discovered.stats_dtypes.get(layer.name, jnp.float32)
      # a repeated layer's count divides its `A`: a unit-wise one has none
      counts = layer.counted or (layer.name in discovered.repeats and not layer.unitwise)
      probes[layer.name] = _probes(layer, forms, dtype, counts
                                   ) | _correction_probes(layer, state, dtype)
  return probes


def _statistics(probe_bar: dict, g_scale: Any, scaled: set[str],
                counted: frozenset[str] = frozenset(), coefficient: Any = None) -> dict:
  """The statistics from the probes' cotangents: those built from output
  cotangents (`factors.SCALED_BY_NUM_EXAMPLES`, cotangents of the mean loss)
  times `g_scale` (the number of examples, divided by the loss scale
  squared) unless their layer is in `scaled` (its backward pass did it), and
  times `coefficient` in every layer (None: 1), `A` the mean over a repeated
  layer's positions in all its runs, EK-FAC's bases dropped, and the
  position counts too except those of the layers in `counted` (that may sit
  out the pass: the optimizer weighs their `A` by them). Each keeps its
  layer's dtype (`factors.statistics_dtype`)."""
  dropped = lambda name: factors.BASES + (() if name in counted else (factors.POSITIONS,))
  def scaled_by(name: str, value: jax.Array) -> jax.Array:
    for scale in (None if name in scaled else g_scale, coefficient):
      value = value if scale is None else (value * scale).astype(value.dtype)
    return value
  stats = {name: {key: scaled_by(name, value)
                  if key in factors.SCALED_BY_NUM_EXAMPLES else value
                  for key, value in layer_stats.items() if key not in dropped(name)}
           for name, layer_stats in probe_bar.items()}
  for name, layer_stats in probe_bar.items():
    if factors.POSITIONS in layer_stats and "A" in layer_stats:
      stats[name]["A"] = factors.mean_over_positions(stats[name]["A"],
                                                     layer_stats[factors.POSITIONS])
  return stats


@dataclasses.dataclass(frozen=True)
class _Discovered:
  layers: registry.LayerRegistry
  carriers: dict          # stacked linen / NNX layer name -> stacking carrier
  stats_dtypes: dict      # layer name -> the dtype of its statistics
  repeats: frozenset      # layers that may run several times in a pass
  # each registered loss's number of examples where tracing knows it (no
  # mask), else None, in the order they run
  loss_examples: tuple = (None,)

  @classmethod
  def of(cls, trace: _context.Trace) -> "_Discovered":
    """What a discovery `trace` found: static records only, none of the
    trace's tracers (the loss's, the parameters' ids), which would outlive it."""
    uncaptured = tuple(registry.UncapturedLayer(where, kind, reason)
                       for where, (kind, reason) in trace.uncaptured.items())
    return cls(registry.LayerRegistry(tuple(trace.layers), uncaptured),
               dict(trace.carriers), dict(trace.stats_dtypes), frozenset(trace.repeats),
               tuple(loss.static_num_examples for loss in trace.losses))

  def seeds_each_loss(self, fisher: str) -> bool:
    """Whether several registered losses need `_backward_per_loss`: always
    under "mc"; under "empirical" unless every one averages over the same
    number of examples, known when tracing (then the returned loss's own
    cotangents are already those of the per-example loss, `_backward`)."""
    first = self.loss_examples[0]
    return len(self.loss_examples) > 1 and (fisher == "mc" or first is None or any(
        n != first for n in self.loss_examples))


def value_and_grad(fun: Callable, has_aux: bool = False, fisher: str = "empirical",
                   capture: str = "tags", skip_statistics: str = "auto") -> ValueAndGrad:
  """Like `jax.value_and_grad(fun, has_aux)` w.r.t. the first argument, plus stats.

  `grad_fn(params, *args, rng=None, opt_state=None, **kwargs)` returns
  `(loss, grads, stats)` (`((loss, aux), grads, stats)` with `has_aux`), where
  for every tagged layer (see `factors` for the normalisation)

  * dense, dense_general, conv2d: `stats[layer] = {"A": A, "G": G}`, each
    `[d, d]` (or its diagonal `[d]` where the optimizer keeps one; its upper
    triangle `[d(d+1)/2]` where it stores the factor packed, packed inside the
    capture's conditional: `factors.PACKED`);
  * embed: `{"A": A, "G": G}` with `A` always the diagonal `[V]` (token
    frequencies) and `G` as above;
  * scale_and_shift (LayerNorm / BatchNorm): `{"F": F}`, `[C, 3]`, SP-NGD's
    unit-wise Fisher `(γγ, γβ, ββ)` per channel;
  * a layer that may sit out a pass (`TaggedLayer.may_sit_out`: inside a
    `lax.cond` / `lax.switch` branch) or runs under a row mask
    (`kd.tags.row_mask`): also `"positions"`, the number of positions it saw
    (the rows its mask kept; 0: none), `[*stack]`.

  A stacked layer (scanned blocks: `kd.linen` / `kd.nnx` layers inside
  `nn.scan` / `nnx.scan` / `nnx.vmap`, or `kd.tags.*(..., stack_index=)`; see
  `stacking`) has its statistics stacked like its parameters, e.g. `{"A": [L,
  a, a], "G": [L, g, g]}`: slot `l` holds block `l`'s, exactly the unrolled
  layer's.

  `G` and `F` are multiplied by the number n of examples of the registered
  loss (the mean loss's cotangents are `g / n`), `A` is not.

  `loss_scale=S` (float16 training): the backward pass is seeded with `S`
  instead of 1 and the results are unscaled (gradients by `1/S`, `G`, `F` by
  `1/S²`); check them for non-finite values as with any loss scaling (the
  optimizer skips such steps). `grad_fn.accumulate(params, *batch,
  micro_batches=k, ...)` computes the same results over `k` slices of the
  batch, one at a time (gradient accumulation; see `ValueAndGrad.accumulate`). `fun`
  must compute its loss with `kd.losses` functions: one, or several (a
  multi-task model's heads: their curvatures add up, `_backward_per_loss`).
  `grad_fn.discover(params, *args, **kwargs)` returns the tagged layers, which
  `kd.scale_by_kfac(layers=...)` needs to lay out its state.

  `capture="tags"` (default) captures the tagged layers (`kd.tags`,
  `kd.linen`, `kd.nnx`); `capture="flax"` also captures the unmodified Flax
  linen layers `fun` runs (`Dense`, `DenseGeneral` and the projections of
  `MultiHeadDotProductAttention`, `Conv`, `Embed`, `LayerNorm`, `RMSNorm`,
  `BatchNorm`) by method interception, as the `kd.linen` layers would, and
  the NNX ones (`nnx.Linear`, ...) as the `kd.nnx` layers would; the
  layers it cannot capture (e.g. `Einsum`, a masked `Conv`) run as
  they are and `discover(...).uncaptured` lists them (see
  `kfac_jax_dist.flax.intercept`).

  Exact curvature: `grad_fn.gauss_newton_gram(params, (v_1, ..., v_k), *args,
  **kwargs)` returns `[v_iᵀ C v_j]`, C the Gauss-Newton matrix of the mean
  registered loss, and `grad_fn.loss(params, *args, **kwargs)` the loss alone
  (forward only); inside `shard_map` both are the global batch's (see
  `ValueAndGrad.gauss_newton_gram`).

  `skip_statistics` ("auto", "layer" or "pass"): how a step that updates no
  factor skips the statistics, one conditional per tagged layer or one
  around the whole pass; "auto" picks "layer" on CPU and "pass" elsewhere
  (see the module docstring: a conditional costs a host round trip on GPU).
  """
  return ValueAndGrad(fun, has_aux, fisher, capture, skip_statistics)
