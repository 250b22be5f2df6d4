"""The coordinator and the store at 256 paths: a 16x16 grid of tiny paths run end to end on the CPU.

    python bench/bench_grid256.py                                   # 2x2, 4x4, 16x16 (~10 min on 2 loaded cores)
    python bench/bench_grid256.py --grids 2x2 16x16 --before-ref 15c5a75   # also the code of another commit, side by side

Each grid is routed and sharded once (configs/tiny.yaml's recipe with the whole bundled corpus, ~14k
documents: at 16x16 each path gets ~50 documents, which is plenty for a systems benchmark and nothing
for a quality one), then `dipaco train` runs `--rounds` sync rounds with `--islands` local island
processes in a fresh child process (the coordinator), then `dipaco eval --mode prefix`. Tiny paths (hidden 16,
one block per level, 2 inner steps of 2 x 32 tokens) make the islands' work small, so what grows with
the grid is the coordinator's and the store's share.

Measured in the coordinator process, per committed round (from the round's first tick to its commit):
- wall time, split into phases: `heartbeats` (listing and reading heartbeats), `results` (finding,
  reading and validating results), `outer` (the outer step, `apply_round`, without its writes),
  `write` (writing module and momentum versions), `commit` (manifest, checksums, state.json, best.json,
  retention), `board` (tasks.json), `other` (the policy, assigning tasks, the lease);
- store operations (`ModuleStore` calls: exists, listdir, read, ranged read, write, size, remove) and
  bytes read / written; fsspec calls (the outermost call on the filesystem object, so one `ls` is
  one call however fsspec implements it).
Per run: the coordinator's peak resident memory above its resident memory after imports and set-up
(VmHWM after resetting it through /proc/self/clear_refs, Linux), the island processes' peak resident
memory (the largest, `getrusage(RUSAGE_CHILDREN)`), and the eval stage's time.

With `--before-ref REF` the same run is also made with the dipaco code of commit REF (extracted with
`git archive` into a temporary folder and put first on the child's sys.path), on the same routed and
sharded run, so the before/after figures come from one run on the same load.

Writes bench/results/grid256.json and bench/results/grid256.md (or `--name`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE = os.environ.get("BENCH_DIPACO_CODE")  # the dipaco code a child measures (--before-ref), else this tree's
sys.path.insert(0, str(ROOT))
if CODE:
    sys.path.insert(0, CODE)

log = logging.getLogger("bench_grid256")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
MIB = 2**20
OVERRIDES = ["corpus.max_documents=0", "routing.method=flat", "sharding.seq_len=32", "model.hidden_size=16",
             "model.n_heads=2", "inner.steps=2", "inner.batch_size=2", "inner.warmup_steps=1", "inner.val_batches=1",
             "resilience.heartbeat_timeout=600", "hardware.threads_per_island=1", "eval.batch_size=16"]
STORE_OPS = ("exists", "listdir", "read_bytes", "read_range", "write_bytes", "size", "remove")
FS_OPS = ("exists", "ls", "info", "cat_file", "open", "mv", "rm", "makedirs", "size", "pipe_file", "isdir",
          "isfile", "find", "glob", "modified")
PHASES = ("heartbeats", "results", "outer", "write", "commit", "board", "other")


def grid_config(levels: list[int], *, rounds: int, islands: int) -> list[str]:
    corpus = ROOT / "dipaco" / "data" / "demo_corpus.jsonl.zst"  # by its file: both codes' runs see the same one
    return [*OVERRIDES, f"corpus.path={corpus}", f"topology.levels=[{','.join(map(str, levels))}]", f"model.n_layers={len(levels)}",
            f"run.rounds={rounds}", f"hardware.islands={islands}"]


# --- child: route and shard ---------------------------------------------------------------------------
def child_prepare(run_dir: str, overrides: list[str]) -> dict:
    from dipaco.config import load_config, save_config
    from dipaco.run_dir import RunDir
    from dipaco.stages.route import route
    from dipaco.stages.shard import shard

    config = load_config(ROOT / "configs" / "tiny.yaml", overrides)
    run = RunDir(Path(run_dir))
    save_config(config, run.config)
    started = time.perf_counter()
    route(config, run)
    routed = time.perf_counter()
    shard(config, run)
    return {"route_seconds": routed - started, "shard_seconds": time.perf_counter() - routed}


# --- child: train (instrumented coordinator) and eval ----------------------------------------------------
class Meter:
    """Store operations, fsspec calls and phase times of the coordinator, per round."""

    def __init__(self) -> None:
        self.phase: list[str] = []
        self.fs_depth = 0
        self.reset()

    def reset(self) -> None:
        self.ops = {op: 0 for op in STORE_OPS}
        self.fs_calls = 0
        self.bytes_read = self.bytes_written = 0
        self.seconds = {p: 0.0 for p in PHASES}
        self.write_seconds_in_outer = 0.0
        self.ticks = 0
        self.tick_seconds = 0.0

    def snapshot(self) -> dict:
        out = {"ticks": self.ticks, "seconds": self.tick_seconds, "phases": dict(self.seconds),
               "store_ops": dict(self.ops), "store_ops_total": sum(self.ops.values()), "fsspec_calls": self.fs_calls,
               "bytes_read": self.bytes_read, "bytes_written": self.bytes_written}
        out["phases"]["other"] = max(0.0, self.tick_seconds - sum(v for k, v in self.seconds.items() if k != "other"))
        return out


def _timed_phase(meter: Meter, name: str, fn):
    def wrapper(*args, **kwargs):
        if meter.phase:  # nested in another measured phase: counted there
            return fn(*args, **kwargs)
        meter.phase.append(name)
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            meter.seconds[name] += time.perf_counter() - started
            meter.phase.pop()
    return wrapper


def instrument(meter: Meter) -> None:
    """Patch the store, the filesystem and the coordinator's steps of this process (islands are other processes)."""
    from fsspec.implementations.local import LocalFileSystem

    from dipaco.islands.coordinator import closing, heartbeats, intake, service, task_board
    from dipaco.store.module_store import ModuleStore

    def store_op(op, fn):
        def wrapper(self, *args, **kwargs):
            meter.ops[op] += 1
            started = time.perf_counter()
            out = fn(self, *args, **kwargs)
            if op in ("read_bytes", "read_range"):
                meter.bytes_read += len(out)
            elif op == "write_bytes":
                meter.bytes_written += len(args[1] if len(args) > 1 else kwargs["data"])
                if meter.phase == ["outer"]:
                    meter.write_seconds_in_outer += time.perf_counter() - started
            return out
        return wrapper

    for op in STORE_OPS:
        setattr(ModuleStore, op, store_op(op, getattr(ModuleStore, op)))

    def fs_op(fn):
        def wrapper(*args, **kwargs):
            if meter.fs_depth == 0:
                meter.fs_calls += 1
            meter.fs_depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                meter.fs_depth -= 1
        return wrapper

    for op in FS_OPS:
        if hasattr(LocalFileSystem, op):
            setattr(LocalFileSystem, op, fs_op(getattr(LocalFileSystem, op)))

    heartbeats.read_heartbeats = _timed_phase(meter, "heartbeats", heartbeats.read_heartbeats)
    closing.apply_round = _timed_phase(meter, "outer", closing.apply_round)
    intake.ResultIntake.receive = _timed_phase(meter, "results", intake.ResultIntake.receive)
    task_board.TaskBoard.write = _timed_phase(meter, "board", task_board.TaskBoard.write)
    cls = service.Coordinator
    close = cls._close

    def timed_close(self, *args, **kwargs):
        started = time.perf_counter()
        outer_before = meter.seconds["outer"]
        try:
            return close(self, *args, **kwargs)
        finally:
            meter.seconds["commit"] += time.perf_counter() - started - (meter.seconds["outer"] - outer_before)
    cls._close = timed_close


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child_train(run_dir: str) -> dict:
    import resource

    import torch

    from dipaco.config import load_config
    from dipaco.islands.coordinator.service import Coordinator
    from dipaco.run_dir import RunDir
    from dipaco.stages.evaluate import evaluate
    from dipaco.stages.train import train

    torch.set_num_threads(1)
    run = RunDir(Path(run_dir))
    config = load_config(run.config)
    meter = Meter()
    instrument(meter)
    rounds: list[dict] = []
    tick = Coordinator.tick

    def measured_tick(self):
        started = time.perf_counter()
        try:
            return tick(self)
        finally:
            meter.ticks += 1
            meter.tick_seconds += time.perf_counter() - started
            while self.committed > len(rounds):
                moved = meter.write_seconds_in_outer
                record = meter.snapshot()
                record["phases"]["outer"] -= moved
                record["phases"]["write"] = moved
                record["round"] = len(rounds) + 1
                record["rss_mib"] = _kib("VmRSS") / 1024
                rounds.append(record)
                meter.reset()
    Coordinator.tick = measured_tick
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    baseline = _kib("VmRSS")
    started = time.perf_counter()
    summary = train(config, run)
    train_seconds = time.perf_counter() - started
    coordinator_peak = (_kib("VmHWM") - baseline) * 1024
    islands_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    started = time.perf_counter()
    result = evaluate(config, run, modes=["prefix"])
    eval_seconds = time.perf_counter() - started
    walls = [r["seconds"] for r in json.loads(run.train_summary.read_text())["rounds"]]
    for record, wall in zip(rounds, walls):
        record["wall_seconds"] = wall
    prefix = next((r for r in result.get("modes", {}).get("rows", []) if r.get("mode") == "prefix"), None)
    return {"rounds": rounds, "train_seconds": train_seconds, "coordinator_peak_bytes": coordinator_peak,
            "coordinator_baseline_bytes": baseline * 1024, "island_peak_bytes": islands_peak,
            "eval_seconds": eval_seconds, "eval_perplexity": prefix["perplexity"] if prefix else None,
            "results_applied": summary.get("results_applied"), "goodput": summary.get("goodput", {}).get("goodput")}


def run_child(*args: str, code: str | None = None, timeout: int = 1800) -> dict:
    # the islands (`python -m dipaco island`, started by the child) import the same code as the coordinator
    env = {**ENV, "PYTHONPATH": os.pathsep.join([code or str(ROOT), ENV.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           **({"BENCH_DIPACO_CODE": code} if code else {})}
    out = subprocess.run([sys.executable, __file__, "--child", *args], env=env, capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"child {args[0]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- the benchmark ----------------------------------------------------------------------------------------
def extract(ref: str, into: Path) -> Path:
    """The dipaco package of commit `ref` in `into` (git archive)."""
    archive = subprocess.run(["git", "archive", ref, "dipaco", "routing", "sharding"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def summarise(levels: list[int], variant: str, prep: dict, out: dict) -> dict:
    paths = 1
    for n in levels:
        paths *= n
    rounds = out["rounds"]
    last = rounds[-1]  # the steady state: round 1 includes the islands' start-up
    return {"grid": "x".join(map(str, levels)), "paths": paths, "code": variant, **prep, **out,
            "per_round": {"seconds": last["seconds"], "wall_seconds": last.get("wall_seconds"),
                          "ops_per_tick": last["store_ops_total"] / max(1, last["ticks"]), "phases": last["phases"], "store_ops": last["store_ops_total"],
                          "fsspec_calls": last["fsspec_calls"], "ticks": last["ticks"],
                          "bytes_read": last["bytes_read"], "bytes_written": last["bytes_written"],
                          "store_ops_per_path": last["store_ops_total"] / paths,
                          "phase_ms_per_path": {k: 1000 * v / paths for k, v in last["phases"].items()}}}


def markdown(records: list[dict], args) -> str:
    from bench.recording import markdown_table

    rows = []
    for r in records:
        p = r["per_round"]
        ph = p["phases"]
        rows.append([r["grid"], r["paths"], r["code"], p["ticks"], f"{p['seconds']:.2f}",
                     f"{1000 * (p['seconds'] - ph['other']) / r['paths']:.1f}",
                     " / ".join(f"{ph[k]:.2f}" for k in PHASES), p["store_ops"], f"{p['store_ops_per_path']:.1f}",
                     p["fsspec_calls"], f"{p['bytes_read'] / MIB:.2f} / {p['bytes_written'] / MIB:.2f}",
                     f"{r['coordinator_peak_bytes'] / MIB:.0f}", f"{r['island_peak_bytes'] / MIB:.0f}",
                     f"{r['route_seconds']:.0f} / {r['shard_seconds']:.0f} / {r['train_seconds']:.0f} / "
                     f"{r['eval_seconds']:.0f}"])
    ops = []
    for r in records:
        last = r["rounds"][-1]["store_ops"]
        ops.append([r["grid"], r["code"], *(last[op] for op in STORE_OPS)])
    return "\n".join([
        "# 256 paths: the coordinator's round and the store (bench/bench_grid256.py)",
        "",
        f"Sync rounds of tiny paths (hidden 16, one block per level, {args.rounds} rounds, {args.islands} local island "
        "processes, 2 inner steps of 2 x 32 tokens), the whole bundled corpus (~14k documents; ~50 per path at "
        "16x16: a systems benchmark, not a quality one). Per round: the last round (round 1 includes the islands' "
        "start-up); `round s` is the coordinator's time inside its ticks from the round's first tick to its commit (not "
        "the sleeps between ticks); `other` is the policy, assigning tasks and the lease. `coordinator ms/path` is the round's time spent in the "
        "coordinator's own work (every phase but `other`) per path: flat when a round's cost is linear in the paths.",
        "",
        markdown_table(["grid", "paths", "code", "ticks", "round s", "coordinator ms/path",
                        "heartbeats / results / outer / write / commit / board / other s", "store ops",
                        "ops/path", "fsspec calls", "MiB read / written", "coordinator peak MiB",
                        "island peak MiB", "route / shard / train / eval s"], rows),
        "",
        "Store operations of the last round, by kind:",
        "",
        markdown_table(["grid", "code", *STORE_OPS], ops),
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grids", nargs="+", default=["2x2", "4x4", "16x16"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--islands", type=int, default=4)
    parser.add_argument("--before-ref", default=None, help="also run the dipaco code of this commit, side by side")
    parser.add_argument("--name", default="grid256")
    parser.add_argument("--child", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.child:
        what, *rest = args.child
        out = child_prepare(rest[0], rest[1:]) if what == "prepare" else child_train(rest[0])
        print(json.dumps(out))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from bench.recording import write_results

    records = []
    with tempfile.TemporaryDirectory(prefix="bench-grid256-") as tmp:
        variants = [("this", None)]
        if args.before_ref:
            variants.insert(0, (f"before ({args.before_ref})", str(extract(args.before_ref, Path(tmp) / "before"))))
        for grid in args.grids:
            levels = [int(n) for n in grid.split("x")]
            prepared = Path(tmp) / f"grid-{grid}"
            prep = run_child("prepare", str(prepared), *grid_config(levels, rounds=args.rounds, islands=args.islands))
            log.info("%s routed in %.0fs, sharded in %.0fs", grid, prep["route_seconds"], prep["shard_seconds"])
            for variant, code in variants:
                run_dir = Path(tmp) / f"run-{grid}-{len(records)}"
                shutil.copytree(prepared, run_dir)
                out = run_child("train", str(run_dir), code=code)
                records.append(summarise(levels, variant, prep, out))
                p = records[-1]["per_round"]
                log.info("%s %s: round %.2fs, %d store ops, %d fsspec calls, coordinator peak %.0f MiB",
                         grid, variant, p["seconds"], p["store_ops"], p["fsspec_calls"],
                         out["coordinator_peak_bytes"] / MIB)
                shutil.rmtree(run_dir)
    results = {"settings": {"grids": args.grids, "rounds": args.rounds, "islands": args.islands,
                            "overrides": OVERRIDES, "before_ref": args.before_ref}, "runs": records}
    write_results(args.name, results, markdown(records, args))


if __name__ == "__main__":
    main()
