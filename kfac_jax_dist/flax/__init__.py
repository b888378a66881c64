"""Stage 6, Flax wrappers: drop-in `linen` and `nnx` layers that call the
capture's tags (`common` holds what both share)."""
