"""The two optimisers, written out plainly: `inner` (AdamW steps on one path, its LR schedule and state) and
`outer` (per module: weighted average of pseudo-gradients, then Nesterov SGD, or a plain average in the
inner lr's decay), with `weighting` (each path's weight in the outer step).

Beside them, still here until they find their own homes: the math of the state a path carries besides its
moments (`error_feedback`'s residual, `drift`; the carried state itself is `dipaco.carried`'s), the dense
trainer (`dense`), the batch prefetcher (`prefetch`) and the outer steps as applied (`outer_history`). How
uploads are encoded, error feedback's math included, is `dipaco.codec`'s; optim imports neither the codec
nor (except `outer_history`, listed in pyproject.toml's contract) the store.
"""
