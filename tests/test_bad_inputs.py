"""Every bad input a user can give is refused with a message that names it, or
survived: a step whose fault only run-time values reveal is skipped on every
device, the state unchanged but `skipped` (issue 13's cases, and more)."""

from __future__ import annotations

import functools
import json
import os
import re
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
from flax import linen as nn
import optax
import pytest

import kfac_jax_dist as kd
from kfac_jax_dist import _compat
from kfac_jax_dist.core import settings
from kfac_jax_dist.core import states as states_lib

import helpers

BATCH, CLASSES = 16, 4


def loss_fn(params, x, y):
  h = jnp.tanh(kd.tags.dense(x, params["l0"]["kernel"], params["l0"]["bias"], name="l0"))
  return kd.losses.softmax_cross_entropy(kd.tags.dense(h, params["out"]["kernel"],
                                                       name="out"), y)


def other_loss_fn(params, x, y):
  """Another model: one more tagged layer."""
  h = jnp.tanh(kd.tags.dense(x, params["l0"]["kernel"], params["l0"]["bias"], name="l0"))
  h = jnp.tanh(kd.tags.dense(h, params["mid"]["kernel"], name="mid"))
  return kd.losses.softmax_cross_entropy(kd.tags.dense(h, params["out"]["kernel"],
                                                       name="out"), y)


def _params(other=False):
  """float32 parameters, whatever jax_enable_x64 says."""
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  normal = lambda key, shape: 0.5 * jax.random.normal(key, shape, jnp.float32)
  p = {"l0": {"kernel": normal(k[0], (6, 8)), "bias": jnp.zeros(8, jnp.float32)},
       "out": {"kernel": normal(k[1], (8, CLASSES))}}
  if other:
    p["mid"] = {"kernel": normal(k[2], (8, 8))}
  return p


def _batch(i=0, labels=None):
  kx, ky = jax.random.split(jax.random.PRNGKey(100 + i))
  y = jax.random.randint(ky, (BATCH,), 0, CLASSES, jnp.int32) if labels is None else labels
  return jax.random.normal(kx, (BATCH, 6), jnp.float32), y


GRAD_FN = kd.value_and_grad(loss_fn)
LAYERS = GRAD_FN.discover(_params(), *_batch())


def _kfac(**options):
  return kd.kfac(0.1, layers=LAYERS, **options)


def _step(tx, params, state, batch, grad_fn=GRAD_FN):
  _, grads, stats = grad_fn(params, *batch, opt_state=state)
  updates, state = tx.update(grads, state, params, kfac_stats=stats)
  return optax.apply_updates(params, updates), state


def _skipped(state):
  return [int(s.skipped) for s in states_lib.find_states(state)]


def _assert_skipped_unchanged(tx, batch, params=None, state=None, steps_before=1,
                              grad_fn=GRAD_FN):
  """One good step, then `batch`: skipped, parameters and state unchanged but
  the counter."""
  params = _params() if params is None else params
  state = tx.init(params) if state is None else state
  for i in range(steps_before):
    params, state = _step(tx, params, state, _batch(i), grad_fn)
  new_params, new_state = _step(tx, params, state, batch, grad_fn)
  assert _skipped(new_state) == [s + 1 for s in _skipped(state)]
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new_params)):
    np.testing.assert_array_equal(a, b)
  changed = [not np.array_equal(a, b)
             for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new_state))]
  assert sum(changed) == 1            # the `skipped` counter only


# ------------------------------------------------------ refused at construction

@pytest.mark.parametrize("option,value,match", [
    ("damping", 0.0, "damping must be finite and > 0"),
    ("damping", float("nan"), "damping must be finite and > 0"),
    ("damping", -1e-3, "damping must be finite and > 0"),
    ("damping", 1e-50, "below the smallest normal float32 number"),   # rounds to 0
    ("kl_clip", 0.0, "kl_clip must be finite and > 0"),
    ("kl_clip", -1.0, "kl_clip must be finite and > 0"),
    ("kl_clip", float("nan"), "kl_clip must be finite and > 0"),
    ("factor_update_every", 0, "factor_update_every must be a positive integer"),
    ("factor_update_every", -3, "factor_update_every must be a positive integer"),
    ("inverse_update_every", 0, "inverse_update_every must be a positive integer"),
    ("inverse_update_every", 2.5, "inverse_update_every must be a positive integer"),
    ("factor_decay", 1.5, r"factor_decay must be in \[0, 1\)"),
    ("max_factor_dim", 0, "max_factor_dim must be a positive integer or None"),
    ("max_factor_dim", np.int64(0), "max_factor_dim must be a positive integer or None"),
    ("factor_update_every", np.int64(0), "factor_update_every must be a positive integer"),
    ("factor_update_every", float("inf"), "factor_update_every must be a positive integer"),
    ("inverse_update_every", float("nan"), "inverse_update_every must be a positive integer"),
    ("factor_decay", np.float64(1.5), r"factor_decay must be in \[0, 1\)"),
    ("stale_threshold", -0.1, "stale_threshold must be finite and ≥ 0"),
    ("factor_decay", True, TypeError), ("factor_decay", "0.9", TypeError),
    ("factor_decay", None, TypeError),
])
def test_kfac_settings_are_validated(option, value, match):
  """Numbers out of range (NumPy's too) raise a ValueError; a bool, a string or
  None where a number belongs a TypeError (True would run as 1.0)."""
  error, match = (match, "must be a number") if (
      match is TypeError) else (ValueError, match)
  with pytest.raises(error, match=f"{option} {match}" if error is TypeError else match):
    _kfac(**{option: value})


def test_kfac_types_are_validated():
  with pytest.raises(TypeError, match="factor_dtype must be a floating dtype.*int32"):
    _kfac(factor_dtype=jnp.int32)
  with pytest.raises(TypeError, match="skip must be a sequence of regular expressions"):
    _kfac(skip="out")                       # a string would be read as characters
  with pytest.raises(TypeError, match=r"skip must be a sequence .*\(\) for none.*None"):
    _kfac(skip=None)
  with pytest.raises(ValueError, match=r"skip: 'Dense_\[0' is not a regular expression"):
    _kfac(skip=["Dense_[0"])
  with pytest.raises(TypeError, match="distribution must be a kd.Distribution"):
    _kfac(distribution="comm")
  with pytest.raises(ValueError, match="learning_rate must be finite and >= 0|"
                                       "learning_rate must be finite and ≥ 0"):
    kd.kfac(-0.1, layers=LAYERS)


_OPTIMIZERS = {"kfac": lambda lr, **kw: kd.kfac(lr, layers=LAYERS, **kw),
               "shampoo": kd.shampoo, "soap": kd.soap}
_TAIL_CASES = [
    ("learning_rate", -0.1, "learning_rate must be finite and ≥ 0"),
    ("learning_rate", float("nan"), "learning_rate must be finite and ≥ 0"),
    ("weight_decay", -1e-4, "weight_decay must be finite and ≥ 0"),
    ("weight_decay", float("inf"), "weight_decay must be finite and ≥ 0"),
    ("momentum", 1.0, r"momentum must be in \[0, 1\)"),
    ("momentum", -0.5, r"momentum must be in \[0, 1\)"),
    ("momentum", True, "momentum must be a number, an array or a schedule"),
    ("momentum", "0.9", "momentum must be a number, an array or a schedule"),
]


@pytest.mark.parametrize("name,option,value,match", [
    (name, *case) for name in _OPTIMIZERS for case in _TAIL_CASES
    if not (name == "soap" and case[0] == "momentum")])   # SOAP's b1: its settings
def test_the_first_order_tail_is_validated(name, option, value, match):
  """The SGD (Adam) after each preconditioner: a diverging momentum, a negative
  rate or decay is refused at construction, not left to a silently wrong run."""
  options = {option: value}
  learning_rate = options.pop("learning_rate", 0.1)
  with pytest.raises((ValueError, TypeError), match=match):
    _OPTIMIZERS[name](learning_rate, **options)


def test_layers_must_be_discovered_records():
  """Layer names instead of `discover`'s records: a TypeError naming the fix at
  construction, not an AttributeError at init."""
  for make in (lambda layers: kd.kfac(0.1, layers=layers),
               lambda layers: kd.kfac(None, None, layers=layers, grad_fn=GRAD_FN)):
    with pytest.raises(TypeError, match="layers must be the LayerRegistry .*got list"):
      make(["l0", "out"])
    with pytest.raises(TypeError, match="layers must be the LayerRegistry .*got str"):
      make("l0")
    with pytest.raises(TypeError, match="pass skip="):
      make(list(LAYERS)[:1])            # a pick of the records: skip= is the way


def test_adaptive_settings_that_do_not_do_what_they_say_are_refused():
  """Adaptive mode: a KL clip (defined through a fixed learning rate) is named
  as such, and with adapt_damping an initial λ outside [min_damping,
  max_damping] (the rule would move it there at once) is refused; without
  adapt_damping the bounds do not apply. Nesterov (the fixed mode's SGD),
  micro-batches and step rejection outside adaptive mode, and a rejection's
  damping factor without an adapted damping are refused by name."""
  adaptive = lambda **kw: kd.kfac(None, None, layers=LAYERS, grad_fn=GRAD_FN, **kw)
  with pytest.raises(ValueError, match="kl_clip is defined through a fixed learning rate"):
    adaptive(kl_clip=1e-3)
  with pytest.raises(ValueError, match=r"damping=0.0001 \(the initial λ\) is outside "
                                       r"\[min_damping, max_damping\] = \[0.001, None\]"):
    adaptive(damping=1e-4, adapt_damping=True)
  with pytest.raises(ValueError, match=r"damping=1.0 .* = \[0.001, 0.5\]"):
    adaptive(damping=1.0, max_damping=0.5, adapt_damping=True)
  adaptive(damping=1e-4)
  adaptive(damping=1e-3, adapt_damping=True)
  with pytest.raises(ValueError, match="nesterov applies to the SGD of the non-adaptive"):
    adaptive(nesterov=True)
  for option in (dict(micro_batches=2), dict(reject_steps=True),
                 dict(reject_damping_increase_factor=2.0), dict(min_damping=1e-4),
                 dict(max_damping=1.0), dict(damping_adaptation_interval=1),
                 dict(damping_adaptation_decay=0.5)):
    (name, value), = option.items()
    with pytest.raises(ValueError, match=f"{name}={value!r} needs adaptive mode"):
      kd.kfac(0.1, layers=LAYERS, **option)
  with pytest.raises(ValueError, match="reject_damping_increase_factor multiplies the "
                                       "adapted damping .* needs reject_steps=True and "
                                       "adapt_damping=True"):
    adaptive(reject_steps=True, reject_damping_increase_factor=2.0)
  for option in (dict(damping_adaptation_interval=3), dict(damping_adaptation_decay=0.5),
                 dict(min_damping=1e-4), dict(max_damping=1.0)):     # (they did nothing)
    (name, value), = option.items()
    with pytest.raises(ValueError, match=f"{name}={value!r} sets the damping's "
                                         "adaptation: it needs adapt_damping=True"):
      adaptive(**option)
    adaptive(adapt_damping=True, **option)
  with pytest.raises(ValueError, match="reject_damping_increase_factor"):
    adaptive(reject_steps=True, adapt_damping=True, reject_damping_increase_factor=0.0)
  # adapt_damping selects adaptive mode (the damping alone adapted), which needs grad_fn.
  with pytest.raises(TypeError, match="needs grad_fn=kd.value_and_grad"):
    kd.kfac(0.1, layers=LAYERS, adapt_damping=True)


def test_another_optimizers_state_is_named():
  """`update` given a state that its own `init` did not return (another
  optimizer's `opt_state`, a chain's element out of place): a TypeError naming
  both kinds, before any of its fields is read (it was an AttributeError on a
  field deep inside)."""
  params, batch = _params(), _batch()
  _, grads, stats = GRAD_FN(params, *batch)
  kinds = {"scale_by_kfac": (kd.scale_by_kfac(LAYERS), "ScaleByKfacState"),
           "scale_by_shampoo": (kd.scale_by_shampoo(), "ScaleByShampooState"),
           "scale_by_soap": (kd.scale_by_soap(), "ScaleBySoapState"),
           "kfac": (kd.kfac(None, None, layers=LAYERS, grad_fn=GRAD_FN),
                    "AdaptiveKfacState")}
  for name, (tx, own) in kinds.items():
    for other, (other_tx, theirs) in kinds.items():
      if other == name:
        continue
      state = other_tx.init(params)
      with pytest.raises(TypeError, match=f"{name}.update got a {theirs} as its state; "
                                          f"it takes the {own}"):
        tx.update(grads, state, params, kfac_stats=stats, kfac_batch=batch)


def test_kfac_batch_must_be_a_tuple():
  """Adaptive K-FAC's `kfac_batch` is the arguments after the parameters: an
  array or a dict is named, not unpacked into the loss function's arguments."""
  tx = kd.kfac(None, None, layers=LAYERS, grad_fn=GRAD_FN)
  params, batch = _params(), _batch()
  state = tx.init(params)
  _, grads, stats = GRAD_FN(params, *batch, opt_state=state)
  for wrong in (batch[0], {"x": batch[0], "y": batch[1]}):
    with pytest.raises(TypeError, match=f"kfac_batch must be the tuple .*{type(wrong).__name__}"):
      tx.update(grads, state, params, kfac_stats=stats, kfac_batch=wrong)


@pytest.mark.parametrize("loss,match", [
    (lambda o, y: kd.losses.softmax_cross_entropy(o, y[:8]),
     r"softmax_cross_entropy: targets of shape \(8,\) .*integer classes of shape \(16,\)"),
    (lambda o, y: kd.losses.softmax_cross_entropy(o, y.astype(jnp.float32)),
     r"target distributions of shape \(16, 4\)"),
    (lambda o, y: kd.losses.softmax_cross_entropy(o, jax.nn.one_hot(y, CLASSES, dtype=int)),
     r"targets of shape \(16, 4\) .*\(integer one-hot rows: pass them as floats, or "
     r"their argmax\)"),
    (lambda o, y: kd.losses.sigmoid_cross_entropy(o, jax.nn.one_hot(y, CLASSES)[:, :1]),
     r"sigmoid_cross_entropy: targets of shape \(16, 1\) .*labels of shape \(16, 4\)"),
    (lambda o, y: kd.losses.squared_error(o[:, :1], y.astype(jnp.float32)),
     r"squared_error: targets of shape \(16,\) for inputs of shape \(16, 1\)"),
    (lambda o, y: kd.losses.softmax_cross_entropy(o[:, :1], y * 0),     # (loss 0, silently)
     r"softmax_cross_entropy: logits of shape \(16, 1\), one class: .*sigmoid_cross_entropy"),
    (lambda o, y: kd.losses.softmax_cross_entropy(o[:0], y[:0]),       # (NaN, momentum moved)
     r"softmax_cross_entropy: inputs of shape \(0, 4\), no examples \(an empty batch"),
])
def test_targets_of_another_shape_are_refused(loss, match):
  """Targets that only broadcast against the model's outputs (`[B]` against
  `[B, 1]` pairs every example with every target), a softmax over one
  class (its loss and gradients 0) and an empty batch (a NaN loss) are named
  at the first call."""
  def fn(params, x, y):
    h = jnp.tanh(kd.tags.dense(x, params["l0"]["kernel"], params["l0"]["bias"], name="l0"))
    return loss(kd.tags.dense(h, params["out"]["kernel"], name="out"), y)
  with pytest.raises(ValueError, match=match):
    kd.value_and_grad(fn)(_params(), *_batch())


def test_a_loss_parameter_named_like_grad_fns_own_keywords_is_not_shadowed():
  """A diffusion-style loss taking `rng`: `grad_fn(..., rng=key)` took the key
  as the Monte Carlo Fisher's and ran the loss with its default (every step
  the same noise, silently); now each call that would shadow it raises, and
  the key passed positionally reaches the loss (its value `jax.value_and_grad`'s)."""
  def noisy(params, x, y, rng=None):
    x = x if rng is None else x + jax.random.normal(rng, x.shape)
    return loss_fn(params, x, y)
  grad_fn, key = kd.value_and_grad(noisy), jax.random.PRNGKey(3)
  calls = {"": grad_fn, ".accumulate": functools.partial(grad_fn.accumulate,
                                                         micro_batches=2),
           ".loss": grad_fn.loss,
           ".gauss_newton_gram": lambda p, *b, **k: grad_fn.gauss_newton_gram(
               p, (p,), *b, **k)}
  for call, fn in calls.items():
    with pytest.raises(ValueError, match=rf"grad_fn{re.escape(call)}\(\.\.\., rng=\.\.\.\): "
                                         r"rng= is kd.value_and_grad's own keyword.*"
                                         r"parameter 'rng'"):
      fn(_params(), *_batch(), rng=key)
  value, _, _ = grad_fn(_params(), *_batch(), key)
  want, _ = jax.value_and_grad(noisy)(_params(), *_batch(), rng=key)
  np.testing.assert_allclose(value, want, rtol=1e-6)
  assert abs(float(value) - float(noisy(_params(), *_batch()))) > 1e-3
  kd.value_and_grad(loss_fn)(_params(), *_batch(), rng=key)     # no such parameter: fine


def test_masks_and_loss_scales_are_checked():
  """A mask that does not have the examples' axes is named with both shapes
  (a `[B, 1]` mask against `[B]` examples would not mean what it says, nor a
  per-image `[B]` weight of `[B, H, W]` pixels, which broadcasting matched to
  the columns where `W = B`); a Python loss scale ≤ 0 is refused (an array of
  0 makes the step faulty)."""
  def masked(mask):
    def fn(params, x, y):
      h = jnp.tanh(kd.tags.dense(x, params["l0"]["kernel"], params["l0"]["bias"], name="l0"))
      logits = kd.tags.dense(h, params["out"]["kernel"], name="out")
      return kd.losses.softmax_cross_entropy(logits, y, mask=mask)
    return kd.value_and_grad(fn)
  for mask in (jnp.ones(BATCH // 2), jnp.ones((BATCH, 1))):
    with pytest.raises(ValueError, match=r"mask of shape .* for examples of shape "
                                         r"\(16,\)"):
      masked(mask)(_params(), *_batch())
  masked(jnp.ones(BATCH))(_params(), *_batch())
  images = jnp.ones((4, 3, 4, 2))
  with pytest.raises(ValueError, match=r"squared_error: mask of shape \(4,\) for "
                                       r"examples of shape \(4, 3, 4\).*mask\[:, None, "
                                       r"None\]"):
    kd.losses.squared_error(images, images, mask=jnp.ones(4))
  kd.losses.squared_error(images, images, mask=jnp.ones((4, 1, 1)))
  for scale in (0.0, -2.0, float("inf")):
    with pytest.raises(ValueError, match="loss_scale must be finite and > 0"):
      GRAD_FN(_params(), *_batch(), loss_scale=scale)



def test_masked_mean_averages_over_its_mask():
  """`kd.losses.masked_mean`: `Σ m·v / Σ m` against numpy (a `[B, 1]` mask
  broadcast over positions, fractional weights), 0 for an all-zero mask, a
  mask without the values' axes named with both shapes, and a call inside a
  scan of the loss function refused (its share could not be counted)."""
  values = np.arange(12.0).reshape(4, 3) - 4.0
  mask = np.array([[1.0], [0.0], [0.5], [2.0]])
  np.testing.assert_allclose(kd.losses.masked_mean(values, mask),
                             np.sum(values * mask) / (3 * np.sum(mask)), rtol=1e-6)
  assert float(kd.losses.masked_mean(values, np.zeros((1, 3)))) == 0.0
  for mask in (np.ones(4), np.ones(3)):
    with pytest.raises(ValueError, match=r"masked_mean: mask of shape \(\d,\) for "
                                         r"values of shape \(4, 3\)"):
      kd.losses.masked_mean(values, mask)

  def scanned(params, x, y):
    def body(h, _):
      h = jnp.tanh(kd.tags.dense(h, params["l0"]["kernel"], name="l0"))
      return h, kd.losses.masked_mean(h ** 2, jnp.ones(h.shape))
    h, squares = jax.lax.scan(body, x, None, length=2)
    return kd.losses.softmax_cross_entropy(h, y) + jnp.sum(squares)
  params = {"l0": {"kernel": jnp.eye(4)}}
  batch = jnp.ones((4, 4)), jnp.zeros(4, jnp.int32)
  for call in (kd.value_and_grad(scanned), kd.value_and_grad(scanned).loss,
               functools.partial(kd.value_and_grad(scanned).loss, micro_batches=2)):
    with pytest.raises(ValueError, match="masked_mean ran inside a JAX transform"):
      call(params, *batch)

def test_the_loss_function_returns_a_scalar():
  """A non-scalar loss, or `has_aux=True` without `(loss, aux)`, as
  `jax.value_and_grad` refuses them; `(loss, aux)` without `has_aux=True`
  names it (the shape check met a tuple)."""
  with pytest.raises(TypeError, match=r"must return a scalar .*got shape \(2,\)"):
    kd.value_and_grad(lambda p, x, y: loss_fn(p, x, y) * jnp.ones(2))(_params(), *_batch())
  with pytest.raises(TypeError, match=r"has_aux=True\): the loss function must return a pair"):
    kd.value_and_grad(loss_fn, has_aux=True)(_params(), *_batch())
  with pytest.raises(TypeError, match=r"returned a tuple of 2, not a scalar: for \(loss, "
                                      r"aux\), pass value_and_grad\(..., has_aux=True\)"):
    kd.value_and_grad(lambda p, x, y: (loss_fn(p, x, y), {"n": 1}))(_params(), *_batch())


def test_distribution_is_validated():
  mesh = helpers.data_mesh(8)
  with pytest.raises(TypeError, match="comm_dtype must be a floating dtype.*int8"):
    kd.Distribution(mesh, comm_dtype=jnp.int8)
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
    kd.Distribution("data")
  for fraction in ("0.5", float("nan"), None):
    with pytest.raises(TypeError, match="grad_worker_fraction must be a finite number"):
      kd.Distribution(mesh, grad_worker_fraction=fraction)


@pytest.mark.parametrize("option,value,error,match", [
    ("epsilon", -1.0, ValueError, "epsilon must be finite and > 0"),
    ("epsilon", 0.0, ValueError, "epsilon must be finite and > 0"),
    ("ridge_epsilon", -1e-6, ValueError, "ridge_epsilon must be finite and ≥ 0"),
    ("graft_epsilon", float("inf"), ValueError, "graft_epsilon must be finite"),
    ("statistics_dtype", jnp.int32, TypeError, "statistics_dtype must be a floating"),
    ("newton_max_iterations", 0, ValueError, "newton_max_iterations must be a positive"),
    ("root_failure_threshold", 0.0, ValueError, "root_failure_threshold must be finite"),
    ("statistics_compute_steps", 0, ValueError, "statistics_compute_steps must be a pos"),
    ("statistics_compute_steps", float("inf"), ValueError, "statistics_compute_steps mu"),
    ("skip", "w", TypeError, "skip must be a sequence"),
    ("beta2", "0.9", TypeError, "beta2 must be a number or an array"),
    ("beta2", 0.0, ValueError, r"beta2 must be in \(0, 1\]"),
    ("graft_beta2", True, TypeError, "graft_beta2 must be a number or an array"),
    ("block_size", 2.5, ValueError, "block_size must be a positive integer or None"),
    ("block_size", float("inf"), ValueError, "block_size must be a positive integer"),
    ("max_preconditioner_dim", 0, ValueError, "max_preconditioner_dim must be a posit"),
    ("max_preconditioner_dim", 4.5, ValueError, "max_preconditioner_dim must be a pos"),
    ("merge_small_dims", -1, ValueError, "merge_small_dims must be True, False or a p"),
    ("exponent_override", float("nan"), ValueError, "exponent_override must be finite"),
    ("exponent_override", float("inf"), ValueError, "exponent_override must be finite"),
    ("start_preconditioning_step", 2.5, ValueError, "start_preconditioning_step must "),
    ("start_preconditioning_step", float("nan"), ValueError, "start_preconditioning_st"),
])
def test_shampoo_settings_are_validated(option, value, error, match):
  """Refused at construction, where they would silently change the method (a
  `max_preconditioner_dim` of 0 made every parameter diagonal, a `block_size`
  of 2.5 was read as 2, `True` a β of 1) or fail later without naming them."""
  with pytest.raises(error, match=match):
    kd.shampoo(0.1, graft_type="adam", **{option: value})


_MAKERS = {
    "kfac": lambda **kw: _kfac(**kw),
    "adaptive": lambda **kw: kd.kfac(None, None, layers=LAYERS, grad_fn=GRAD_FN,
                                     adapt_damping=True, **kw),
    "shampoo": lambda **kw: kd.shampoo(0.1, **{"graft_type": "adam", "graft_beta2": 0.9,
                                               **kw}),
    "soap": lambda **kw: kd.soap(0.1, **kw),
}


@pytest.mark.parametrize("maker,option,value", [
    ("kfac", "factor_decay", 0.9), ("kfac", "stale_threshold", 0.1),
    ("adaptive", "min_damping", 1e-3), ("adaptive", "max_damping", 1.0),
    ("adaptive", "damping_adaptation_decay", 0.9),
    ("shampoo", "beta2", 0.9), ("shampoo", "epsilon", 1e-6),
    ("shampoo", "ridge_epsilon", 1e-6), ("shampoo", "graft_beta2", 0.9),
    ("shampoo", "graft_epsilon", 1e-8),
    ("soap", "b1", 0.9), ("soap", "b2", 0.9), ("soap", "eps", 1e-8),
    ("soap", "shampoo_beta", 0.9),
])
def test_a_schedule_is_refused_by_name_where_the_option_takes_none(maker, option, value):
  """These options are numbers (an injected array passes): a schedule was
  accepted at construction, then failed at init or at the first update with
  jnp's TypeError of a function where a number belongs, naming nothing."""
  with pytest.raises(TypeError, match=f"{option} must be a number or an array "
                                      r"\(it takes no schedule\)"):
    _MAKERS[maker](**{option: lambda count: value})
  _MAKERS[maker](**{option: jnp.asarray(value)})       # injected: checked at run time


def test_integer_parameters_are_refused_at_init():
  params = dict(_params(), step=jnp.zeros((), jnp.int32))
  with pytest.raises(TypeError, match=r"parameter 'step' has dtype int32"):
    _kfac().init(params)
  with pytest.raises(TypeError, match=r"parameter 'step' has dtype int32"):
    kd.shampoo(0.1).init(params)


def test_parameters_that_are_not_arrays_are_refused_by_name():
  """A model object passed whole as the parameters (an Equinox module with
  its activation function as a leaf, the usual `loss(model, x, y)`): the
  capture and every optimizer's init name the leaf and how to split it off,
  where JAX's error named a partial of the library's internals and a `jit`
  the user never wrote."""
  params = {"layers": [_params(), {"activation": jax.nn.relu}]}
  x, y = _batch()
  loss = lambda p, x, y: loss_fn(p["layers"][0], x, y)
  match = r"parameter leaf 'layers/1/activation' is a \w+, not an array.*eqx.partition"
  with pytest.raises(TypeError, match=match):
    kd.value_and_grad(loss).discover(params, x, y)
  with pytest.raises(TypeError, match=match):
    kd.value_and_grad(loss)(params, x, y)
  for tx in (_kfac(), kd.shampoo(0.1), kd.soap(0.1)):
    with pytest.raises(TypeError, match=match):
      tx.init(params)


def test_complex_parameters_are_refused_at_init():
  """Their curvature is Hermitian: real statistics (`xᵀx`, `g gᵀ`) of complex
  numbers make indefinite factors, and a run diverged silently."""
  params = dict(_params(), phase=jnp.ones((3,), jnp.complex64))
  for tx in (_kfac(), kd.shampoo(0.1), kd.soap(0.1)):
    with pytest.raises(TypeError, match=r"parameter 'phase' has dtype complex64; "
                                        "complex parameters are not supported"):
      tx.init(params)


@pytest.mark.parametrize("complex_part", ["input", "kernel", "flax"])
def test_complex_layers_are_refused_at_discovery(complex_part):
  """A real kernel fed complex inputs (an FFT front end), or a complex kernel:
  refused naming the layer, where their factors would be indefinite."""
  x, y = _batch()
  if complex_part == "flax":
    model = nn.Dense(CLASSES, param_dtype=jnp.complex64)
    params = model.init(jax.random.PRNGKey(0), x)
    loss = lambda p, x, y: kd.losses.softmax_cross_entropy(jnp.abs(model.apply(p, x)), y)
    grad_fn = kd.value_and_grad(loss, capture="flax")
  else:
    params = _params()
    if complex_part == "kernel":
      params["out"]["kernel"] = params["out"]["kernel"].astype(jnp.complex64)
    x = x * (1 + 1j) if complex_part == "input" else x

    def loss(p, x, y):
      h = kd.tags.dense(x, p["l0"]["kernel"], p["l0"]["bias"], name="l0")
      if complex_part == "input":
        h = jnp.abs(h)
      out = kd.tags.dense(jnp.tanh(h), p["out"]["kernel"], name="out")
      return kd.losses.softmax_cross_entropy(jnp.abs(out), y)
    grad_fn = kd.value_and_grad(loss)
  layer = {"input": "l0", "kernel": "out", "flax": "params"}[complex_part]
  with pytest.raises(TypeError, match=f"Tagged layer '{layer}': complex input or "
                                      "output .*complex layers are not supported"):
    grad_fn.discover(params, x, y)


@pytest.mark.parametrize("micro_batches", [0, -2, 1.5, True])
def test_accumulate_needs_a_positive_number_of_micro_batches(micro_batches):
  with pytest.raises(ValueError, match="micro_batches must be a positive integer"):
    GRAD_FN.accumulate(_params(), *_batch(), micro_batches=micro_batches)


def test_micro_batches_refuse_positional_arguments_of_other_leading_axes():
  """Class weights passed positionally (`[classes]`, not `[batch]`) would be
  cut into slices of their own: refused, naming the shapes; passed as a
  keyword they go whole, and the result is the whole batch's."""
  def weighted(p, x, y, class_weights):
    h = jnp.tanh(kd.tags.dense(x, p["l0"]["kernel"], p["l0"]["bias"], name="l0"))
    logits = kd.tags.dense(h, p["out"]["kernel"], name="out")
    return kd.losses.softmax_cross_entropy(logits, y, mask=class_weights[y])
  grad_fn, weights = kd.value_and_grad(weighted), jnp.arange(1.0, CLASSES + 1.0)
  for call in (grad_fn.accumulate, grad_fn.loss):
    with pytest.raises(ValueError, match=rf"have different leading axes, shapes "
                                         rf"\[\({BATCH}, 6\), \({BATCH},\), \({CLASSES},\)\]"):
      call(_params(), *_batch(), weights, micro_batches=2)
  whole = grad_fn(_params(), *_batch(), class_weights=weights)
  sliced = grad_fn.accumulate(_params(), *_batch(), micro_batches=2, class_weights=weights)
  helpers.assert_trees_equal(sliced, whole, rtol=1e-5)


def test_two_kfac_states_in_opt_state():
  """Two K-FAC transforms in one chain: over the same layers (which would
  precondition the gradient twice) refused naming them; over disjoint ones
  (`skip=`), the capture asks which one to serve."""
  layers = GRAD_FN.discover(_params(), *_batch())
  twice = optax.chain(kd.scale_by_kfac(layers), kd.scale_by_kfac(layers), optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"2 K-FAC states that precondition the same layers "
                                       r"\(l0, out\)"):
    GRAD_FN(_params(), *_batch(), opt_state=twice.init(_params()))
  apart = optax.chain(kd.scale_by_kfac(layers, skip=("out",)),
                      kd.scale_by_kfac(layers, skip=("l0",)), optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"several K-FAC states; pass the one to use"):
    GRAD_FN(_params(), *_batch(), opt_state=apart.init(_params()))


def test_update_arguments_out_of_place_are_named():
  """`update(grads, params, state)` (swapped), another optimizer's state, or
  the statistics passed positionally: named, not optax's chain error or
  Python's count of positional arguments."""
  params, batch = _params(), _batch()
  _, grads, stats = GRAD_FN(params, *batch)
  for tx, extra in ((_kfac(), dict(kfac_stats=stats)), (kd.shampoo(0.1), {})):
    state = tx.init(params)
    for wrong in (params, optax.adam(1e-3).init(params)):
      with pytest.raises(TypeError, match=r"update: the state \((dict|tuple)\) holds no "
                                          r"K-FAC, Shampoo or SOAP state"):
        tx.update(grads, wrong, params, **extra)
  with pytest.raises(TypeError, match=r"update takes \(updates, state, params\) "
                                      r"positionally, got 1 more: .*kfac_stats="):
    _kfac().update(grads, _kfac().init(params), params, stats)


# ------------------------------------------------------------ refused at update

def test_layers_of_another_model_are_refused():
  """The statistics hold a tagged layer the state was not laid out for."""
  grad_fn = kd.value_and_grad(other_loss_fn)
  params = _params(other=True)
  tx = _kfac()
  with pytest.raises(ValueError, match=r"does not know: \['mid'\]"):
    _, grads, stats = grad_fn(params, *_batch())
    tx.update(grads, tx.init(params), params, kfac_stats=stats)


def test_layers_of_another_model_are_refused_with_opt_state_too():
  """The statistics skip layers the state skips: a layer it does not know at
  all (a head added since the transform was built) was left out of them as
  if skipped, and passed through unpreconditioned without a word."""
  grad_fn = kd.value_and_grad(other_loss_fn)
  params = _params(other=True)
  state = _kfac().init(params)
  with pytest.raises(ValueError, match="ran tagged layer 'mid', which the K-FAC state "
                                       "passed as opt_state does not know"):
    grad_fn(params, *_batch(), opt_state=state)
  skipping = kd.kfac(0.1, layers=grad_fn.discover(params, *_batch()), skip=["^mid$"])
  _, _, stats = grad_fn(params, *_batch(), opt_state=skipping.init(params))
  assert "mid" not in stats


@pytest.mark.parametrize("made_by,match", [
    (dict(method="inverse"), "method 'inverse' \\(transform: 'eigen'\\)"),
    (dict(skip=["out"]), "skipped layers \\['out'\\]"),
    (dict(max_factor_dim=4), "factor forms of another max_factor_dim"),
])
def test_state_of_another_configuration_is_refused(made_by, match):
  params = _params()
  state = _kfac(**made_by).init(params)
  _, grads, stats = GRAD_FN(params, *_batch())
  with pytest.raises(ValueError, match="another configuration: " + match):
    _kfac().update(grads, state, params, kfac_stats=stats)


def test_local_gradients_with_reduction_none_are_refused():
  """Inside shard_map the capture returns each device's local gradients; with
  gradient_reduction="none" they must be averaged before update."""
  mesh = helpers.data_mesh(8)
  for tx in (_kfac(distribution=kd.Distribution(mesh)),
             kd.shampoo(0.1, distribution=kd.Distribution(mesh))):
    state = tx.init(_params())
    specs = kd.partition_specs(state)

    def step(params, state, x, y, tx=tx):
      _, grads, stats = GRAD_FN(params, x, y, opt_state=state)     # no pmean
      return tx.update(grads, state, params, kfac_stats=stats)[1]
    run = jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                        out_specs=specs)
    with pytest.raises(ValueError, match=r"lax.pmean\(grads, 'data'\)"):
      jax.jit(run)(_params(), kd.shard_state(state, mesh), *_batch())


def test_parameters_gathered_inside_shard_map_are_refused_by_name():
  """FSDP inside shard_map (each device holds a shard of a kernel over the data
  axis and the loss gathers it) is not supported: the error says so and where
  to turn, at the first trace, instead of preconditioning a gathered copy."""
  mesh = helpers.data_mesh(8)
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  params = {"w": jax.random.normal(k1, (16, 10)) / 4}
  x, y = jax.random.normal(k1, (32, 16)), jax.random.randint(k2, (32,), 0, 10)
  full = kd.value_and_grad(lambda p, x, y: kd.losses.softmax_cross_entropy(
      kd.tags.dense(x, p["w"]), y))
  gathered = kd.value_and_grad(lambda p, x, y: kd.losses.softmax_cross_entropy(
      kd.tags.dense(x, jax.lax.all_gather(p["w"], "data", tiled=True)), y))
  tx = kd.kfac(0.1, layers=full.discover(params, x, y),
               distribution=kd.Distribution(mesh, grad_worker_fraction=1 / 8))
  state = kd.init_sharded(tx.init, params, mesh)
  specs = kd.partition_specs(state)

  def step(p, state, x, y):
    _, grads, stats = gathered(p, x, y, opt_state=state)
    return tx.update(grads, state, p, kfac_stats=stats)[1]
  run = jax.shard_map(step, mesh=mesh, in_specs=({"w": P("data")}, specs, P("data"),
                                                 P("data")), out_specs=specs)
  with pytest.raises(ValueError, match=r"not a leaf.*FSDP.*jax.jit without shard_map"):
    jax.jit(run)(params, state, x, y)


# ------------------------------------------------------------ skipped at run time

def test_out_of_range_labels_skip_the_step():
  """Labels ≥ the number of classes: NaN loss and gradients, so the step is
  skipped; the running factors are not overwritten."""
  x, _ = _batch(3)
  bad = jnp.full((BATCH,), CLASSES)
  loss, _, _ = GRAD_FN(_params(), x, bad)
  assert np.isnan(float(loss))
  _assert_skipped_unchanged(_kfac(), (x, bad))
  _assert_skipped_unchanged(_kfac(), (x, -jnp.ones((BATCH,), jnp.int32)))


def test_negative_or_nan_mask_weights_skip_the_step():
  """A mask is the examples' weights: a negative one (an advantage-weighted
  policy-gradient loss written as a mask) would make the curvature negative
  definite, a NaN one the loss; both poison the loss, and the step is skipped
  with the state unchanged."""
  logits = jnp.zeros((4, 3))
  labels = jnp.array([0, 1, 2, 1])
  for weights in ([1.0, -0.5, 1.0, 1.0], [1.0, jnp.nan, 1.0, 0.0]):
    assert np.isnan(float(kd.losses.softmax_cross_entropy(logits, labels,
                                                          mask=jnp.array(weights))))
  assert np.isfinite(float(kd.losses.softmax_cross_entropy(
      logits, labels, mask=jnp.array([1.0, 0.0, 0.5, 2.0]))))
  def weighted_loss(params, x, y, weights=None):
    h = jnp.tanh(kd.tags.dense(x, params["l0"]["kernel"], params["l0"]["bias"], name="l0"))
    return kd.losses.softmax_cross_entropy(kd.tags.dense(h, params["out"]["kernel"],
                                                         name="out"), y, mask=weights)
  x, y = _batch(3)
  signed = jnp.where(jnp.arange(BATCH) % 2 == 0, 1.0, -1.0)
  _assert_skipped_unchanged(_kfac(), (x, y, signed), grad_fn=kd.value_and_grad(weighted_loss))


def test_masked_out_of_range_labels_are_fine():
  """Padding positions (mask 0) may carry any label, e.g. -1."""
  logits = jnp.zeros((4, 3))
  loss = kd.losses.softmax_cross_entropy(logits, jnp.array([0, 1, 2, -1]),
                                         mask=jnp.array([1, 1, 1, 0]))
  np.testing.assert_allclose(float(loss), np.log(3), rtol=1e-6)


@pytest.mark.parametrize("loss", ["squared_error", "sigmoid_cross_entropy",
                                  "softmax_cross_entropy"])
def test_masked_nan_targets_are_fine(loss):
  """Padding positions (mask 0) may carry NaN float targets: the loss is the
  kept positions' mean and its gradient is finite."""
  logits = jnp.array([[0.3, -0.2], [1.0, 0.5], [0.1, 0.4]])
  targets = jnp.array([[0.0, 1.0], [1.0, 0.0], [jnp.nan, jnp.nan]])
  mask = jnp.array([1.0, 0.5, 0.0])
  fn = getattr(kd.losses, loss)
  value, grad = jax.value_and_grad(lambda z: fn(z, targets, mask=mask))(logits)
  expected = fn(logits[:2], targets[:2], mask=mask[:2])
  np.testing.assert_allclose(float(value), float(expected), rtol=1e-6)
  assert np.all(np.isfinite(np.asarray(grad))) and not np.any(np.asarray(grad)[2])


@pytest.mark.parametrize("padded", ["columns", "rows_and_columns"])
def test_masked_rows_may_hold_infinite_logits(padded):
  """A padded contrastive batch: padding's similarities set to -inf (its rows'
  labels then have a -inf logit, or whole rows are -inf). The masked loss, its
  gradient, the curvature products and the sampled loss are the unpadded
  batch's: 0 · inf made them NaN (adaptive K-FAC then skipped every step)."""
  real, padded_size = 4, 6
  z = jax.random.normal(jax.random.PRNGKey(0), (padded_size, 3))
  labels, mask = jnp.arange(padded_size), (jnp.arange(padded_size) < real) * 1.0

  def logits_of(p, x):
    sim = kd.tags.dense(x, p["w"], name="w") @ x.T
    sim = jnp.where(jnp.arange(padded_size)[None, :] < real, sim, -jnp.inf)
    if padded == "rows_and_columns":
      sim = jnp.where(jnp.arange(padded_size)[:, None] < real, sim, -jnp.inf)
    return sim

  def masked(p, x, y):
    return kd.losses.softmax_cross_entropy(logits_of(p, x), y, mask=mask)

  def unpadded(p, x, y):
    return kd.losses.softmax_cross_entropy(logits_of(p, x)[:real, :real], y[:real])

  params = {"w": jnp.eye(3)}
  vectors = ({"w": jnp.ones((3, 3))},)
  for fn in (kd.value_and_grad(masked), kd.value_and_grad(masked, fisher="mc")):
    loss, grads, _ = fn(params, z, labels, rng=jax.random.PRNGKey(1))
    want_loss, want_grads = jax.value_and_grad(unpadded)(params, z, labels)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(grads["w"], want_grads["w"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(
        fn.gauss_newton_gram(params, vectors, z, labels),
        kd.value_and_grad(unpadded).gauss_newton_gram(params, vectors, z, labels),
        rtol=1e-5)
  _, _, stats = kd.value_and_grad(masked, fisher="mc")(params, z, labels,
                                                       rng=jax.random.PRNGKey(1))
  assert all(np.all(np.isfinite(np.asarray(s))) for s in jax.tree.leaves(stats))


def test_targets_outside_their_range_make_the_loss_nan():
  """A sigmoid label outside [0, 1] or a negative entry of a target
  distribution makes the loss unbounded below: NaN (a skipped step), as an
  out-of-range integer label; masked positions may carry them."""
  logits = jnp.array([[0.3, -0.2], [1.0, 0.5]])
  for fn, bad in ((kd.losses.sigmoid_cross_entropy, jnp.array([[0.0, 1.0], [3.0, 0.0]])),
                  (kd.losses.sigmoid_cross_entropy, jnp.array([[0.0, 1.0], [0.5, -1.0]])),
                  (kd.losses.softmax_cross_entropy, jnp.array([[0.5, 0.5], [1.5, -0.5]]))):
    assert np.isnan(float(fn(logits, bad)))
    assert np.isfinite(float(fn(logits, bad, mask=jnp.array([1.0, 0.0]))))


def test_target_distributions_need_not_sum_to_one():
  """Soft targets whose rows sum to 1.2 or 0 (a padding row) train: the
  curvature is weighted by each row's sum (test_curvature, test_capture), so
  the step is taken; a negative entry skips it, the state unchanged, unless
  masked. Label-smoothed targets in float32 and bfloat16 train."""
  x, labels = _batch(3)
  onehot = jax.nn.one_hot(labels, CLASSES, dtype=jnp.float32)
  for targets in (onehot.at[2].multiply(1.2), onehot.at[1].set(0.0),
                  optax.smooth_labels(onehot, 0.1).astype(jnp.bfloat16)):
    assert np.isfinite(float(GRAD_FN(_params(), x, targets)[0]))
    params, state = _step(_kfac(), _params(), _kfac().init(_params()), (x, targets))
    assert _skipped(state) == [0]
  negative = onehot.at[2, 0].set(-0.5)
  assert np.isnan(float(GRAD_FN(_params(), x, negative)[0]))
  _assert_skipped_unchanged(_kfac(), (x, negative))
  logits = jax.random.normal(jax.random.PRNGKey(0), (BATCH, CLASSES))
  mask = jnp.ones((BATCH,)).at[2].set(0.0)
  assert np.isfinite(float(kd.losses.softmax_cross_entropy(logits, negative, mask=mask)))


def test_an_all_masked_batch_accumulates_to_zero():
  """A batch whose every position is masked (a padding-only shard): its loss
  and gradients are 0 whole or accumulated over micro-batches (`accumulate`
  divided by the masks' sum, 0, gave NaN: a skipped step on every device)."""
  x, y = _batch(0)
  mask = jnp.zeros((BATCH,))
  def masked_loss(params, x, y, mask):
    h = jnp.tanh(kd.tags.dense(x, params["l0"]["kernel"], params["l0"]["bias"], name="l0"))
    return kd.losses.softmax_cross_entropy(kd.tags.dense(h, params["out"]["kernel"],
                                                         name="out"), y, mask=mask)
  grad_fn = kd.value_and_grad(masked_loss)
  for loss, grads, _ in (grad_fn(_params(), x, y, mask),
                         grad_fn.accumulate(_params(), x, y, mask, micro_batches=2)):
    assert float(loss) == 0.0
    assert not any(np.any(np.asarray(g)) for g in jax.tree.leaves(grads))


def test_statistics_of_another_step_skip_a_factor_step():
  """Statistics captured with the previous step's opt_state are NaN
  placeholders on a factor step that the previous state did not expect."""
  tx = _kfac(factor_update_every=2)
  params = _params()
  state0 = tx.init(params)
  params, state1 = _step(tx, params, state0, _batch(0))        # count 1: no factors
  params, state2 = _step(tx, params, state1, _batch(1))        # count 2: factors next
  assert bool(kd.find_states(state2)[0].update_factors)
  _, grads, stale_stats = GRAD_FN(params, *_batch(2), opt_state=state1)   # wrong state
  updates, state3 = tx.update(grads, state2, params, kfac_stats=stale_stats)
  assert _skipped(state3) == [1]
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))


def _tiny_curvature_layer(dtype, damping):
  """One 3×2 Dense layer of `dtype` whose statistics are 1e-15·I: K-FAC then
  divides its gradient by about `damping`. (params, tx, state, stats)."""
  params = {"l": {"kernel": jnp.ones((3, 2), dtype)}}
  layers = kd.LayerRegistry((kd.TaggedLayer(
      name="l", kind="dense", kernel_path="l/kernel", bias_path=None, kernel_shape=(3, 2),
      a_dim=3, g_dim=2),))
  tx = kd.scale_by_kfac(layers, damping=damping)
  stats = {"l": {"A": jnp.eye(3) * 1e-15, "G": jnp.eye(2) * 1e-15}}
  return params, tx, tx.init(params), stats


@pytest.mark.parametrize("options", [{"factor_update_every": 2}, {"stale_threshold": 0.1}],
                         ids=["cadence", "stale"])
def test_non_finite_statistic_skips_a_factor_step(options):
  """Finite gradients, one NaN in a statistic of a factor step (checked inside
  the factor update's conditional): skipped, the state unchanged but the
  counter; the same statistic on a step that reads none is ignored."""
  tx = _kfac(**options)
  params = _params()
  state = tx.init(params)
  _, grads, stats = GRAD_FN(params, *_batch(0), opt_state=state)
  poisoned = jax.tree.map(lambda x: x, stats)
  g = poisoned["out"]["G"]
  poisoned["out"]["G"] = g.at[helpers.entry(g, 0, 0)].set(jnp.nan)
  updates, new_state = tx.update(grads, state, params, kfac_stats=poisoned)
  assert _skipped(new_state) == [1]
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  changed = [not np.array_equal(a, b)
             for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new_state))]
  assert sum(changed) == 1            # the `skipped` counter only
  if "factor_update_every" in options:     # count 1 reads no statistics
    _, state = _step(tx, params, state, _batch(0))
    assert not bool(kd.find_states(state)[0].update_factors)
    _, grads, stats = GRAD_FN(params, *_batch(1), opt_state=state)
    g = stats["out"]["G"]
    stats["out"]["G"] = g.at[helpers.entry(g, 0, 0)].set(jnp.nan)
    _, after = tx.update(grads, state, params, kfac_stats=stats)
    assert _skipped(after) == [0]


def test_non_finite_produced_update_skips_the_step():
  """Finite gradients and statistics, valid settings, yet an update that
  overflows float32: skipped, the state unchanged (issue 13 item 1)."""
  params, tx, state, stats = _tiny_curvature_layer(jnp.float32, 1e-30)
  grads = {"l": {"kernel": jnp.full((3, 2), 1e10)}}
  updates, new_state = tx.update(grads, state, params, kfac_stats=stats)
  assert int(new_state.skipped) == 1 and int(new_state.count) == 0
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  np.testing.assert_array_equal(new_state.factors, state.factors)


def test_update_overflowing_a_narrow_parameter_dtype_skips_the_step():
  """A float16 parameter whose preconditioned update is finite in float32 but
  overflows float16 when written back: skipped (the produced check reads one
  scalar for the tagged layers, so narrow dtypes are checked leaf by leaf)."""
  params, tx, state, stats = _tiny_curvature_layer(jnp.float16, 1e-6)
  grads = {"l": {"kernel": jnp.ones((3, 2), jnp.float16)}}     # V = 1e6: inf in float16
  updates, new_state = tx.update(grads, state, params, kfac_stats=stats)
  assert int(new_state.skipped) == 1 and int(new_state.count) == 0
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  small = {"l": {"kernel": jnp.full((3, 2), 1e-3, jnp.float16)}}   # V = 1e3: fits
  updates, new_state = tx.update(small, state, params, kfac_stats=stats)
  assert int(new_state.skipped) == 0 and int(new_state.count) == 1
  assert np.all(np.isfinite(np.asarray(updates["l"]["kernel"], np.float32)))


def test_accumulated_gradients_keep_the_parameters_dtypes():
  """`grad_fn.accumulate` sums in float32 and returns the gradients in the
  parameters' dtypes, as `grad_fn` does (a bfloat16 model got float32
  gradients, hence float32 updates that skipped float16's overflow check)."""
  def loss(p, x, y):
    return kd.losses.softmax_cross_entropy(kd.tags.dense(x, p["w"], name="l"), y)
  grad_fn = kd.value_and_grad(loss)
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 3)).astype(jnp.bfloat16)
  y = jnp.arange(8) % 2
  params = {"w": jnp.ones((3, 2), jnp.bfloat16)}
  _, whole, _ = grad_fn(params, x, y)
  _, accumulated, _ = grad_fn.accumulate(params, x, y, micro_batches=4)
  assert whole["w"].dtype == accumulated["w"].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(accumulated["w"], np.float32),
                             np.asarray(whole["w"], np.float32), rtol=2e-2, atol=1e-3)


def test_injected_hyperparameters_are_checked_at_run_time():
  """optax.inject_hyperparams passes arrays: a bad value skips the step (its
  own step counter advances unless it, too, is wrapped in skip_faulty_steps)."""
  tx = kd.skip_faulty_steps(optax.inject_hyperparams(kd.kfac, static_args=("layers",))(
      learning_rate=0.1, factor_decay=1.5, layers=LAYERS))
  _assert_skipped_unchanged(tx, _batch(5), steps_before=0)
  good = optax.inject_hyperparams(kd.kfac, static_args=("layers",))(
      learning_rate=0.1, factor_decay=0.5, layers=LAYERS)
  params, state = _step(good, _params(), good.init(_params()), _batch(5))
  assert _skipped(state) == [0]
  shampoo = optax.inject_hyperparams(kd.shampoo)(learning_rate=0.1, beta2=1.5)

  def shampoo_step(params, state, batch):
    grads = jax.grad(loss_fn)(params, *batch)
    return shampoo.update(grads, state, params)
  updates, state = shampoo_step(_params(), shampoo.init(_params()), _batch(5))
  assert _skipped(state) == [1]


def _injectable(name: str, options: dict) -> tuple:
  """(factory, static_args, options) for optax.inject_hyperparams."""
  if name == "kfac":
    return kd.kfac, ("layers",), dict(options, layers=LAYERS)
  if name == "adaptive":         # learning_rate=None (adapted) cannot be injected
    options = {k: v for k, v in options.items() if k != "learning_rate"}
    return (kd.kfac, ("layers", "grad_fn", "learning_rate"),
            dict(options, learning_rate=None, layers=LAYERS, grad_fn=GRAD_FN))
  return {"shampoo": kd.shampoo, "soap": kd.soap}[name], (), options


@pytest.mark.parametrize("name,options", [
    ("kfac", dict(momentum=1.5)), ("kfac", dict(weight_decay=-1.0)),
    ("kfac", dict(learning_rate=-0.1, kl_clip=None)),
    ("adaptive", dict(momentum=1.5)), ("adaptive", dict(weight_decay=-1e-3)),
    ("shampoo", dict(learning_rate=-0.1)), ("shampoo", dict(momentum=1.0)),
    ("soap", dict(weight_decay=-1e-3))])
def test_injected_first_order_tail_is_checked_at_run_time(name, options):
  """optax.inject_hyperparams hands the SGD (Adam) after the preconditioner
  arrays, which construction cannot check: a bad one skips the step (the
  gradients are made NaN before the preconditioner, whose fault path skips)."""
  make, static, options = _injectable(name, dict(learning_rate=0.1) | options)
  tx = kd.skip_faulty_steps(optax.inject_hyperparams(make, static_args=static)(**options))
  if name == "kfac":
    _assert_skipped_unchanged(tx, _batch(5), steps_before=0)
    return
  if name == "adaptive":
    params, batch = _params(), _batch(5)
    state = tx.init(params)
    _, grads, stats = GRAD_FN(params, *batch, opt_state=state)
    updates, new_state = tx.update(grads, state, params, kfac_stats=stats,
                                   kfac_batch=batch)
    assert [int(s.skipped) for s in states_lib.find_states(new_state)] == [1]
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
    return
  params, batch = _params(), _batch(5)
  state = tx.init(params)
  updates, new_state = tx.update(jax.grad(loss_fn)(params, *batch), state, params)
  assert [int(s.skipped) for s in states_lib.find_states(new_state)] == [1]
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("name", ["kfac", "shampoo", "soap"])
def test_injected_good_first_order_tail_changes_nothing(name):
  """With good injected values the check lets the step through: not skipped,
  the updates of the transform built with the numbers (up to the float32
  rounding by which arrays and Python numbers differ in K-FAC's eager ops,
  as before the check: 8e-4 at most here)."""
  make, static, options = _injectable(name, dict(learning_rate=0.1, weight_decay=1e-3) | (
      {} if name == "soap" else dict(momentum=0.5)))
  injected = optax.inject_hyperparams(make, static_args=static)(**options)
  plain = make(**options)
  params, batch = _params(), _batch(5)
  _, grads, stats = GRAD_FN(params, *batch, opt_state=None)
  extra = dict(kfac_stats=stats) if name == "kfac" else {}
  got, state = injected.update(grads, injected.init(params), params, **extra)
  want, _ = plain.update(grads, plain.init(params), params, **extra)
  assert [int(s.skipped) for s in states_lib.find_states(state)] == [0]
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-7)


def _injected(name: str, options: dict, static: tuple = ()) -> optax.GradientTransformation:
  """`optax.inject_hyperparams` of `name` with `options` (learning rate 0.1),
  `static` named in `static_args` too."""
  make, static_args, options = _injectable(name, dict(learning_rate=0.1) | options)
  return optax.inject_hyperparams(make, static_args=static_args + static)(**options)


_STATE_KINDS = {"kfac": kd.ScaleByKfacState, "adaptive": kd.ScaleByKfacState,
                "shampoo": kd.ScaleByShampooState, "soap": kd.ScaleBySoapState}


def _jitted_step(name: str, tx, params, state):
  """One jitted update (`kfac_batch` in adaptive mode)."""
  batch = _batch(0)
  _, grads, stats = GRAD_FN(params, *batch, opt_state=state)
  extra = dict(kfac_stats=stats) | (dict(kfac_batch=batch) if name == "adaptive" else {})
  return jax.jit(lambda g, s, p, e: tx.update(g, s, p, **e))(grads, state, params, extra)


def _assert_one_good_step(name: str, tx, params, state) -> None:
  """A jitted update from `state` (at count 0) is taken."""
  _, state = _jitted_step(name, tx, params, state)
  (found,) = states_lib.find_states(state, _STATE_KINDS[name])
  assert (int(found.count), int(found.skipped)) == (1, 0)


@pytest.mark.parametrize("name,option,value", [
    ("shampoo", "block_size", 4), ("shampoo", "merge_small_dims", 4),
    ("shampoo", "max_preconditioner_dim", 6), ("shampoo", "exponent_override", 4.0),
    ("soap", "block_size", 4), ("soap", "max_preconditioner_dim", 6),
    ("kfac", "max_factor_dim", 6), ("adaptive", "micro_batches", 2)])
def test_injected_shape_options_need_static_args_when_traced(name, option, value):
  """A shape option passed to `optax.inject_hyperparams` arrives as an array:
  read where it is concrete it works (Shampoo's and SOAP's at a concrete init);
  traced (the checkpoint template `jax.eval_shape(tx.init, params)`, and K-FAC's
  jitted update, which reads it too) it raises, naming it and `static_args`.
  Named in `static_args`, everything works."""
  params = _params()
  injected = _injected(name, {option: value})
  match = rf"{option} decides .* static_args=\('{option}',\)"
  with pytest.raises(TypeError, match=match):
    jax.eval_shape(injected.init, params)
  state = injected.init(params)
  if name in ("kfac", "adaptive"):
    with pytest.raises(TypeError, match=match):
      _jitted_step(name, injected, params, state)
  else:
    _assert_one_good_step(name, injected, params, state)
  static = _injected(name, {option: value}, (option,))
  state = static.init(params)
  template = jax.eval_shape(static.init, params)
  assert jax.tree.structure(template) == jax.tree.structure(state)
  _assert_one_good_step(name, static, params, state)


@pytest.mark.parametrize("name,option,dtype", [
    ("kfac", "factor_dtype", jnp.bfloat16), ("shampoo", "statistics_dtype", jnp.bfloat16),
    ("soap", "statistics_dtype", jnp.bfloat16)])
def test_injected_dtypes_need_static_args(name, option, dtype):
  """A dtype is callable: `optax.inject_hyperparams` takes it for a schedule,
  whose value is an array; `init` refuses it by name, pointing to
  `static_args`, where it works."""
  params = _params()
  with pytest.raises(TypeError, match=rf"{option} must be a floating dtype .* got an "
                                      rf"array: .*static_args=\('{option}',\)"):
    _injected(name, {option: dtype}).init(params)
  static = _injected(name, {option: dtype}, (option,))
  _assert_one_good_step(name, static, params, static.init(params))


def test_cadences_choose_a_distributed_storage_while_tracing():
  """With several devices the cadences at count 0 choose the factors'
  storage: a schedule is evaluated there also under `jax.eval_shape` (the
  checkpoint template); a number `optax.inject_hyperparams` injected is traced
  there and raises, naming it and `static_args`, where it works."""
  params = _params()
  dist = kd.Distribution(helpers.data_mesh(), grad_worker_fraction=1 / 8)
  scheduled = kd.kfac(0.1, layers=LAYERS, distribution=dist,
                      factor_update_every=optax.constant_schedule(10))
  assert (jax.tree.structure(jax.eval_shape(scheduled.init, params))
          == jax.tree.structure(scheduled.init(params)))
  options = dict(learning_rate=0.1, layers=LAYERS, distribution=dist,
                 factor_update_every=10, inverse_update_every=100)
  injected = optax.inject_hyperparams(kd.kfac, static_args=("layers", "distribution"))
  with pytest.raises(TypeError, match=r"factor_update_every decides .* "
                                      r"static_args=\('factor_update_every',\)"):
    jax.eval_shape(injected(**options).init, params)
  static = optax.inject_hyperparams(kd.kfac, static_args=(
      "layers", "distribution", "factor_update_every", "inverse_update_every"))(**options)
  assert (jax.tree.structure(jax.eval_shape(static.init, params))
          == jax.tree.structure(static.init(params)))


def test_injected_kfac_traces_with_its_defaults():
  """`optax.inject_hyperparams(kd.kfac)` with no shape option given: the
  checkpoint template and jitted steps need only `layers` static (the
  defaults of `max_factor_dim` and `factor_dtype` are None, not injected)."""
  params = _params()
  tx = _injected("kfac", {})
  state = tx.init(params)
  assert jax.tree.structure(jax.eval_shape(tx.init, params)) == jax.tree.structure(state)
  for _ in range(2):
    _, state = _jitted_step("kfac", tx, params, state)
  assert _skipped(state) == [0] and int(states_lib.find_states(state)[0].count) == 2


def _tail_transform(name: str, **options) -> optax.GradientTransformation:
  if name == "kfac":
    return kd.kfac(layers=LAYERS, **options)
  return {"shampoo": kd.shampoo, "soap": kd.soap}[name](**options)


@pytest.mark.parametrize("name,options", [
    ("kfac", dict(weight_decay=lambda count: jnp.where(count >= 1, -1e-3, 1e-3))),
    ("shampoo", dict(learning_rate=lambda count: jnp.where(count >= 1, -0.1, 0.1))),
    ("shampoo", dict(weight_decay=optax.linear_schedule(1e-3, -1e-3, 1))),
    ("soap", dict(learning_rate=optax.linear_schedule(1e-3, -1e-3, 1)))])
def test_first_order_tail_schedules_are_checked_at_run_time(name, options):
  """A learning-rate or weight-decay schedule of the optax tail that goes
  negative (a linear decay past zero) skips the steps where it does, state
  unchanged: the link that checks it counts the accepted steps, as optax's
  schedules do, so it stays skipped."""
  tx = _tail_transform(name, **(dict(learning_rate=1e-3) | options))
  params, state = _step(tx, _params(), tx.init(_params()), _batch(0))
  assert _skipped(state) == [0]
  _assert_skipped_unchanged(tx, _batch(1), params, state, steps_before=0)
  for i in (1, 2):
    params, state = _step(tx, params, state, _batch(i))
  assert _skipped(state) == [2]


@pytest.mark.parametrize("name", ["kfac", "shampoo", "soap"])
def test_good_first_order_tail_schedules_change_nothing(name):
  """A schedule that stays valid is checked and the steps go on: three steps
  equal those with its constant value, bit for bit."""
  scheduled = _tail_transform(name, learning_rate=lambda count: 1e-3 + 0 * count,
                              weight_decay=lambda count: 1e-4 + 0 * count)
  constant = _tail_transform(name, learning_rate=1e-3, weight_decay=1e-4)
  runs = []
  for tx in (scheduled, constant):
    params, state = _params(), tx.init(_params())
    for i in range(3):
      params, state = _step(tx, params, state, _batch(i))
    assert _skipped(state) == [0]
    runs.append(params)
  for a, b in zip(*map(jax.tree.leaves, runs)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name,kind", [("shampoo", kd.ScaleByShampooState),
                                       ("soap", kd.ScaleBySoapState)])
def test_find_states_reads_every_preconditioner(name, kind):
  """`kd.find_states(tree, kind)` reaches Shampoo's and SOAP's counters, under
  the chain and `skip_faulty_steps`, as K-FAC's; another kind is refused."""
  tx = _tail_transform(name, learning_rate=1e-3)
  params, state = _step(tx, _params(), tx.init(_params()), _batch(0))
  bad = _batch(1)
  _, state = _step(tx, params, state, (bad[0].at[0, 0].set(jnp.nan), bad[1]))
  (found,) = kd.find_states(state, kind)
  assert (int(found.count), int(found.skipped)) == (1, 1)
  assert kd.find_states(state) == []                  # K-FAC's: none here
  with pytest.raises(TypeError, match="kind must be one of the library's state classes"):
    kd.find_states(state, optax.ScaleByScheduleState)


def test_momentum_schedules_are_refused():
  """optax's momentum trace takes a number, not a schedule."""
  for make in (lambda m: kd.kfac(0.1, m, layers=LAYERS), lambda m: kd.shampoo(0.1, m)):
    with pytest.raises(TypeError, match="momentum must be a number or an array"):
      make(lambda count: 0.9)


def test_schedule_values_are_checked_at_run_time():
  """An interval schedule that returns 0 or a fraction, or a damping schedule
  that returns a negative number, skips the steps where it does."""
  tx = _kfac(inverse_update_every=lambda count: jnp.where(count == 1, 0, 1))
  params, state = _step(tx, _params(), tx.init(_params()), _batch(0))
  params, state = _step(tx, params, state, _batch(1))
  assert _skipped(state) == [1]
  tx = _kfac(damping=lambda count: jnp.where(count >= 1, -1.0, 1e-3))
  _assert_skipped_unchanged(tx, _batch(2))
  # a fractional interval (truncated, 2.5 would run every 2 steps) too
  tx = _kfac(factor_update_every=lambda count: jnp.where(count == 1, 2.5, 1.0))
  params, state = _step(tx, _params(), tx.init(_params()), _batch(0))
  params, state = _step(tx, params, state, _batch(1))
  assert _skipped(state) == [1]


@pytest.mark.parametrize("make, name", [
    (lambda: kd.kfac(lambda count: jnp.array([0.1, 0.2]), layers=LAYERS), "learning_rate"),
    (lambda: kd.kfac(lambda count: jnp.array([0.1]), layers=LAYERS), "learning_rate"),
    (lambda: kd.kfac(jnp.array([0.1, 0.2]), layers=LAYERS), "learning_rate"),
    (lambda: kd.kfac(0.1, layers=LAYERS, damping=lambda count: jnp.ones(2)), "damping"),
    (lambda: kd.shampoo(0.1, epsilon=jnp.ones(3)), "epsilon"),
    (lambda: kd.soap(0.1, precondition_every=lambda count: jnp.array([5, 10])),
     "precondition_every")])
def test_hyperparameters_of_another_shape_are_named(make, name):
  """A learning rate (or any hyperparameter) of shape (2,), an array or a
  schedule's value, broadcast against each update: a (3, 2) kernel's columns
  took different steps, silently (and shape (1,) turns a scalar parameter
  into a vector). Refused, naming the argument, when constructed or traced."""
  params, batch = _params(), _batch()
  with pytest.raises(ValueError, match=f"{name} must be one number"):
    tx = make()
    state = tx.init(params)
    _, grads, stats = GRAD_FN(params, *batch, opt_state=state)
    tx.update(grads, state, params, **({"kfac_stats": stats} if stats else {}))


@pytest.mark.parametrize("check", [
    lambda v, c: settings.positive_ok("x", v, c),
    lambda v, c: settings.positive_ok("x", v, c, allow_zero=True),
    lambda v, c: settings.range_ok("x", v, c, 0.0, 1.0),
    lambda v, c: settings.range_ok("x", v, c, 0.0, 1.0, closed_low=False, closed_high=True),
    lambda v, c: settings.interval_ok("x", v, c)])
def test_python_numbers_verdicts_are_the_traced_ones(check):
  """A Python number's run-time verdict is folded while tracing (no
  equations) and equals the verdict of the same value as a traced float32
  array, rounding included: 1e-50 is 0 and 1e39 is inf in float32, and
  0.99999999 is 1."""
  values = [1e-3, 0.5, 1.0, 0.0, -1.0, 1e-50, 1e39, 0.99999999, float("nan"),
            float("inf"), 1, 0, 2, -3]
  count = jnp.asarray(3, jnp.int32)
  for value in values:
    folded = check(value, count)
    assert isinstance(folded, np.bool_), value
    traced = jax.jit(lambda v: check(v, count))(jnp.asarray(value))
    assert bool(folded) == bool(traced), value
  numbers = jax.make_jaxpr(lambda c: settings.all_ok(
      [functools.partial(check, v, c) for v in values]))(count)
  assert not numbers.jaxpr.eqns
  good = next(v for v in values if check(v, count))
  bad = next(v for v in values if not check(v, count))
  mixed = jax.jit(lambda v: settings.all_ok([lambda: check(good, count),
                                             lambda: check(v, count)]))
  assert bool(mixed(jnp.asarray(good, jnp.float32)))
  assert not bool(mixed(jnp.asarray(bad, jnp.float32)))
  assert not bool(settings.all_ok([lambda: check(bad, count), lambda: check(good, count)]))


def test_one_process_nan_skips_on_every_device_shampoo():
  """A NaN on one device's local gradients (SP-NGD routing keeps them local)
  skips the Shampoo step on all eight."""
  mesh = helpers.data_mesh(8)
  dist = kd.Distribution(mesh, grad_worker_fraction=1 / 8,
                         gradient_reduction="reduce_scatter")
  tx = kd.scale_by_shampoo(block_size=4, distribution=dist)
  params = _params()
  state = tx.init(params)
  specs = kd.partition_specs(state)

  def step(grads, state):
    return tx.update(jax.tree.map(lambda g: g[0], grads), state)
  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), specs),
                              out_specs=(P(), specs)))
  grads = jax.tree.map(lambda p: jnp.ones((8,) + p.shape), params)
  grads["out"]["kernel"] = grads["out"]["kernel"].at[5, 0, 0].set(jnp.nan)
  updates, new_state = run(grads, kd.shard_state(state, mesh))
  assert int(new_state.skipped) == 1
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))


def test_a_schedule_that_goes_negative_skips_on_every_device():
  """kd.shampoo over 8 devices (MEM-OPT) with a learning-rate schedule that is
  negative from count 1: the first step goes, the second is skipped on every
  device with the whole chain's state (the link's replicated count included)
  unchanged but `skipped`."""
  mesh = helpers.data_mesh(8)
  dist = kd.Distribution(mesh, grad_worker_fraction=1 / 8,
                         gradient_reduction="all_reduce")
  tx = kd.shampoo(lambda count: jnp.where(count >= 1, -1e-3, 1e-3), block_size=4,
                  distribution=dist)
  params = _params()
  state = tx.init(params)
  specs = kd.partition_specs(state)

  def step(grads, state, params):
    return tx.update(jax.tree.map(lambda g: g[0], grads), state, params)
  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), specs, P()),
                              out_specs=(P(), specs)))
  grads = jax.tree.map(lambda p: jnp.ones((8,) + p.shape), params)
  updates, first = run(grads, kd.shard_state(state, mesh), params)
  assert _skipped(first) == [0] and any(np.any(np.asarray(u))
                                        for u in jax.tree.leaves(updates))
  updates, second = run(grads, first, params)
  assert _skipped(second) == [1]
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  changed = [not np.array_equal(a, b)
             for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second))]
  assert sum(changed) == 1            # the `skipped` counter only


# ------------------------------------------------------------------ checkpoints

@pytest.fixture
def saved(tmp_path):
  state = _kfac().init(_params())
  kd.save_checkpoint(tmp_path / "ckpt", state)
  return tmp_path / "ckpt", state


@pytest.mark.parametrize("name", ["_CHECKPOINT_METADATA", "kfac_layout/metadata",
                                  "state/_METADATA"])
def test_emptied_metadata_file_is_named(saved, name):
  pytest.importorskip("orbax.checkpoint")
  path, state = saved
  open(os.path.join(path, name), "w").close()
  with pytest.raises(ValueError, match=f"metadata file .*{name}.* is damaged"):
    kd.restore_checkpoint(path, state)


def test_emptied_array_metadata_is_named(saved):
  pytest.importorskip("orbax.checkpoint")
  path, state = saved
  folder = os.path.join(path, "state", "array_metadatas")
  for name in os.listdir(folder):
    open(os.path.join(folder, name), "w").close()
  with pytest.raises(ValueError, match="array_metadatas.* is damaged"):
    kd.restore_checkpoint(path, state)


def test_missing_checkpoint_is_named(tmp_path):
  with pytest.raises(ValueError, match="no checkpoint at .*nowhere"):
    kd.restore_checkpoint(tmp_path / "nowhere", _kfac().init(_params()))


def test_restore_casting_a_dtype_is_refused(saved):
  pytest.importorskip("orbax.checkpoint")
  path, _ = saved
  template = _kfac(factor_dtype=jnp.bfloat16).init(_params())
  with pytest.raises(ValueError, match="saved as float32, the template has bfloat16"):
    kd.restore_checkpoint(path, template)


@pytest.mark.parametrize("make", [
    lambda dist: _kfac(distribution=dist),
    lambda dist: kd.kfac(None, None, layers=LAYERS, grad_fn=GRAD_FN, distribution=dist),
    lambda dist: kd.shampoo(0.1, distribution=dist)], ids=["kfac", "adaptive", "shampoo"])
def test_placing_a_state_on_another_mesh_is_refused(make):
  """A state laid out for 8 devices placed on a 4-device mesh: named by
  shard_state, not found out inside the step (or not at all)."""
  mesh = helpers.data_mesh(8)
  state = make(kd.Distribution(mesh, grad_worker_fraction=1 / 8)).init(_params())
  with pytest.raises(ValueError, match="shard_state: the state is laid out for 8 devices "
                                       "of axis 'data', the mesh has"):
    kd.shard_state(state, helpers.data_mesh(4))
  kd.shard_state(state, mesh)


def test_converting_into_another_optimizer_is_refused():
  """convert_state moves a state between distributions; a K-FAC state into a
  Shampoo template is named, not an AttributeError."""
  with pytest.raises(ValueError, match="holds a ScaleByKfacState where the template "
                                       "holds a ScaleByShampooState"):
    kd.convert_state(_kfac().init(_params()), kd.shampoo(0.1).init(_params()))


def test_restore_onto_another_mesh_is_refused(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  mesh = helpers.data_mesh(8)
  tx = _kfac(distribution=kd.Distribution(mesh, grad_worker_fraction=1 / 8))
  state = kd.shard_state(tx.init(_params()), mesh)
  kd.save_checkpoint(tmp_path / "ckpt", state)
  template = jax.eval_shape(tx.init, _params())
  with pytest.raises(ValueError, match="not placed on a mesh: pass mesh="):
    kd.restore_checkpoint(tmp_path / "ckpt", template)
  with pytest.raises(ValueError, match="restore_checkpoint: the state is laid out for 8 "
                                       "devices of axis 'data', the mesh has"):
    kd.restore_checkpoint(tmp_path / "ckpt", template, mesh=helpers.data_mesh(4))
  restored = kd.restore_checkpoint(tmp_path / "ckpt", template, mesh=mesh)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)


def test_checkpoint_records_dtypes(saved):
  pytest.importorskip("orbax.checkpoint")
  path, _ = saved
  with open(os.path.join(path, "kfac_layout", "metadata"), encoding="utf-8") as f:
    meta = json.load(f)
  assert ["float32"] == sorted({d for _, d in meta["dtypes"]} - {"int32", "bool"})


def _wide_head(width: int):
  """A Dense 6 → `width` head (abstract parameters) and its layers: `G` is
  `width × width`."""
  def wide_loss(p, x, y):
    return kd.losses.softmax_cross_entropy(kd.tags.dense(x, p["head"], name="head"), y)
  params = {"head": jax.ShapeDtypeStruct((6, width), jnp.float32)}
  x = jax.ShapeDtypeStruct((BATCH, 6), jnp.float32)
  y = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
  return params, kd.value_and_grad(wide_loss).discover(params, x, y)


def test_a_full_factor_wider_than_packed_triangles_allow_is_refused_at_init():
  """A full 32000-wide factor (a vocabulary-sized head) is refused by `init`,
  naming the layer and `max_factor_dim=`, before any array is built (before,
  `init` built 6 GB and the first traced step refused it); kept diagonal it
  is fine, and a full factor wider than 16384 warns once."""
  params, layers = _wide_head(32000)
  with pytest.raises(ValueError, match=r"layer 'head' has a full 32000×32000 factor G.*"
                                       r"up to 30000 wide.*max_factor_dim="):
    kd.kfac(1e-2, layers=layers).init(params)
  state = jax.eval_shape(kd.kfac(1e-2, layers=layers, max_factor_dim=4096).init, params)
  assert sum(x.size for x in jax.tree_util.tree_leaves(state)) < 10 ** 6
  params, layers = _wide_head(16385)
  with pytest.warns(UserWarning, match=r"wider than 16384: 'head' G 16385×16385"):
    jax.eval_shape(kd.kfac(1e-2, layers=layers).init, params)


@pytest.mark.parametrize("make, name", [
    (lambda: kd.kfac(1e-2, layers=LAYERS), "scale_by_kfac"),
    (lambda: kd.kfac(None, None, layers=LAYERS, grad_fn=GRAD_FN), "kd.kfac"),
    (lambda: kd.shampoo(1e-2, block_size=4), "scale_by_shampoo"),
    (lambda: kd.soap(1e-2, block_size=4), "scale_by_soap")])
def test_a_state_above_half_the_device_memory_warns(monkeypatch, make, name):
  """Where JAX reports the device's memory (GPU, TPU), a state above half of
  it warns at `init` with its size per device (`kd.describe`'s bytes) and
  what shrinks it, instead of the first step's out-of-memory error; below,
  and on the CPU (no report), `init` is quiet."""
  tx, params = make(), _params()
  state = tx.init(params)                  # K-FAC's (inside the adaptive one), or another
  need = states_lib.per_device_bytes((kd.find_states(state) or
                                      states_lib.find_states(state))[0])
  monkeypatch.setattr(_compat, "device_memory_limit", lambda: int(1.5 * need))
  with pytest.warns(UserWarning, match=rf"{name}: its state takes .* GiB per device, 67% "
                                       r"of the device's .*Spread it over the devices"):
    tx.init(params)
  monkeypatch.setattr(_compat, "device_memory_limit", lambda: 3 * need)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tx.init(params)


def test_second_order_dtype_float16_and_another_states_are_refused():
  """float16 cannot hold the second-order state (eigenvalues, 1/γ past
  65504): refused, pointing to bfloat16; a state stored in another dtype
  than the transform's (another configuration's) is named, not a
  conditional's dtype error."""
  with pytest.raises(ValueError, match="second_order_dtype=float16 cannot hold .*bfloat16"):
    kd.kfac(0.1, layers=LAYERS, second_order_dtype=jnp.float16)
  params, batch = _params(), _batch()
  state = kd.kfac(0.1, layers=LAYERS).init(params)
  _, grads, stats = GRAD_FN(params, *batch, opt_state=state)
  tx = kd.kfac(0.1, layers=LAYERS, second_order_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="stores its second-order state in float32, the "
                                       "transform in bfloat16"):
    tx.update(grads, state, params, kfac_stats=stats)


def test_full_statistics_of_diagonal_factors_warn():
  """Statistics formed without `opt_state=` are full `d × d` matrices even
  for a factor the state keeps diagonal (gigabytes for a vocabulary-sized
  head): `update` warns, naming the factor; with `opt_state=` it is quiet."""
  params, x_y = _params(), _batch()
  tx = kd.kfac(1e-2, layers=LAYERS, max_factor_dim=5)
  state = tx.init(params)
  _, grads, stats = GRAD_FN(params, *x_y)
  with pytest.warns(UserWarning, match=r"keeps diagonal: 'l0' A \(7×7\), 'l0' G \(8×8\), "
                                       r"'out' A \(8×8\)\. Pass opt_state= to grad_fn"):
    tx.update(grads, state, params, kfac_stats=stats)
  _, grads, stats = GRAD_FN(params, *x_y, opt_state=state)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tx.update(grads, state, params, kfac_stats=stats)
