"""Stage 1, capture: what the model tells the optimizer.

`tags` (plain-JAX tag functions, the layers' forward rules) and `registry`
(the tagged layers) describe the layers; `statistics` holds the formulas of
the curvature statistics `A`, `G` and `F`; `stacking` handles scanned /
vmapped blocks; `losses` registers the loss; `value_and_grad` runs the model
once and returns the loss, the gradients and the statistics; `curvature`
gives the exact Gauss-Newton products of the registered loss
(`ValueAndGrad.gauss_newton_gram`, `.loss`); `batches` slices a batch into
micro-batches (for `accumulate` and the curvature products); `context` is
the trace state the tags and losses read.
"""
