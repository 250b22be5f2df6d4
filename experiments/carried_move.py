"""What a path's move costs: fresh AdamW moments against an old checkpoint, and the carried state's bytes per task.

    python experiments/carried_move.py                   # configs/tiny.yaml, 8 rounds, seeds 0-2 (~3 min on 1 CPU)
    python experiments/carried_move.py --seeds 0 --rounds 6

One island per path, in one process (the real coordinator and islands on a fake clock). Per seed, four runs:
`stays` (no path moves; a checkpoint every 3 tasks), `checkpoint` (path 0's island dies after round
rounds − 3 and a new island resumes path 0 from its last checkpoint, 2 tasks old), `fresh` (the same death
with no checkpoint to resume from: fresh moments), `every-task` (a checkpoint after every task, as a
check of the bytes). Reports path 0's validation loss at the end and the mean over paths (what the move
costs), and the carried state's upload bytes per task (`ResultMeta.bytes_up_inner`).
Writes experiments/results/carried-move.{json,md}.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.recording import EXPERIMENT_RESULTS, markdown_table, write_results  # noqa: E402

VARIANTS = {"stays": ["resilience.inner_checkpoint_every=3"], "checkpoint": ["resilience.inner_checkpoint_every=3"],
            "fresh": ["resilience.inner_checkpoint_every=0"], "every-task": ["resilience.inner_checkpoint_every=1"]}


def routed(root: Path):
    """configs/tiny.yaml routed and sharded at `root` (once)."""
    from dipaco.config import load_config
    from dipaco.run_dir import RunDir
    from dipaco.stages.route import route
    from dipaco.stages.shard import shard

    run = RunDir(root)
    config = load_config(ROOT / "configs" / "tiny.yaml", ["hardware.device=cpu"])
    route(config, run)
    shard(config, run)
    return run


def one_run(tiny, root: Path, overrides: list[str], *, dies_after: int | None) -> dict:
    """Train with one island per path; path 0's island stops for good after round `dies_after` (None: never)."""
    from dipaco.config import load_config, save_config
    from dipaco.islands.coordinator.service import Coordinator, CoordinatorSettings
    from dipaco.islands.island.polling import IslandWorker
    from dipaco.pipeline.context import PathFactory
    from dipaco.pipeline.version_zero import start_or_resume_store
    from dipaco.run_dir import RunDir
    from dipaco.stages.island import island_setup

    run = RunDir(root)
    for part in ("tokenizer", "routing", "shards"):
        shutil.copytree(tiny.root / part, run.root / part)
    config = load_config(ROOT / "configs" / "tiny.yaml", ["hardware.device=cpu", "store.keep_versions=0",
                                                          "resilience.heartbeat_timeout=5", *overrides])
    save_config(config, run.config)
    factory = PathFactory(config, run)
    start_or_resume_store(factory)
    setup = island_setup(config, run)
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    coordinator = Coordinator(setup.store, setup.topology, settings=CoordinatorSettings.from_config(config),
                              sizes=factory.path_sizes, clock=clock)
    n = setup.topology.n_paths
    islands = [IslandWorker(setup, name=f"i{p}", pinned=[p], clock=clock) for p in range(n)]
    for _ in range(4000):
        if coordinator.tick():
            break
        if dies_after is not None and coordinator.committed >= dies_after and islands[0].name == "i0":
            islands[0] = IslandWorker(setup, name="moved", pinned=[0], clock=clock)  # i0 never polls again
        for island in islands:
            island.poll()
        now[0] += 0.5
    inner, pseudo = uploads(setup.store, config.run.rounds)
    return {"val_loss": final_losses(setup, config.run.rounds), "bytes_up_inner": inner, "bytes_pseudo_gradient": pseudo}


def final_losses(setup, rounds: int) -> list[float]:
    """Each path's validation loss (every validation block of its shard) at the last version."""
    import torch

    from dipaco.eval.early_stopping import ValidationData

    data = ValidationData(reader=setup.reader, batch_size=8, max_batches=1_000_000, precision="fp32")
    losses = []
    for path in range(setup.topology.n_paths):
        modules = setup.store.read_modules(rounds, setup.topology.modules_of_path(path))
        model, _ = setup.models.load(modules, spec=setup.spec, device=torch.device("cpu"), compile=False, wrap=None)
        losses.append(data.loss(model, path=path))
    return losses


def uploads(store, rounds: int) -> tuple[list[int], list[int]]:
    """(`bytes_up_inner`, the pseudo-gradient's bytes) of every applied result."""
    from dipaco.store.board import read_manifest, read_result_meta

    metas = [read_result_meta(store, round=r, path=e.path, attempt=e.attempt)
             for r in range(1, rounds + 1) for e in read_manifest(store, r).applied]
    return [m.bytes_up_inner for m in metas], [m.bytes for m in metas]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    started = time.time()
    rows, results = [], {"rounds": args.rounds, "seeds": args.seeds, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = routed(Path(tmp) / "tiny")
        for seed in args.seeds:
            for name, overrides in VARIANTS.items():
                dies = args.rounds - 3 if name in ("checkpoint", "fresh") else None
                out = one_run(tiny, Path(tmp) / f"{name}-{seed}", [f"run.seed={seed}", f"run.rounds={args.rounds}",
                                                                    *overrides], dies_after=dies)
                results["runs"][f"{name}-seed{seed}"] = out
    for name in VARIANTS:
        runs = [results["runs"][f"{name}-seed{s}"] for s in args.seeds]
        path0 = statistics.mean(r["val_loss"][0] for r in runs)
        every = statistics.mean(statistics.mean(r["val_loss"]) for r in runs)
        per_task = statistics.mean(statistics.mean(r["bytes_up_inner"]) for r in runs)
        pseudo = statistics.mean(statistics.mean(r["bytes_pseudo_gradient"]) for r in runs)
        rows.append([name, " / ".join(f"{r['val_loss'][0]:.4f}" for r in runs), f"{path0:.4f}", f"{every:.4f}",
                     f"{per_task:,.0f}", f"{pseudo:,.0f}"])
        results[name] = {"path0_val_loss": path0, "mean_val_loss": every, "bytes_up_inner_per_task": per_task,
                         "bytes_pseudo_gradient_per_task": pseudo}
    results["wall_seconds"] = round(time.time() - started, 1)
    table = markdown_table(["variant", "path 0 val loss per seed", "path 0 val loss", "mean val loss (all paths)",
                            "carried-state bytes up per task", "pseudo-gradient bytes per task"], rows)
    markdown = (f"# What a path's move costs (configs/tiny.yaml, {args.rounds} rounds, seeds {args.seeds})\n\n"
                f"Path 0's island dies after round {args.rounds - 3}; `checkpoint` resumes it from a checkpoint "
                f"2 tasks old, `fresh` from fresh moments. Wall time {results['wall_seconds']} s.\n\n{table}\n")
    write_results("carried-move", results, markdown, results_dir=EXPERIMENT_RESULTS)
    print(markdown)


if __name__ == "__main__":
    main()
