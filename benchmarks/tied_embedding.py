"""Tied input and output embeddings: K-FAC with the tied table preconditioned or left out.

A character LM whose output projection is its token embedding (`Embed.attend`,
as GPT-2's head): `kd.linen.Embed` for tokens and positions, one pre-LN
Transformer block (`_models.TransformerBlock`: 4-head causal attention, MLP
d → 4d → d), a final LayerNorm, the head tied to the token table; d = 64,
context 64, batch 32 sequences; examples/transformer_lm.py's corpus (the pydoc
topics of this Python: the first 90% for training, windows of the last 10% for
validation).

The table's gradient is the lookup's plus the head's. `attend` is untagged, so
K-FAC preconditions the whole table by the lookup's factors (a diagonal of
token counts ⊗ the lookup's output gradients), which describe only the first
part. Arms, from the same initial parameters on the same batches:

* K-FAC, the table preconditioned by the lookup's factors (the library's
  behaviour);
* K-FAC, the table left out (`skip=`: its gradient passes through, scaled by
  the learning rate);
* K-FAC on the untied model (the head a separate `kd.linen.Dense`, its own
  factors; more parameters), for reference;
* AdamW (weight decay 0), the first-order baseline (tied model).

K-FAC: `kd.kfac`, momentum 0.9, damping 1e-2, KL clip 1e-2, factors every step,
eigendecompositions every 10 steps. Each arm runs each learning rate of its grid
for every seed (initial parameters and batch order); reported: the validation
loss (nats per character) at the end, the median over the seeds, per
learning rate; the check compares the arms at their best learning rates.
"""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax_dist as kd

import _common
import _models
from _report import (add_quick, argument_parser, checks_markdown, environment,
                     fill_defaults, header_md, md_table, stem, write_results)

NAME = "tied_embedding"
QUICK = dict(steps=10, seeds=1, kfac_lrs=[0.03], adam_lrs=[1e-2])
FULL = dict(steps=300, seeds=3, kfac_lrs=[3e-3, 1e-2, 3e-2], adam_lrs=[3e-3, 1e-2, 3e-2])
WIDTH, CONTEXT, BATCH = 64, 64, 32


class TiedCharLM(nn.Module):
  """Token + position embeddings, one Transformer block, LayerNorm, and the
  token table as the head (`attend`), or a separate Dense head (`tied=False`)."""

  vocab: int
  tied: bool = True

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    table = kd.linen.Embed(self.vocab, WIDTH, name="embed")
    positions = jnp.arange(tokens.shape[1]) + 0 * tokens
    x = table(tokens) + kd.linen.Embed(CONTEXT, WIDTH, name="pos")(positions)
    x = _models.TransformerBlock(4, name="block")(x)
    x = kd.linen.LayerNorm(name="ln_f")(x)
    return table.attend(x) if self.tied else kd.linen.Dense(self.vocab, name="head")(x)


def _task():
  text = _common.pydoc_corpus()
  chars = sorted(set(text))
  ids = _common.encode(text, chars)
  split = int(0.9 * len(ids))
  train, val = ids[:split], ids[split:]
  starts = np.linspace(0, len(val) - CONTEXT - 2, 128).astype(np.int64)
  offs = starts[:, None] + np.arange(CONTEXT)
  return len(chars), train, (jnp.asarray(val[offs]), jnp.asarray(val[offs + 1]))


def _run(arm: str, lr: float, seed: int, steps: int, vocab: int, train, val) -> float:
  """The validation loss after `steps` steps of one arm."""
  model = TiedCharLM(vocab, tied=arm != "kfac_untied")
  params = model.init(jax.random.PRNGKey(seed), val[0][:1])
  loss_fn = lambda p, x, y: kd.losses.softmax_cross_entropy(model.apply(p, x), y)
  windows = jnp.asarray(_common.windows(train, steps, BATCH, CONTEXT + 1,
                                        np.random.default_rng(1000 + seed)))
  if arm == "adamw":
    tx = optax.adamw(lr, weight_decay=0.0)
    state = tx.init(params)

    def step(p, s, x, y):
      loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
      updates, s = tx.update(grads, s, p)
      return optax.apply_updates(p, updates), s, loss
  else:
    grad_fn = kd.value_and_grad(loss_fn)
    tx = kd.kfac(lr, momentum=0.9, damping=1e-2, kl_clip=1e-2, inverse_update_every=10,
                 layers=grad_fn.discover(params, windows[0, :, :-1], windows[0, :, 1:]),
                 skip=[r"^params/embed$"] if arm == "kfac_table_left_out" else ())
    state = tx.init(params)

    def step(p, s, x, y):
      loss, grads, stats = grad_fn(p, x, y, opt_state=s)
      updates, s = tx.update(grads, s, p, kfac_stats=stats)
      return optax.apply_updates(p, updates), s, loss
  step = jax.jit(step, donate_argnums=(0, 1))
  for w in windows:
    params, state, _ = step(params, state, w[:, :-1], w[:, 1:])
  return float(jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      model.apply(params, val[0]), val[1])))


ARMS = {"kfac_lookup_factors": ("K-FAC, tied table preconditioned by the lookup's "
                                "factors (the library)", "kfac_lrs"),
        "kfac_table_left_out": ("K-FAC, tied table left out (`skip=`)", "kfac_lrs"),
        "kfac_untied": ("K-FAC, untied head (reference)", "kfac_lrs"),
        "adamw": ("AdamW, tied", "adam_lrs")}


def main() -> None:
  ap = argument_parser(__doc__)
  ap.add_argument("--steps", type=int)
  ap.add_argument("--seeds", type=int)
  ap.add_argument("--kfac-lrs", type=float, nargs="+")
  ap.add_argument("--adam-lrs", type=float, nargs="+")
  add_quick(ap, NAME, QUICK)
  args = ap.parse_args()
  fill_defaults(args, QUICK, FULL)
  vocab, train, val = _task()
  start, results, env = time.time(), {}, environment()
  for arm, (_, grid) in ARMS.items():
    for lr in getattr(args, grid):
      losses = [_run(arm, lr, seed, args.steps, vocab, train, val)
                for seed in range(args.seeds)]
      results[f"{arm} {lr:g}"] = dict(arm=arm, label=ARMS[arm][0], lr=lr, losses=losses,
                                      median=float(np.median(losses)))
      print(f"{arm} lr {lr:g}: {losses}", flush=True)
  best = {arm: min((r for r in results.values() if r["arm"] == arm),
                   key=lambda r: r["median"]) for arm in ARMS}
  rows = [[ARMS[r["arm"]][0], f"{r['lr']:g}", " ".join(f"{l:.3f}" for l in r["losses"]),
           f"{r['median']:.3f}" + (" (best)" if r is best[r["arm"]] else "")]
          for r in results.values()]
  left, lookup = best["kfac_table_left_out"], best["kfac_lookup_factors"]
  checks = [dict(
      check="K-FAC with the tied table preconditioned by the lookup's factors (the "
            "library) reaches a lower validation loss than with the table left out "
            "(each at its best lr)",
      value=f"{lookup['median']:.3f} against {left['median']:.3f}",
      target="lower", holds=lookup["median"] < left["median"],
      why=f"untied K-FAC's best: {best['kfac_untied']['median']:.3f}; AdamW's best: "
          f"{best['adamw']['median']:.3f} (lr {best['adamw']['lr']:g})")]
  lines = [f"# {__doc__.splitlines()[0]}", "", header_md(env),
           f"- {args.steps} steps, seeds 0..{args.seeds - 1}, vocabulary {vocab}; "
           f"{time.time() - start:.0f} s", f"- generated by `python benchmarks/{NAME}.py`",
           "", md_table(rows, ["arm", "lr", "validation loss per seed", "median"]), "",
           *checks_markdown("Check", checks)]
  text = "\n".join(lines)
  print(text)
  write_results(args.out, stem(NAME, args.quick), text,
                dict(environment=env, args=vars(args), results=results, checks=checks))


if __name__ == "__main__":
  main()
