"""The island: `training` (one task's inner steps and its upload) apart from `polling` (`IslandWorker`,
asking the board for work), `presence` (its heartbeat), `cancellation` (a task the board no longer
wants), `faults` (injected failures), `checkpoint` (its inner checkpoint), `model_slot` (the path model
tasks reuse), `ddp` (data parallelism inside it), `elastic` (workers that drop out and heal from a peer:
torchft) with `elastic_island`, `elastic_state` and `elastic_messages` (an island of several such workers),
`pinned` (one path once), `timing`. It talks only to
the store and never imports the coordinator.
"""
