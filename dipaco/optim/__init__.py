"""The two optimisers, written out plainly: `inner` (AdamW steps on one path, its LR schedule and state)
and `outer` (per module: weighted average of pseudo-gradients, then Nesterov SGD).

Imports `dipaco.config` and `dipaco.device` only.
"""
