"""Scoring and routed evaluation: the one scorer (`scoring`), routing a document by its prefix
(`prefix_routing`), the eval modes (`modes`: prefix, every:W, likelihood, oracle, oracle-split, all-paths) and per-path early
stopping (`early_stopping`).

May import `dipaco.optim`, `dipaco.model`, `dipaco.store` and `dipaco.config`; never a stage or an island.
"""
