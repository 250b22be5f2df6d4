"""A path's carried state: what its tasks hand on to each other besides the modules (moments, residual, drift).

`state` is the one typed object (its file, its checks, when it is uploaded); `validate` is the one validator
of such a state as read from the store (an island wrote it, so it is untrusted input): its names and shapes,
AdamW's moments, the error-feedback residual and the fragments' drift.
"""
