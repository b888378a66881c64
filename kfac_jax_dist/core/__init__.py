"""Stage 2, the core shared by K-FAC and Shampoo.

Settings and time: `cadence` (intervals and schedules), `faults` (the one
fault policy), `states` (what every preconditioner state offers).
Distribution: `distribution` (`kd.Distribution`), `collectives` (every
communication over the data axis), `uneven` (padding-free collectives of
uneven segments), `owners` (which device owns which work), `routing`
(gradients to and from owner groups), `placement` (state and update checks),
`specs` (`kd.partition_specs`, `kd.shard_state`), `tensor_parallel` (a model
axis). `linalg` holds the decompositions both use.
"""
