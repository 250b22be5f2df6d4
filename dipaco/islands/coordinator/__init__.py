"""The coordinator: one writer of the task board, module versions and outer state (`service.Coordinator`,
`service.CoordinatorSettings`).

`heartbeats` (which islands are alive), `task_board` (tasks and path states: open, assign, lost, rebase,
cancel), `intake` and `acceptance` (results picked up and checked), `closing` and `outer_step` (a round's
outer step, then the commit), `pruning` (retention and validation-loss records), `metrics` (TensorBoard).
Never imported by the island.
"""
