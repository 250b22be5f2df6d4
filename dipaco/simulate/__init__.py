"""`dipaco simulate`: a discrete-event chaos simulator of training at paper scale (no torch, no files).

    dipaco simulate --run runs/sim simulate.learners=16

Learners of many chips fail chip by chip (`failures`, `learner`) on a virtual clock (`clock`) and train
under four strategies side by side: non-elastic and elastic data parallel (`data_parallel`), sync and
async DiLoCo rounds (`diloco`), the latter decided by the real round policy (`dipaco.rounds`) through the
coordinator's bookkeeping (`syncer`). `ledger` keeps goodput, `settings` what one simulation runs,
`scenario` runs the strategies and the sweep. Beside `dipaco.islands`, never importing it.
"""
