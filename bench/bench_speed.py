"""Speed benchmark: an island's inner loop against a plain PyTorch loop on the same model and batches.

    python bench/bench_speed.py                     # demo model, 3 repeats x 25 steps, 1 thread (~3 min on 2 cores)
    python bench/bench_speed.py --repeats 5 --steps 50 --documents 6000 --threads 2
    python bench/bench_speed.py --device cuda       # the same on a GPU (bf16 where it supports it)

What runs, in one process with a fixed torch thread count (`--threads`):
- a small run built in a temporary directory from configs/demo.yaml (`corpus.max_documents` =
  `--documents`): `route`, `shard` and module version 0 in the store, exactly as `dipaco run` does;
- the **island**: `train_task` + `push_result` of a real task (path 0, from version 0, continuing the
  data order and the LR schedule of a first task, its AdamW state restored from the store, validation
  batches scored, pseudo-gradient computed, inner state and result written), each phase timed
  (`dipaco.islands.island.PHASES`);
- the **plain loop**: the same Hugging Face model, batch, sequence, AdamW (same betas, weight decay
  and gradient clipping), precision and number of steps, on the batches the island's task trains on,
  already on the device, one `loss.item()` at the end.

The two alternate (island first in even repeats, plain first in odd ones) after one untimed warm-up of
each, and every ratio is taken between the two runs of one repeat, then the median over repeats. The
inner-loop ratio (`train_steps` of the island against the plain loop) is the issue's check (>= 0.95);
the task ratio counts everything an island does per task. `--set section.key=value` changes the
island's config (e.g. `--set train.compile=true`). Writes bench/results/speed.json and speed.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.recording import write_results  # noqa: E402
from dipaco.config import Config, load_config  # noqa: E402
from dipaco.device import autocast, resolve_device  # noqa: E402
from dipaco.islands.island import PHASES, IslandSetup, data_seed, push_result, train_task  # noqa: E402
from dipaco.run_dir import RunDir  # noqa: E402
from dipaco.stages.context import PathFactory  # noqa: E402
from dipaco.stages.island import island_setup  # noqa: E402
from dipaco.stages.route import route  # noqa: E402
from dipaco.stages.shard import shard  # noqa: E402
from dipaco.stages.train import initialise_store  # noqa: E402
from dipaco.store.board import inner_ref  # noqa: E402
from dipaco.store.records import Task  # noqa: E402
from dipaco.tables import format_table  # noqa: E402

log = logging.getLogger("bench_speed")
DEMO = ROOT / "configs" / "demo.yaml"
PATH = 0


def default_precision(device: torch.device) -> str:
    """What `precision: auto` picks: bf16 on a GPU that computes it natively, fp32 on this kind of CPU."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def build_run(root: Path, overrides: list[str]) -> tuple[Config, RunDir]:
    """Route and shard the demo corpus (cut to `corpus.max_documents`) and write module version 0
    (the routing and shards of an earlier run in `root` are kept)."""
    config = load_config(DEMO, overrides)
    run = RunDir(root)
    started = time.perf_counter()
    if not (run.shards / "index.json").exists():
        route(config, run)
        shard(config, run)
    initialise_store(PathFactory(config, run))
    log.info("run built in %.1fs in %s", time.perf_counter() - started, root)
    return config, run


def island_task(setup: IslandSetup, task: Task) -> dict:
    """One task as an island runs it (train, then upload); seconds per phase and in all."""
    timings: dict[str, float] = {}
    wall, cpu = time.perf_counter(), time.process_time()
    out = train_task(setup, task, timings=timings)
    push_result(setup, task, out, island="bench", timings=timings)
    return {"task_s": time.perf_counter() - wall, "task_cpu_s": time.process_time() - cpu, "phases_s": timings,
            "tokens": out.meta.tokens, "train_loss": out.meta.train_loss}


def plain_batches(setup: IslandSetup, steps: int, device: torch.device) -> list[torch.Tensor]:
    """The `steps` batches `(B, T)` the timed island tasks train on, already on the device."""
    batches = setup.reader.iter_batches(PATH, "train", batch_size=setup.inner.batch_size,
                                        seed=data_seed(setup.train.seed, path=PATH), skip_batches=steps)
    return [torch.as_tensor(next(batches), dtype=torch.long).to(device) for _ in range(steps)]


def plain_loop(setup: IslandSetup, batches: list[torch.Tensor], device: torch.device) -> dict:
    """The reference: a fresh model and `torch.optim.AdamW`, `len(batches)` steps, nothing else."""
    inner, precision = setup.inner, setup.train.precision
    model = setup.spec.new_model(seed=1).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=inner.lr, betas=(inner.beta1, inner.beta2),
                                  weight_decay=inner.weight_decay)
    model.train()
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    for input_ids in batches:
        with autocast(device, precision):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), inner.grad_clip)
        optimizer.step()
    final = loss.item()
    return {"seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu,
            "tokens": sum(b.numel() for b in batches), "final_loss": final}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(setup: IslandSetup, *, repeats: int) -> dict:
    """Warm up, then `repeats` interleaved (island task, plain loop) pairs; per-repeat figures and medians."""
    device = resolve_device(setup.train.device)
    steps = setup.inner.steps
    first = Task.open(path=PATH, base=0, step_offset=0, inner_from=None)
    warm = island_task(setup, first)  # also leaves the inner state the timed tasks restore
    log.info("warm-up task: %.2fs", warm["task_s"])
    inner_from = inner_ref(path=PATH, round=first.round, attempt=first.attempt)
    batches = plain_batches(setup, steps, device)
    plain_loop(setup, batches, device)  # warm-up
    rows = []
    for r in range(repeats):
        task = dataclasses.replace(Task.open(path=PATH, base=0, step_offset=steps, inner_from=inner_from),
                                   attempt=r + 1)
        load = os.getloadavg()[0]
        if r % 2 == 0:
            island, plain = island_task(setup, task), plain_loop(setup, batches, device)
        else:
            plain, island = plain_loop(setup, batches, device), island_task(setup, task)
        tokens = island["tokens"]
        assert tokens == plain["tokens"], (tokens, plain["tokens"])
        phases = island["phases_s"]
        inner_s, inner_cpu_s = phases["inner_loop"], phases["inner_loop.cpu"]
        row = {"repeat": r, "load_average": load, "tokens": tokens,
               "plain_s": plain["seconds"], "island_inner_s": inner_s, "island_task_s": island["task_s"],
               "plain_cpu_s": plain["cpu_seconds"], "island_inner_cpu_s": inner_cpu_s,
               "island_task_cpu_s": island["task_cpu_s"],
               "plain_tokens_per_s": tokens / plain["seconds"], "island_inner_tokens_per_s": tokens / inner_s,
               "island_task_tokens_per_s": tokens / island["task_s"],
               "inner_ratio": plain["seconds"] / inner_s, "task_ratio": plain["seconds"] / island["task_s"],
               "inner_cpu_ratio": plain["cpu_seconds"] / inner_cpu_s,
               "task_cpu_ratio": plain["cpu_seconds"] / island["task_cpu_s"],
               "phases_ms": {k: 1000 * v for k, v in phases.items()}}
        rows.append(row)
        log.info("repeat %d: plain %.0f tok/s, island inner loop %.0f tok/s (%.3f; CPU time %.3f), "
                 "whole task %.0f tok/s (%.3f; CPU time %.3f)", r, row["plain_tokens_per_s"],
                 row["island_inner_tokens_per_s"], row["inner_ratio"], row["inner_cpu_ratio"],
                 row["island_task_tokens_per_s"], row["task_ratio"], row["task_cpu_ratio"])
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]
              if key not in ("repeat", "phases_ms")}
    median["phases_ms"] = {p: statistics.median(row["phases_ms"].get(p, 0.0) for row in rows)
                           for p in (*PHASES, *(f"{p}.cpu" for p in PHASES))}
    return {"repeats": rows, "median": median, "warmup_task_s": warm["task_s"]}


def markdown(results: dict) -> str:
    s, m = results["setup"], results["median"]
    lines = [f"# Inner-loop speed: an island task against a plain PyTorch loop "
             f"({s['device']}, {s['precision']}, {s['threads']} thread(s))", "",
             f"Demo path model (hidden {s['hidden_size']}, {s['n_layers']} blocks, {s['parameters']:,} parameters), "
             f"batch {s['batch_size']} x {s['seq_len']}, vocabulary {s['vocab_size']}, {s['steps']} steps per task, "
             f"{s['repeats']} interleaved repeats (medians); island config overrides: {s['overrides'] or 'none'}. "
             f"Load average {results['load_average_at_start']:.2f} at start, {results['load_average_at_end']:.2f} "
             f"at end (other jobs shared the cores).", "",
             "Ratios are plain / island time within one repeat (>1: the island is faster), by wall-clock time "
             "and by this process's CPU time (less sensitive to other jobs on a shared CPU; it counts every "
             "thread of the process, so work moved to a background thread is not hidden).", "",
             format_table(["", "tokens/s", "ratio (wall)", "ratio (CPU time)"],
                          [["plain PyTorch loop", f"{m['plain_tokens_per_s']:,.0f}", "1.000", "1.000"],
                           ["island inner loop (train_steps)", f"{m['island_inner_tokens_per_s']:,.0f}",
                            f"{m['inner_ratio']:.3f}", f"{m['inner_cpu_ratio']:.3f}"],
                           ["island whole task (train_task + push_result)", f"{m['island_task_tokens_per_s']:,.0f}",
                            f"{m['task_ratio']:.3f}", f"{m['task_cpu_ratio']:.3f}"]]),
             "", "Per-task phases (median ms; shard_read is the part of the inner loop spent waiting for batches):", "",
             format_table(["phase", "wall ms", "CPU ms"],
                          [[p, f"{m['phases_ms'][p]:.1f}", f"{m['phases_ms'][p + '.cpu']:.1f}"] for p in PHASES]),
             "", "Repeats:", "",
             format_table(["repeat", "load avg", "plain s", "island loop s", "island task s", "loop ratio",
                           "task ratio", "loop ratio (CPU)", "task ratio (CPU)"],
                          [[r["repeat"], f"{r['load_average']:.2f}", f"{r['plain_s']:.2f}", f"{r['island_inner_s']:.2f}",
                            f"{r['island_task_s']:.2f}", f"{r['inner_ratio']:.3f}", f"{r['task_ratio']:.3f}",
                            f"{r['inner_cpu_ratio']:.3f}", f"{r['task_cpu_ratio']:.3f}"]
                           for r in results["repeats"]])]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=2000, help="bundled-corpus documents routed and sharded")
    parser.add_argument("--steps", type=int, default=0, help="inner steps per task (0 = the demo's inner.steps)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved (island, plain) pairs; medians reported")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--precision", default="", help="fp32 | bf16 (default: what precision auto picks)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="island config override, e.g. train.compile=true (repeatable)")
    parser.add_argument("--name", default="speed", help="results file name in bench/results/")
    parser.add_argument("--run", default="", help="build the run here and keep it (reused when it has shards); "
                                                  "default: a temporary directory")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    precision = args.precision or default_precision(device)
    overrides = [f"corpus.max_documents={args.documents}", f"train.device={device.type}",
                 f"train.precision={precision}"]
    if args.steps:
        overrides.append(f"inner.steps={args.steps}")
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-speed-") as tmp:
        config, run = build_run(Path(args.run or Path(tmp) / "run"), overrides + args.set)
        setup = island_setup(config, run)
        measured = measure(setup, repeats=args.repeats)
        model = setup.spec.new_model()
    results = {
        "setup": {"device": device.type, "precision": precision, "threads": args.threads, "documents": args.documents,
                  "steps": config.inner.steps, "repeats": args.repeats, "batch_size": config.inner.batch_size,
                  "seq_len": setup.spec.seq_len, "vocab_size": setup.spec.vocab_size,
                  "hidden_size": config.model.hidden_size, "n_layers": config.model.n_layers,
                  "parameters": sum(p.numel() for p in model.parameters()), "val_batches": config.inner.val_batches,
                  "overrides": args.set},
        **measured, "seconds": time.perf_counter() - started,
        "load_average_at_start": load_start, "load_average_at_end": os.getloadavg()[0]}
    text = markdown(results)
    path = write_results(args.name, results, text)
    print(text)
    print(f"results in {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
