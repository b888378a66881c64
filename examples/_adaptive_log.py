"""Adaptive K-FAC in the examples (`--adaptive`): its options and its logging.

`--adaptive` also trains adaptive K-FAC, which needs no tuning:
`kd.kfac(None, None, grad_fn=grad_fn, adapt_damping=True)` with the library's
defaults (factors every step, eigendecompositions every 10, no KL clip) picks each
step's learning rate η = −α and momentum μ from the exact quadratic model on
the batch and adapts the damping λ (Levenberg-Marquardt, every 5 steps) from
`--adaptive-damping` (λ₀) within `--adaptive-min-damping` (both default to the
library's: 0.1 and 1e-3; at kfac-jax's floor, 1e-8, λ collapses on these
small batches, which the model fits, and training diverges). η, μ, λ and the
reduction ratio ρ are printed and written to each example's CSV.
`--skip-fixed-kfac` leaves the fixed-hyperparameter K-FAC out.

Import it after `_host_devices` (it imports jax through kfac_jax_dist).
"""

import argparse
import inspect

import kfac_jax_dist as kd
from kfac_jax_dist.kfac import optimizer as kfac_optimizer
from kfac_jax_dist.kfac.adaptive import ADAPTED  # the CSV columns, in this order

__all__ = ["ADAPTED", "add_arguments", "adapted_values", "record", "summary"]


def add_arguments(group: argparse._ArgumentGroup) -> None:
  """`--adaptive`, `--adaptive-damping`, `--adaptive-min-damping` and
  `--skip-fixed-kfac`, their defaults the library's."""
  group.add_argument("--adaptive", action="store_true",
                     help="also train adaptive K-FAC (learning rate and momentum from the "
                          "quadratic model, λ by Levenberg-Marquardt; the library's other "
                          "defaults)")
  group.add_argument("--adaptive-damping", type=float,
                     default=kfac_optimizer.ADAPTIVE_DAMPING,
                     help="adaptive K-FAC's initial damping λ₀ (the library's default)")
  group.add_argument("--adaptive-min-damping", type=float,
                     default=inspect.signature(kd.kfac).parameters["min_damping"].default,
                     help="adaptive K-FAC's floor for λ (the library's default; kfac-jax's "
                          "1e-8 lets λ collapse and training diverge on these tasks)")
  group.add_argument("--skip-fixed-kfac", action="store_true",
                     help="leave out the fixed-hyperparameter K-FAC (e.g. with --adaptive)")


def adapted_values(opt_state) -> dict[str, float]:
  """The adapted learning rate η = −α (the update is αΔ + μv with Δ K-FAC's
  preconditioned gradient), μ, λ and the last reduction ratio ρ."""
  return {k: float(v) for k, v in kd.adapted_values(opt_state).items()}


def record(opt_state, adapted: dict[str, list[float]], shown: dict[str, str]) -> None:
  """Appends this evaluation's η, μ, λ, ρ to `adapted` and shows η, μ, λ in
  the progress bar's `shown`."""
  values = adapted_values(opt_state)
  for k in ADAPTED:
    adapted[k].append(values[k])
  shown.update(lr=f"{values['learning_rate']:.3g}", μ=f"{values['momentum']:.2f}",
               λ=f"{values['damping']:.2g}")


def summary(name: str, adapted: dict[str, list[float]]) -> str:
  """One line on a run's adapted values: the last ones, and the ranges of η
  and λ over the run (the first entry, before any step, left out)."""
  eta, lam = adapted["learning_rate"], adapted["damping"]
  return (f"\n{name}, at the last evaluation: learning rate η = −α = {eta[-1]:.3g}, "
          f"μ = {adapted['momentum'][-1]:.3g}, λ = {lam[-1]:.3g}, "
          f"ρ = {adapted['rho'][-1]:.3g} (η over the run {min(eta[1:]):.3g} .. "
          f"{max(eta[1:]):.3g}, λ {min(lam[1:]):.3g} .. {max(lam[1:]):.3g})")
