"""A path's carried state: what its tasks hand on to each other besides the modules (moments, residual, drift)."""
