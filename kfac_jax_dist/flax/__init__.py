"""Stage 6, Flax wrappers: drop-in `linen` and `nnx` layers that call the
capture's tags (`common` holds what both share), and `intercept`, which runs
unmodified Flax layers through the same tagged computations
(`kd.value_and_grad(loss_fn, capture="flax")`)."""
