"""Owner-group routing (`core.routing`): HYBRID's gather from the groups goes
among the devices of equal rank (KAISA's receivers), typed invariant, with the
bytes of the formula `(G−1)·S` in the compiled HLO, on 8 CPU devices."""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import kfac_jax_dist as kd

import helpers
from kfac_jax_dist import _compat
from kfac_jax_dist.core import collectives
from kfac_jax_dist.core import routing
from kfac_jax_dist.kfac import layout as layout_lib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "benchmarks"))
import _common as C  # noqa: E402  pylint: disable=wrong-import-position

F32 = 4


def _all_gathers(hlo: str) -> list:
  return [c for c in C.collectives(hlo, 8)[0] if c.kind == "all-gather"]


@pytest.mark.parametrize("m", [2, 4])
def test_gather_from_groups_among_equal_ranks(m):
  """Each group's buffer (made on its devices) reaches every device, out of
  `shard_map` with spec P() (typed invariant), by one all_gather in groups of
  `G = P/m` devices of equal rank: `(G−1)·S` per device, where gathering
  pieces of `S/m` over the whole axis sent `(P−1)·S/m`."""
  mesh = helpers.data_mesh(8)
  comm = collectives.Collectives(kd.Distribution(mesh, grad_worker_fraction=m / 8))
  groups = 8 // m
  sizes = [5, 7, 3, 6][:groups]
  width = routing.group_width(sizes, m)

  def make(g: int) -> jax.Array:
    return jnp.arange(sizes[g], dtype=jnp.float32) + 100.0 * g

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(), out_specs=P())
  def run():
    return jnp.stack(routing.gather_from_groups(comm, make, sizes, jnp.float32))

  got = np.asarray(jax.jit(run)())
  for g, size in enumerate(sizes):
    np.testing.assert_array_equal(got[g, :size], np.arange(size) + 100.0 * g)
    np.testing.assert_array_equal(got[g, size:], 0)
  (gather,) = _all_gathers(jax.jit(run).lower().compile().as_text())
  assert gather.group == groups
  assert gather.ring == (groups - 1) * width * F32
  old = (8 - 1) * width / m * F32        # pieces of S/m over the whole axis
  assert old / gather.ring == pytest.approx((8 - 1) / (8 - m))    # 1.75 at m = 4


def _hybrid_step_hlo(m: int):
  """The compiled HLO and the state of the benchmarks' training step
  (`_common.sharded_step`: gradients averaged by pmean) with HYBRID K-FAC."""
  loss_fn, params, x, y = helpers.conv_dense_problem()
  mesh = helpers.data_mesh(8)
  grad_fn = kd.value_and_grad(loss_fn)
  tx = kd.kfac(0.1, layers=grad_fn.discover(params, x, y), damping=1e-2,
               distribution=kd.Distribution(mesh, grad_worker_fraction=m / 8),
               factor_update_every=2, inverse_update_every=3)
  fn, state = C.sharded_step(loss_fn, params, x, y, tx, grad_fn, mesh, "none")
  return fn.lower(params, state, x, y).compile().as_text(), state


@pytest.mark.parametrize("m", [2, 4])
def test_hybrid_gather_bytes_are_kaisas(m):
  """The compiled K-FAC step of HYBRID (`m` gradient workers per layer, `G =
  8/m` groups) gathers the preconditioned gradients every step in one
  all_gather of the groups' buffers among `G` devices: `(G−1)·S` numbers
  per device (`S` the buffer of `layout.gradient_offsets`), KAISA's
  receivers' bytes; the other every-step collective is the gradients' pmean."""
  hlo, state = _hybrid_step_hlo(m)
  lay = C.kfac_state(state).layout
  groups, (_, _, width) = 8 // m, layout_lib.gradient_offsets(lay)
  every = [c for c in C.collectives(hlo, 8)[0] if c.step == "every"]
  gathers = [c for c in every if c.kind == "all-gather"]
  assert [(c.group, c.ring) for c in gathers] == [(groups, (groups - 1) * width * F32)]
  assert {c.kind for c in every} == {"all-gather", "all-reduce"}


def test_equal_over_is_a_typed_identity():
  """`_compat.equal_over` drops the axis from the varying axes, moves no data,
  and differentiates as the pmean of equal copies."""
  mesh = helpers.data_mesh(8)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(), out_specs=P())
  def run(c):
    x = _compat.as_varying(c * 2.0, ("data",))
    assert _compat.varying_axes(x) == ("data",)
    y = _compat.equal_over(x, ("data",))
    assert _compat.varying_axes(y) == ()
    return y

  c = jnp.arange(3.0)
  np.testing.assert_array_equal(jax.jit(run)(c), 2 * c)
  assert not _all_gathers(jax.jit(run).lower(c).compile().as_text())
  np.testing.assert_allclose(jax.grad(lambda c: run(c).sum())(c), 2.0)
