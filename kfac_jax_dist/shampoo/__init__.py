"""Stage 4, Shampoo: blocked Kronecker statistics and inverse roots.

`config` (the settings), `blocks` (merging, blocking, the block math and the
layout of statistics), `state`, `roots` (inverse p-th roots), `grafting`,
`step` (one step's statistics, roots and directions on the owner groups: one
device and COMM-OPT are one group) and `transform` (the
optax transforms `scale_by_shampoo` and `shampoo`); `soap` (Adam in Shampoo's
eigenbasis, on the same blocks, statistics and placement).
"""
