"""Logging of adaptive K-FAC (`--adaptive`), shared by the examples.

Import it after `_host_devices` (it imports jax through kfac_jax_dist).
"""

import kfac_jax_dist as kd
from kfac_jax_dist.kfac.adaptive import ADAPTED  # the CSV columns, in this order

__all__ = ["ADAPTED", "adapted_values", "summary"]


def adapted_values(opt_state) -> dict[str, float]:
  """The adapted learning rate η = −α (the update is αΔ + μv with Δ K-FAC's
  preconditioned gradient), μ, λ and the last reduction ratio ρ."""
  return {k: float(v) for k, v in kd.adapted_values(opt_state).items()}


def summary(name: str, adapted: dict[str, list[float]]) -> str:
  """One line on a run's adapted values: the last ones, and the ranges of η
  and λ over the run (the first entry, before any step, left out)."""
  eta, lam = adapted["learning_rate"], adapted["damping"]
  return (f"\n{name}, at the last evaluation: learning rate η = −α = {eta[-1]:.3g}, "
          f"μ = {adapted['momentum'][-1]:.3g}, λ = {lam[-1]:.3g}, "
          f"ρ = {adapted['rho'][-1]:.3g} (η over the run {min(eta[1:]):.3g} .. "
          f"{max(eta[1:]):.3g}, λ {min(lam[1:]):.3g} .. {max(lam[1:]):.3g})")
