"""One worker of an elastic island, for tests/test_elastic.py: trains the given tasks with its island's quorum.

    python tests/elastic_worker.py RUN_ROOT NAME OUT TASK.json [TASK.json ...] [--wait FILE]

Joins the lighthouse TORCHFT_LIGHTHOUSE names as worker NAME (after FILE exists, with --wait: the test starts a
returning worker ahead, its imports done), trains each task with `train_task(..., ctx=elastic.join(...))`,
appends every step it commits to OUT/NAME.steps.jsonl as it commits it (a killed worker's steps stay there)
and saves each task's pseudo-gradient to OUT/NAME.<task key>.safetensors.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from dipaco.config import load_config
from dipaco.islands.island import elastic
from dipaco.islands.island.training import train_task
from dipaco.run_dir import RunDir
from dipaco.stages.island import island_setup
from dipaco.store.records import Task


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("name")
    parser.add_argument("out", type=Path)
    parser.add_argument("tasks", type=Path, nargs="+")
    parser.add_argument("--wait", type=Path)
    args = parser.parse_args()
    run = RunDir(args.root)
    config = load_config(run.config)
    setup = island_setup(config, run)
    tasks = [Task.from_json(json.loads(p.read_text()), file=str(p)) for p in args.tasks]
    while args.wait is not None and not args.wait.exists():
        time.sleep(0.05)
    ctx = elastic.join(args.name, torch.device("cpu"), timeout=30.0)
    log = (args.out / f"{args.name}.steps.jsonl").open("a")

    def committed(record: elastic.StepRecord) -> None:
        log.write(json.dumps(record.to_json()) + "\n")
        log.flush()
        os.fsync(log.fileno())

    ctx.on_commit = committed
    for task in tasks:
        out = train_task(setup, task, ctx=ctx)
        save_file(out.pseudo_gradient, str(args.out / f"{args.name}.{task.key}.safetensors"))
    ctx.shutdown()


if __name__ == "__main__":
    main()
