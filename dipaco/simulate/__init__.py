"""`dipaco simulate`: a discrete-event chaos simulator of training at paper scale (no torch, no files).

Learners of many chips fail chip by chip (`failures`), stop or shrink (`learner`), and train under
four strategies side by side: non-elastic and elastic data parallel (`data_parallel`), sync and async
DiLoCo rounds (`rounds`), the latter decided by the real round policy (`policy_port`). `ledger` keeps
goodput (docs/islands.md#goodput), `bandwidth` the bytes each strategy moves, `scenario` runs them.

May import `dipaco.islands` (the round policy), `dipaco.model.topology` and `dipaco.config`; the stage
`dipaco.stages.simulate` writes its tables and plots.
"""
