"""The round policy, pure: no torch, no store, no wall clock (the caller passes the time in).

`policy.RoundPolicy` is the one object the coordinator (`dipaco.islands.coordinator`) and the chaos
simulator (`dipaco.simulate`) drive: events in (`inputs`), decisions out (`plan`). Its concerns sit in
one file each: `staleness` (a result's weight by its age), `quorum` (async: the quorum and grace
window), `tasks` (which paths get tasks, rebasing, cancelling, lost tasks, assignment), `length` (the
run's length in applied results), `moves` (async: a straggler's path moves to a faster island). The rules are in docs/islands.md.

Imports `dipaco.config` only.
"""
