"""Training across islands: the `coordinator` package (task board, round closing, retention, the service
loop) and the `island` package (the training loop, polling, heartbeat, fault injection), which import
neither the other; `processes` (local island processes), `elastic_group` (an elastic island's lighthouse
and worker processes) and `launch_ray` (islands as Ray tasks).

The round policy they follow is `dipaco.rounds`. May import `dipaco.rounds`, `dipaco.eval`, `dipaco.optim`,
`dipaco.model`, `dipaco.store` and `dipaco.config`; never a stage.
"""
