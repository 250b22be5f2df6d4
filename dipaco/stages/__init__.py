"""One file per `dipaco <command>`: route, shard, pretrain, train, island, baselines, evaluate, reroute,
export, generate, report. A stage unpacks the config once (`context.PathFactory`) and calls the
layers below it; stages do not import each other (shared inputs live in `documents` and `context`; what
each stage's artifacts were made from, and the drift check, in `fingerprints`).
"""
