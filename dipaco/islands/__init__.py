"""Training across islands: the `coordinator` (task board, round closing), the `island` (pulls a task,
runs inner steps, pushes a pseudo-gradient), the round policy (`rounds`: sync / async, staleness),
`ddp` inside an island, injected `faults`, and the local process pool (`processes`).

May import `dipaco.eval`, `dipaco.optim`, `dipaco.model`, `dipaco.store` and `dipaco.config`; never a stage.
"""
