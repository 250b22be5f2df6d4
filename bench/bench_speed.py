"""Speed benchmark: an island's inner loop against a plain PyTorch loop on the same model and batches.

    python bench/bench_speed.py                     # demo model, 3 repeats x 25 steps, 1 thread (~4 min on 2 cores)
    python bench/bench_speed.py --repeats 7 --variant compile:hardware.compile=true --variant fused:inner.fused=true
    python bench/bench_speed.py --device cuda --variant tf32:hardware.tf32=true   # on a GPU (bf16 where supported)

What runs, in one process with a fixed torch thread count (`--threads`):
- a small run built in a temporary directory (or `--run`) from configs/demo.yaml (`corpus.max_documents`
  = `--documents`): `route`, `shard` and module version 0 in the store, exactly as `dipaco run` does;
- the **island**: `train_task` + `push_result` of a real task (path 0, from version 0, continuing the
  data order and the LR schedule of a first task, its AdamW state restored from the store, validation
  batches scored, pseudo-gradient computed, inner state and result written), each phase timed
  (`dipaco.islands.island.timing.PHASES`); once per `--variant` (a name and config overrides: compile,
  fused AdamW, TF32, ...), besides the default `island`;
- the **plain loop**: the same Hugging Face model, batch, sequence, AdamW (same betas, weight decay
  and gradient clipping), precision and number of steps, on the batches the island's task trains on,
  already on the device, one `loss.item()` at the end.

Each variant's first task (and one plain loop) is an untimed warm-up; its time is reported, since
with `hardware.compile` it includes the compile. Then each repeat runs the plain loop and every variant
once, in an order rotated from repeat to repeat, and every ratio is taken against the plain loop of
the same repeat, then the median over repeats. The inner-loop ratio (`train_steps` of the island
against the plain loop) is the issue's check (>= 0.95); the task ratio counts everything an island
does per task, and is shown again less the validation forward passes (`inner.val_batches` of them,
which early stopping needs). Ratios by wall time and by this process's CPU time (on a shared CPU the
second is the steadier). Writes bench/results/<--name>.{json,md} (default speed).
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
from dipaco.islands.island.timing import PHASES  # noqa: E402
from dipaco.islands.island.training import IslandSetup, data_seed, push_result, train_task  # noqa: E402
from dipaco.pipeline.context import PathFactory  # noqa: E402
from dipaco.pipeline.version_zero import start_or_resume_store  # noqa: E402
from dipaco.run_dir import RunDir  # noqa: E402
from dipaco.stages.island import island_setup  # noqa: E402
from dipaco.stages.route import route  # noqa: E402
from dipaco.stages.shard import shard  # noqa: E402
from dipaco.store.board import inner_ref  # noqa: E402
from dipaco.store.records import Task  # noqa: E402
from dipaco.tables import format_table  # noqa: E402

log = logging.getLogger("bench_speed")
DEMO = ROOT / "configs" / "demo.yaml"
PATH = 0
ISLAND = "island"  # the default variant: the config as it is


def default_precision(device: torch.device) -> str:
    """What `precision: auto` picks: bf16 on a GPU that computes it natively, fp32 on this kind of CPU."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def parse_variant(text: str) -> tuple[str, list[str]]:
    """`"compile:hardware.compile=true,hardware.tf32=true"` → `("compile", ["hardware.compile=true", "hardware.tf32=true"])`."""
    name, sep, overrides = text.partition(":")
    if not sep or not name or name == ISLAND or "=" not in overrides:
        raise argparse.ArgumentTypeError(f"a variant looks like name:section.key=value[,...] (not {ISLAND!r}), "
                                         f"got {text!r}")
    return name, overrides.split(",")


# The demo's config routes by its dense warm start's features (routing.featurizer: base-model); a task's speed
# does not depend on the routing, so the run is routed by TF-IDF without a warm start.
NO_WARM_START = ["warm_start.fraction=0", "routing.featurizer=tfidf"]


def build_run(root: Path, overrides: list[str]) -> tuple[Config, RunDir]:
    """Route and shard the demo corpus (cut to `corpus.max_documents`) and write module version 0
    (the routing and shards of an earlier run in `root` are kept)."""
    config = load_config(DEMO, overrides)
    run = RunDir(root)
    started = time.perf_counter()
    if not (run.shards / "index.json").exists():
        route(config, run)
        shard(config, run)
    start_or_resume_store(PathFactory(config, run))
    log.info("run built in %.1fs in %s", time.perf_counter() - started, root)
    return config, run


def island_task(setup: IslandSetup, task: Task) -> dict:
    """One task as an island runs it (train, then upload); seconds per phase and in all."""
    timings: dict[str, float] = {}
    wall, cpu = time.perf_counter(), time.process_time()
    out = train_task(setup, task, timings=timings)
    push_result(setup, task, out, island="bench", timings=timings)
    return {"task_s": time.perf_counter() - wall, "task_cpu_s": time.process_time() - cpu, "phases_s": timings,
            "tokens": out.meta.tokens}


def plain_batches(setup: IslandSetup, steps: int, device: torch.device) -> list[torch.Tensor]:
    """The `steps` batches `(B, T)` the timed island tasks train on, already on the device."""
    batches = setup.reader.iter_batches(PATH, "train", batch_size=setup.inner.batch_size,
                                        seed=data_seed(setup.run.seed, path=PATH), skip_batches=steps)
    return [torch.as_tensor(next(batches), dtype=torch.long).to(device) for _ in range(steps)]


def plain_loop(setup: IslandSetup, batches: list[torch.Tensor], device: torch.device) -> dict:
    """The reference: a fresh model and `torch.optim.AdamW`, `len(batches)` steps, nothing else."""
    inner, precision = setup.inner, setup.hardware.precision
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
    loss.item()
    return {"seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu,
            "tokens": sum(b.numel() for b in batches)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare(island: dict, plain: dict) -> dict:
    """One island task against the plain loop of the same repeat: tokens/s and ratios (plain / island time)."""
    tokens, phases = island["tokens"], island["phases_s"]
    assert tokens == plain["tokens"], (tokens, plain["tokens"])
    inner_s, inner_cpu_s = phases["inner_loop"], phases["inner_loop.cpu"]
    return {"tokens": tokens, "plain_s": plain["seconds"], "plain_cpu_s": plain["cpu_seconds"],
            "island_inner_s": inner_s, "island_inner_cpu_s": inner_cpu_s,
            "island_task_s": island["task_s"], "island_task_cpu_s": island["task_cpu_s"],
            "plain_tokens_per_s": tokens / plain["seconds"], "island_inner_tokens_per_s": tokens / inner_s,
            "island_task_tokens_per_s": tokens / island["task_s"],
            "inner_ratio": plain["seconds"] / inner_s, "task_ratio": plain["seconds"] / island["task_s"],
            "task_without_validation_ratio": plain["seconds"] / (island["task_s"] - phases["validation"]),
            "inner_cpu_ratio": plain["cpu_seconds"] / inner_cpu_s,
            "task_cpu_ratio": plain["cpu_seconds"] / island["task_cpu_s"],
            "phases_ms": {k: 1000 * v for k, v in phases.items()}}


def medians(rows: list[dict]) -> dict:
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]
              if key not in ("repeat", "phases_ms")}
    median["phases_ms"] = {p: statistics.median(row["phases_ms"].get(p, 0.0) for row in rows)
                           for p in (*PHASES, *(f"{p}.cpu" for p in PHASES))}
    return median


def measure(setups: dict[str, IslandSetup], *, repeats: int) -> dict:
    """Warm up every variant and the plain loop, then `repeats` rounds of (plain loop, each variant) in a
    rotating order; per-repeat figures and medians per variant."""
    base = setups[ISLAND]
    device = resolve_device(base.hardware.device)
    steps = base.inner.steps
    first = Task.open(path=PATH, base=0, step_offset=0, inner_from=None)
    inner_from = inner_ref(path=PATH, round=first.round, attempt=0)  # left by the first warm-up task
    attempts = iter(range(1, 1_000_000))  # each task writes its own result and inner state
    results: dict[str, dict] = {}
    for name, setup in setups.items():
        warm = island_task(setup, first if name == ISLAND else dataclasses.replace(first, attempt=next(attempts)))
        results[name] = {"warmup_task_s": warm["task_s"], "repeats": []}
        log.info("%s: first (warm-up) task %.2fs", name, warm["task_s"])
    batches = plain_batches(base, steps, device)
    plain_loop(base, batches, device)  # warm-up
    names = ["plain", *setups]
    for r in range(repeats):
        load = os.getloadavg()[0]
        order = names[r % len(names):] + names[: r % len(names)]
        runs = {}
        for name in order:
            if name == "plain":
                runs[name] = plain_loop(base, batches, device)
            else:
                task = Task.open(path=PATH, base=0, step_offset=steps, inner_from=inner_from)
                runs[name] = island_task(setups[name], dataclasses.replace(task, attempt=next(attempts)))
        for name in setups:
            row = {"repeat": r, "load_average": load, **compare(runs[name], runs["plain"])}
            results[name]["repeats"].append(row)
            log.info("repeat %d %s: plain %.0f tok/s, inner loop %.0f tok/s (%.3f; CPU time %.3f), "
                     "whole task %.0f tok/s (%.3f; CPU time %.3f)", r, name, row["plain_tokens_per_s"],
                     row["island_inner_tokens_per_s"], row["inner_ratio"], row["inner_cpu_ratio"],
                     row["island_task_tokens_per_s"], row["task_ratio"], row["task_cpu_ratio"])
    for result in results.values():
        result["median"] = medians(result["repeats"])
    return results


def markdown(results: dict) -> str:
    s, variants = results["setup"], results["variants"]
    first = variants[ISLAND]["median"]
    lines = [f"# Inner-loop speed: an island task against a plain PyTorch loop "
             f"({s['device']}, {s['precision']}, {s['threads']} thread(s))", "",
             f"Demo path model (hidden {s['hidden_size']}, {s['n_layers']} blocks, {s['parameters']:,} parameters), "
             f"batch {s['batch_size']} x {s['seq_len']}, vocabulary {s['vocab_size']}, {s['steps']} steps per task, "
             f"{s['val_batches']} validation batches, {s['repeats']} repeats (medians). Load average "
             f"{results['load_average_at_start']:.2f} at start, {results['load_average_at_end']:.2f} at end "
             f"(other jobs shared the cores).", "",
             "Ratios are plain / island time within one repeat (>1: the island is faster), by wall-clock time "
             "and by this process's CPU time (steadier on a shared CPU; it counts every thread of the "
             "process, so work moved to a background thread is not hidden).", "",
             format_table(["", "overrides", "tokens/s", "ratio (wall)", "ratio (CPU time)", "first task s"],
                          [["plain PyTorch loop", "", f"{first['plain_tokens_per_s']:,.0f}", "1.000", "1.000", ""]]
                          + [row for name, v in variants.items() for row in (
                              [f"{name}: inner loop", ", ".join(v["overrides"]) or "-",
                               f"{v['median']['island_inner_tokens_per_s']:,.0f}", f"{v['median']['inner_ratio']:.3f}",
                               f"{v['median']['inner_cpu_ratio']:.3f}", f"{v['warmup_task_s']:.1f}"],
                              [f"{name}: whole task", "", f"{v['median']['island_task_tokens_per_s']:,.0f}",
                               f"{v['median']['task_ratio']:.3f}", f"{v['median']['task_cpu_ratio']:.3f}", ""],
                              [f"{name}: whole task less validation", "", "",
                               f"{v['median']['task_without_validation_ratio']:.3f}", "", ""])]),
             "", "The first task of each variant is a warm-up (with `hardware.compile` it includes the compile, "
             "from an empty inductor cache). "
             "Per-task phases (median ms, wall / CPU; shard_read is the part of the inner loop the training "
             "thread spent waiting for the next batch):", "",
             format_table(["phase", *variants],
                          [[p, *(f"{v['median']['phases_ms'][p]:.1f} / {v['median']['phases_ms'][p + '.cpu']:.1f}"
                                 for v in variants.values())] for p in PHASES]),
             "", "Repeats (ratios wall / CPU time):", "",
             format_table(["repeat", "load avg", "plain s", *(f"{n} loop" for n in variants),
                           *(f"{n} task" for n in variants)],
                          [[r, f"{rows[0]['load_average']:.2f}", f"{rows[0]['plain_s']:.2f}",
                            *(f"{row['inner_ratio']:.3f} / {row['inner_cpu_ratio']:.3f}" for row in rows),
                            *(f"{row['task_ratio']:.3f} / {row['task_cpu_ratio']:.3f}" for row in rows)]
                           for r, rows in enumerate(zip(*(v["repeats"] for v in variants.values())))])]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=2000, help="bundled-corpus documents routed and sharded")
    parser.add_argument("--steps", type=int, default=0, help="inner steps per task (0 = the demo's inner.steps)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of (plain loop, each variant); medians reported")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--precision", default="", help="fp32 | bf16 (default: what precision auto picks)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every island variant (repeatable)")
    parser.add_argument("--variant", action="append", default=[], type=parse_variant,
                        metavar="NAME:KEY=VALUE[,...]", help="an island variant besides the config as it is, "
                        "e.g. compile:hardware.compile=true (repeatable)")
    parser.add_argument("--name", default="speed", help="results file name in bench/results/")
    parser.add_argument("--run", default="", help="build the run here and keep it (reused when it has shards); "
                                                  "default: a temporary directory")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    precision = args.precision or default_precision(device)
    overrides = [*NO_WARM_START, f"corpus.max_documents={args.documents}", f"hardware.device={device.type}",
                 f"hardware.precision={precision}", *([f"inner.steps={args.steps}"] if args.steps else []), *args.set]
    with tempfile.TemporaryDirectory(prefix="bench-speed-") as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")  # compile from cold, every time
        config, run = build_run(Path(args.run or Path(tmp) / "run"), overrides)
        variants = [(ISLAND, []), *args.variant]
        setups = {name: island_setup(load_config(DEMO, overrides + extra), run) for name, extra in variants}
        measured = measure(setups, repeats=args.repeats)
    spec = setups[ISLAND].spec
    results = {
        "setup": {"device": device.type, "precision": precision, "threads": args.threads, "documents": args.documents,
                  "steps": config.inner.steps, "repeats": args.repeats, "batch_size": config.inner.batch_size,
                  "seq_len": spec.seq_len, "vocab_size": spec.vocab_size, "hidden_size": config.model.hidden_size,
                  "n_layers": config.model.n_layers, "val_batches": config.inner.val_batches,
                  "parameters": sum(p.numel() for p in spec.new_model().parameters()), "overrides": args.set},
        "variants": {name: {"overrides": extra, **measured[name]} for name, extra in variants},
        "seconds": time.perf_counter() - started,
        "load_average_at_start": load_start, "load_average_at_end": os.getloadavg()[0]}
    text = markdown(results)
    path = write_results(args.name, results, text)
    print(text)
    print(f"results in {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
