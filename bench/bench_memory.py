"""Memory benchmark: an island task's peak against its path's own budget, and the coordinator's outer step.

    python bench/bench_memory.py                  # ~15 min on 2 CPU cores: both parts
    python bench/bench_memory.py --skip-island    # the coordinator part only (~3 min)

Every figure is measured in a fresh child process (`python bench/bench_memory.py --child ...`) as
the growth of its resident memory over the measured code: the child records VmRSS after its imports
and set-up, resets the kernel's high-water mark (writing 5 to /proc/self/clear_refs, Linux), runs the
code and reads VmHWM. So the interpreter, torch and transformers (the import baseline, reported on
its own) are not counted. The children pin glibc's mmap threshold (MALLOC_MMAP_THRESHOLD_=128 KiB) so
a freed large buffer goes back to the kernel at once: the peak is then what was live at the worst
moment, not an artefact of the allocator's dynamic threshold. Everything runs on the CPU (host
memory); a CUDA island would be measured by `torch.cuda.max_memory_allocated`, which this script
does not do yet.

1. Coordinator (`dipaco.islands.coordinator.outer_step.apply_round`): a synthetic round written straight into a
   store (no training): a grid of L levels with one equal-size module per choice plus the shared
   `embeddings` (so every path holds L + 1 modules and the embeddings are shared by all paths),
   random pseudo-gradients from every path, default outer step (Nesterov, √paths rescale, token
   weights). Measured at 2x2, 4x4 and 8x8, `none` and `int8`, for the streamed outer step and for the
   earlier one that decoded every result first (`apply_round_in_memory`, kept here verbatim as the
   reference), against the bound of one module × the paths that share it.
2. Island (`dipaco.islands.island.training.train_task` + `push_result`, one task of path 0, 6 inner steps): the
   first 4000 documents of the demo corpus routed and sharded at 2x2 and 8x8 with the same path
   model (the demo's: hidden 128, 4 blocks, vocab 4096, sequences of 256 tokens, fp32), at the demo's
   batch of 8 and at a batch of 1 (activations small, so what the island holds besides them shows),
   against the path's budget: parameters + gradients + AdamW's two moments (4 × the parameters'
   float32 bytes) + activations, measured as the peak of a plain forward + backward of the same
   model and batch with the gradients already allocated. The island runs the task twice in one
   process: the first task's peak includes the process's one-time lazy state (the first forward and
   the first optimiser step, which imports torch._dynamo, allocate and keep memory), the second's is
   the steady state of a long-running island. A plain PyTorch loop (a new model, AdamW, the same
   batches and steps) is measured the same way, twice, for comparison.

Writes bench/results/memory.json and bench/results/memory.md, with the machine they were measured on.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dipaco.config import OuterConfig, RoundsConfig  # noqa: E402
from dipaco.model.topology import Topology  # noqa: E402
from dipaco.store.module_store import ModuleStore  # noqa: E402
from dipaco.store.records import ResultMeta, Task  # noqa: E402

log = logging.getLogger("bench_memory")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": "131072",
       "OMP_NUM_THREADS": "1", "DIPACO_THREADS": "1"}
MIB = 2**20


# --- measuring a child's peak ------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure_peak(fn):
    """Run `fn()`; returns (its result, peak resident bytes above the resident bytes before it)."""
    gc.collect()
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the current RSS
    result = fn()
    return result, (_status_kib("VmHWM") - before) * 1024


def run_child(*args: str, timeout: int = 1200) -> dict:
    """`python bench/bench_memory.py --child ARGS` in a fresh process; its JSON answer."""
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", *args], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- 1. the coordinator's outer step on a synthetic round --------------------------------------------
def synthetic_topology(levels: list[int]) -> Topology:
    """`levels` with one block per level: modules `embeddings` (every path) and `level{l}.module{k}`."""
    return Topology(levels=tuple(levels), level_blocks=tuple((i,) for i in range(len(levels))),
                    private_blocks=frozenset(), private_embeddings=False)


def synthetic_pending(topology: Topology, *, round: int) -> list[Task]:
    """The received tasks of a sync round: every path, from version round − 1, attempt 0."""
    return [Task(path=p, base=round - 1, attempt=0, status="received", island="bench", incarnation="x",
                 step_offset=0, inner_from=None, result_attempt=0) for p in range(topology.n_paths)]


def write_synthetic_round(store: ModuleStore, topology: Topology, *, round: int, module_floats: int,
                          compression: str, seed: int = 0) -> dict:
    """Write every path's result for `round` (and module version 0 when round is 1): each module is a
    (rows, 256) weight and a 256 bias, about `module_floats` floats. Returns sizes in bytes."""
    from dipaco.store.board import write_result

    g = torch.Generator().manual_seed(seed * 1000 + round)
    rows = max(1, module_floats // 256 - 1)

    def module() -> dict[str, torch.Tensor]:
        return {"w": torch.randn(rows, 256, generator=g), "b": torch.randn(256, generator=g)}

    if round == 1:
        for name in topology.modules:
            store.write_module(0, name, module())
    result_bytes = 0
    for task in synthetic_pending(topology, round=round):
        delta = {f"{m}/{k}": v * 1e-3 for m in topology.modules_of_path(task.path) for k, v in module().items()}
        meta = ResultMeta(path=task.path, round=round, base=round - 1, attempt=0, tokens=1000 + 37 * task.path,
                          train_loss=3.0, losses=(3.0,), val_loss_start=3.5, seconds=1.0, bytes_down_modules=0,
                          bytes_down_inner=0, inner_state_local=False, data_parallel_ranks=1)
        written, _ = write_result(store, task, delta, meta, compression=compression, level=1)
        result_bytes += written.bytes
    module_bytes = 4 * (rows * 256 + 256)
    return {"module_bytes": module_bytes, "result_file_bytes": result_bytes,
            "decoded_result_bytes": module_bytes * sum(len(topology.modules_of_path(p)) for p in range(topology.n_paths)),
            "max_paths_per_module": max(len(topology.paths_of_module(m)) for m in topology.modules)}


def apply_round_in_memory(store: ModuleStore, topology: Topology, *, round: int, pending: list[Task],
                          config: OuterConfig) -> None:
    """The outer step before it streamed (commit f12451c), kept as the reference: it decodes every
    pending result whole, then loops over modules, averaging with the list-based sum."""
    from dipaco.optim.outer import outer_update
    from dipaco.rounds.staleness import staleness_weight
    from dipaco.store.board import read_result

    applied, results = [], {}
    for task in sorted(pending, key=lambda t: (t.path, t.base)):
        factor = staleness_weight(round - 1 - task.base, config=RoundsConfig())  # sync
        tensors, meta = read_result(store, round=task.round, path=task.path, attempt=task.result_attempt)
        if factor is None:
            continue
        applied.append((task.key, task.path, meta.tokens, factor))
        modules: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            module, _, name = key.partition("/")
            modules.setdefault(module, {})[name] = tensor
        results[task.key] = modules
    for name in topology.modules:
        paths = set(topology.paths_of_module(name))
        contributions = [(results[key][name], (float(tokens) if config.weighting == "tokens" else 1.0) * factor)
                         for key, path, tokens, factor in applied if path in paths]
        params = store.read_module(round - 1, name)
        momentum = store.read_outer_state(round - 1, name)
        if contributions:
            params, momentum = outer_update(params, momentum, _combine_list(contributions, config), config)
        store.write_module(round, name, params)
        if momentum:
            store.write_outer_state(round, name, momentum)


def _combine_list(contributions: list, config: OuterConfig) -> dict[str, torch.Tensor]:
    """`combine_pseudo_gradients` as it was (commit f12451c): every Δ_p in memory at once."""
    total = sum(weight for _, weight in contributions)
    scale = math.sqrt(len(contributions)) if config.rescale_by_paths else 1.0
    combined = {}
    for name in contributions[0][0]:
        acc = torch.zeros_like(contributions[0][0][name], dtype=torch.float32)
        for delta, weight in contributions:
            acc.add_(delta[name].float(), alpha=weight / total)
        combined[name] = acc.mul_(scale)
    return combined


def warm_up(config: OuterConfig) -> None:
    """One tiny outer step first: the first optimiser step imports torch._dynamo (about 70 MiB
    resident), a one-time cost of the process that is no part of any round's memory."""
    from dipaco.optim.outer import outer_update

    w = {"w": torch.zeros(4)}
    outer_update(w, None, w, config)


def child_coordinator(store_url: str, levels: list[int], impl: str) -> dict:
    from dipaco.islands.coordinator.outer_step import apply_round

    torch.set_num_threads(1)
    store, topology = ModuleStore(store_url), synthetic_topology(levels)
    # token weights: the reference implementation (commit f12451c) knows no shard sizes; memory is the same
    pending, config = synthetic_pending(topology, round=1), OuterConfig(weighting="tokens", rescale_by_paths=True)
    warm_up(config)
    step = apply_round if impl == "streamed" else apply_round_in_memory
    start = time.perf_counter()
    _, peak = measure_peak(lambda: step(store, topology, round=1, pending=pending, config=config))
    return {"peak_bytes": peak, "seconds": time.perf_counter() - start, "bytes_read": store.bytes_read}


def coordinator_peak(store_dir: Path, levels: list[int], impl: str) -> dict:
    """Peak resident growth of one outer step (`impl`: "streamed" or "in-memory") over a synthetic
    round in `store_dir`, in a fresh process. The store's version-1 files are removed first."""
    for kind in ("modules", "outer"):
        shutil.rmtree(store_dir / kind / "round-000001", ignore_errors=True)
    return run_child("coordinator", str(store_dir), impl, *map(str, levels))


def bench_coordinator(grids: list[list[int]], compressions: list[str], module_floats: int) -> list[dict]:
    rows = []
    for levels in grids:
        for compression in compressions:
            with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
                store_dir = Path(tmp) / "store"
                topology = synthetic_topology(levels)
                sizes = write_synthetic_round(ModuleStore(str(store_dir)), topology, round=1,
                                              module_floats=module_floats, compression=compression)
                row = {"grid": "x".join(map(str, levels)), "paths": topology.n_paths, "compression": compression,
                       "modules": len(topology.modules), **sizes,
                       "bound_bytes": sizes["module_bytes"] * sizes["max_paths_per_module"]}
                for impl in ("in-memory", "streamed"):
                    row[impl] = coordinator_peak(store_dir, levels, impl)
                    log.info("coordinator %s %s %s: peak %.1f MiB", row["grid"], compression, impl,
                             row[impl]["peak_bytes"] / MIB)
                rows.append(row)
    return rows


# --- 2. an island task against its path's budget ----------------------------------------------------
# Routed by TF-IDF without the demo's dense warm start (whose model routes the demo: routing.featurizer
# base-model): an island's memory does not depend on the routing.
ISLAND_OVERRIDES = ["warm_start.fraction=0", "routing.featurizer=tfidf", "hardware.precision=fp32", "hardware.device=cpu",
                    "eval.baselines=false", "inner.steps=6", "inner.val_batches=2", "corpus.max_documents=4000"]


def prepare_run(root: Path, levels: list[int]) -> Path:
    """Route, shard and initialise the store of the demo config with `levels` (in this process)."""
    from dipaco.config import load_config, save_config
    from dipaco.pipeline.context import PathFactory
    from dipaco.pipeline.version_zero import start_or_resume_store
    from dipaco.run_dir import RunDir
    from dipaco.stages.route import route
    from dipaco.stages.shard import shard

    config = load_config(ROOT / "configs" / "demo.yaml",
                         [*ISLAND_OVERRIDES, f"topology.levels=[{','.join(map(str, levels))}]"])
    run = RunDir(root)
    save_config(config, run.config)
    route(config, run)
    shard(config, run)
    start_or_resume_store(PathFactory(config, run))
    return run.config


def _island_setup(config_file: str):
    from dipaco.config import load_config
    from dipaco.run_dir import RunDir
    from dipaco.stages.island import island_setup

    config = load_config(Path(config_file))
    return island_setup(config, RunDir(Path(config_file).parent))


def child_island(config_file: str, path: int) -> dict:
    """One task of `path` (train, upload) in this fresh process, then the same task again once the
    first is released. The first task's peak includes the process's one-time lazy state (torch and
    transformers allocate and keep some on the first forward and optimiser step); the second's is the
    steady state of a long-running island's task."""
    from dipaco.islands.island.training import push_result, train_task

    torch.set_num_threads(1)
    setup = _island_setup(config_file)
    _ = setup.reader, setup.store.state()  # open the shards and the store before measuring

    def task(attempt: int) -> ResultMeta:
        todo = Task(path=path, base=0, attempt=attempt, status="assigned", island="bench", incarnation="x",
                    step_offset=0, inner_from=None, result_attempt=None)
        return push_result(setup, todo, train_task(setup, todo), island="bench")[0]

    meta, cold = measure_peak(lambda: task(0))
    _, warm = measure_peak(lambda: task(1))
    return {"peak_bytes": cold, "warm_peak_bytes": warm, "tokens": meta.tokens,
            "modules": len(setup.topology.modules), "path_modules": len(setup.topology.modules_of_path(path))}


def child_plain(config_file: str, path: int) -> dict:
    """The path's budget measured with plain PyTorch: parameter bytes, activations (peak of a forward +
    backward with the gradients already allocated) and the peak of a plain AdamW loop of the same steps."""
    import numpy as np

    from dipaco.islands.island.training import data_seed

    torch.set_num_threads(1)
    setup = _island_setup(config_file)
    inner = setup.inner
    batches = setup.reader.iter_batches(path, "train", batch_size=inner.batch_size,
                                        seed=data_seed(setup.run.seed, path=path), skip_batches=0)
    batch = [torch.from_numpy(np.asarray(next(batches), dtype=np.int64)) for _ in range(inner.steps)]

    def step(model: torch.nn.Module, tokens: torch.Tensor) -> None:
        model(input_ids=tokens, labels=tokens).loss.backward()

    def plain_loop() -> None:
        model = setup.spec.new_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=inner.lr, weight_decay=inner.weight_decay)
        for tokens in batch:
            step(model, tokens)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    _, loop_peak = measure_peak(plain_loop)
    _, warm_loop_peak = measure_peak(plain_loop)  # again: without the process's one-time lazy state
    model = setup.spec.new_model()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    step(model, batch[0])  # gradients allocated
    _, activations = measure_peak(lambda: step(model, batch[0]))
    return {"param_bytes": params, "activation_bytes": activations, "plain_loop_peak_bytes": loop_peak,
            "warm_plain_loop_peak_bytes": warm_loop_peak, "batch": list(batch[0].shape)}


def child_baseline(config_file: str) -> dict:
    """The resident bytes of a process that has only imported what an island imports and built its set-up."""
    import dipaco.islands.island.training  # noqa: F401

    setup = _island_setup(config_file)
    _ = setup.reader, setup.store.state()
    gc.collect()
    return {"rss_bytes": _status_kib("VmRSS") * 1024}


def bench_island(grids: list[list[int]], batch_sizes: list[int], work: Path) -> list[dict]:
    from dipaco.config import load_config, save_config

    rows = []
    for levels in grids:
        grid = "x".join(map(str, levels))
        run_config = prepare_run(work / f"run-{grid}", levels)
        for batch_size in batch_sizes:
            config_file = run_config.parent / f"config-b{batch_size}.yaml"  # in the run's root: the children's RunDir
            save_config(load_config(run_config, [f"inner.batch_size={batch_size}"]), config_file)
            plain = run_child("plain", str(config_file), "0")
            island = run_child("island", str(config_file), "0")
            baseline = run_child("baseline", str(config_file))
            budget = 4 * plain["param_bytes"] + plain["activation_bytes"]
            rows.append({"grid": grid, "paths": math.prod(levels), "batch_size": batch_size, **plain, "island": island,
                         "baseline": baseline, "budget_bytes": budget, "ratio": island["peak_bytes"] / budget,
                         "warm_ratio": island["warm_peak_bytes"] / budget,
                         "plain_ratio": plain["plain_loop_peak_bytes"] / budget,
                         "warm_plain_ratio": plain["warm_plain_loop_peak_bytes"] / budget})
            log.info("island %s batch %d: peak %.1f MiB first task, %.1f MiB second, budget %.1f MiB (%.2fx, %.2fx; "
                     "plain loop %.2fx, %.2fx)", grid, batch_size, island["peak_bytes"] / MIB,
                     island["warm_peak_bytes"] / MIB, budget / MIB, rows[-1]["ratio"], rows[-1]["warm_ratio"],
                     rows[-1]["plain_ratio"], rows[-1]["warm_plain_ratio"])
    return rows


# --- the report ------------------------------------------------------------------------------------
def markdown(results: dict) -> str:
    from dipaco.tables import format_table

    def mib(x: float) -> str:
        return f"{x / MIB:.1f}"

    lines = ["# Memory: the coordinator's outer step and an island task", ""]
    rows = results.get("coordinator", [])
    if rows:
        lines += [f"Coordinator, one outer step over a synthetic round (module {mib(rows[0]['module_bytes'])} MiB "
                  "float32, every path L + 1 modules, embeddings shared by all): peak resident growth, MiB. "
                  "Bound = one module × the paths that share it (the most shared: the embeddings).", ""]
        table = [[r["grid"], r["compression"], r["modules"], mib(r["decoded_result_bytes"]), mib(r["bound_bytes"]),
                  mib(r["in-memory"]["peak_bytes"]), mib(r["streamed"]["peak_bytes"]),
                  f"{r['streamed']['peak_bytes'] / r['module_bytes']:.1f}"] for r in rows]
        lines += format_table(["grid", "compression", "modules", "all results decoded", "bound",
                               "before (decode all)", "after (streamed)", "after / module"], table).splitlines()
        lines.append("")
    rows = results.get("island", [])
    if rows:
        lines += ["Island, tasks of path 0 (train + upload), demo path model, fp32: peak resident growth above "
                  "the process after imports and set-up, MiB, for its first task (with the process's one-time "
                  "lazy state) and its second (steady state); the plain PyTorch loop the same, run twice. "
                  "Budget = 4 × parameters (params, grads, AdamW's 2 moments) + activations (peak of a plain "
                  "forward + backward).", ""]
        table = [[r["grid"], r["paths"], f"{r['batch_size']} x {r['batch'][1]}", mib(r["param_bytes"]),
                  mib(r["activation_bytes"]), mib(r["budget_bytes"]),
                  f"{mib(r['plain_loop_peak_bytes'])} / {mib(r['warm_plain_loop_peak_bytes'])}",
                  f"{mib(r['island']['peak_bytes'])} / {mib(r['island']['warm_peak_bytes'])}",
                  f"{r['ratio']:.2f} / {r['warm_ratio']:.2f}", mib(r["baseline"]["rss_bytes"])] for r in rows]
        lines += format_table(["grid", "paths", "batch", "params", "activations", "budget",
                               "plain loop 1st / 2nd", "island 1st / 2nd task", "island / budget",
                               "import baseline RSS"], table).splitlines()
        lines.append("")
    for note in results.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


def child_main(args: list[str]) -> None:
    kind, rest = args[0], args[1:]
    if kind == "coordinator":
        out = child_coordinator(rest[0], [int(x) for x in rest[2:]], rest[1])
    elif kind == "island":
        out = child_island(rest[0], int(rest[1]))
    elif kind == "plain":
        out = child_plain(rest[0], int(rest[1]))
    elif kind == "baseline":
        out = child_baseline(rest[0])
    else:
        raise SystemExit(f"unknown child {kind!r}")
    print(json.dumps(out))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-island", action="store_true", help="only the coordinator part")
    parser.add_argument("--module-mib", type=float, default=4.0, help="size of a synthetic module (coordinator)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from bench.recording import write_results

    results: dict = {"notes": [
        "Peaks are resident-memory growth in fresh processes (VmHWM after resetting it through "
        "/proc/self/clear_refs), glibc's mmap threshold pinned at 128 KiB; the interpreter, torch and "
        "transformers imports (the import baseline) are not counted.",
        "Coordinator: synthetic results written straight into a store; 'before' is the outer step of "
        "commit f12451c (decode every result, then average), 'after' the streamed one; both after one tiny "
        "outer step (the first optimiser step imports torch._dynamo, about 70 MiB, once per process).",
        "Island: the budget's activations are measured (peak of a forward + backward with the gradients "
        "already allocated), not estimated. The island also holds the modules it started from (θ_base, one "
        "more copy of the parameters: the pseudo-gradient needs it; on CUDA it stays in host memory).",
    ]}
    module_floats = int(args.module_mib * MIB / 4)
    results["coordinator"] = bench_coordinator([[2, 2], [4, 4], [8, 8]], ["none", "int8"], module_floats)
    if not args.skip_island:
        with tempfile.TemporaryDirectory(prefix="bench-memory-island-") as tmp:
            results["island"] = bench_island([[2, 2], [8, 8]], [8, 1], Path(tmp))
    path = write_results("memory", results, markdown(results))
    print(markdown(results))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
