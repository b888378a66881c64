"""Stage 3, K-FAC: from statistics to preconditioned gradients.

`config` (the settings), `layout` and `packing` (where every factor lives),
`state` (the optimizer state and its readers), `factors` (running factors),
`decompositions` and `linalg` (eigenbases, damped inverses, the
preconditioned gradient), `stale` / `stale_update` (SP-NGD's stale
statistics), `precondition` (owner groups, KL clip) and `transform` (the
optax transforms `scale_by_kfac` and `kfac`, which run those stages in order).
"""
