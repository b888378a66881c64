"""Stage 3, K-FAC: from statistics to preconditioned gradients.

`config` (the settings), `layout` and `packing` (where every factor lives),
`state` (the optimizer state and its readers), `factors` (running factors),
`decompositions` and `linalg` (eigenbases, damped inverses, the
preconditioned gradient), `stale` / `stale_update` (SP-NGD's stale
statistics), `precondition` (owner groups, KL clip), `transform`
(`scale_by_kfac`, which runs those stages in order), `adaptive` (the exact
quadratic model's learning rate, momentum and damping), `optimizer`
(`kd.kfac`: K-FAC with SGD after it, or adaptive) and `cost` (the bytes and
memory of a strategy; `kd.Distribution.auto`).
"""
