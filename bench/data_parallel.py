"""Non-elastic data parallel as real processes, paced as the islands: the benchmark's data-parallel row.

    python bench/data_parallel.py --config configs/demo.yaml --run runs/bench-islands/base-r20 \\
        --workers 8 --steps 200 --horizon 400 --step-seconds 2 --mtbf 30 --return-after 3 --out runs/dp
    # bench/bench_islands.py runs it in one call: run_data_parallel(...)

`workers` processes of one thread (torch.distributed, gloo on loopback) train the path model of a routed
run on the whole corpus, one synchronous step at a time: every worker computes a forward and backward
pass on its own batch (`inner.batch_size` sequences), the gradients are all-reduced and every worker
steps AdamW; then the step is padded to `--step-seconds` by sleeping (`dipaco.islands.island.pacing.Pacer`,
the islands' own pacing). Every `--checkpoint-steps` steps worker 0 writes the model and optimizer
state. Failures are the islands' (`dipaco.islands.island.faults.FaultClock`, seeded by `run.seed` and
the worker's island name `island-<rank>`, the same MTBF and return time): a worker fails as the steps
run, padding included (its step is cut there), and the job is non-elastic: when any worker is down
everyone stops (the step in progress is lost), waits until the last failed worker is back (a failure
meanwhile extends the wait), and every worker restarts from the last checkpoint. The job ends after
`--steps` steps or at `--horizon` seconds of wall-clock, whichever is first.

Goodput = useful step seconds (steps not rolled back, each its paced duration) / wall-clock seconds from
the first step's start to the end: the same for every worker, so useful × workers / (workers × wall),
as `dipaco simulate`'s data parallel (docs/islands.md#goodput). Writes `<out>/data-parallel.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dipaco.islands.island.pacing import SLICE, Pacer  # noqa: E402

Agreement = Callable[[tuple[float, float, float]], list[tuple[float, float, float]]]


class WorkerDown(Exception):
    """Raised inside a step when this worker's injected failure is due."""


@dataclass
class Ledger:
    """Where the job's wall-clock went (seconds, the same for every worker)."""

    useful: float = 0.0  # steps that survive: checkpointed, or done when the job ended
    pending: float = 0.0  # steps since the last checkpoint (lost if a failure comes first)
    lost: float = 0.0  # steps rolled back, and the step a failure cut
    down: float = 0.0  # waiting for failed workers to come back
    overhead: float = 0.0  # writing checkpoints, restoring them
    steps: int = 0  # steps that survive
    failures: int = 0  # failures of any worker
    restarts: int = 0  # times the job restarted from its checkpoint
    wall: float = 0.0

    def step(self, seconds: float) -> None:
        self.pending += seconds

    def checkpoint(self) -> None:
        self.useful += self.pending
        self.pending = 0.0

    def roll_back(self, cut: float) -> None:
        """A failure: the steps since the checkpoint and the `cut` seconds of the step in progress are lost."""
        self.lost += self.pending + cut
        self.pending = 0.0
        self.restarts += 1

    @property
    def goodput(self) -> float:
        return self.useful / self.wall if self.wall > 0 else 0.0


@dataclass
class Job:
    """One worker's side of the job; `agree` combines every worker's (back at, failures, now) once per
    step and per wait (all of them call it in the same order: a collective)."""

    faults: object  # `FaultClock`-like: due(), fail(), return_after
    pacer: Pacer
    agree: Agreement
    train_step: Callable[[], None]  # forward, backward, gradient all-reduce, optimizer step
    save: Callable[[int], None]  # write the checkpoint of step n (every worker calls it; one writes)
    restore: Callable[[], int]  # load the last checkpoint; returns its step
    checkpoint_steps: int
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    ledger: Ledger = field(default_factory=Ledger)

    def run(self, *, steps: int, horizon: float) -> Ledger:
        """Train until `steps` steps survive or `horizon` seconds have passed."""
        ledger = self.ledger
        start = max(now for _, _, now in self.agree((0.0, 0.0, self.clock())))  # one start for every worker
        end = start + horizon
        done = 0
        while done < steps:
            began = self.clock()
            back, failures, now = self._step()
            if failures == 0:
                ledger.step(self.clock() - began)
                done += 1
                if done % max(1, self.checkpoint_steps) == 0 and done < steps:
                    saving = self.clock()
                    self.save(done)
                    ledger.checkpoint()
                    ledger.overhead += self.clock() - saving
                if now >= end:
                    break
                continue
            ledger.failures += failures
            ledger.roll_back(self.clock() - began)
            if not self._wait_out(back, end=end):
                break
            restoring = self.clock()
            done = self.restore()
            ledger.overhead += self.clock() - restoring
        ledger.checkpoint()  # the job ended: its last steps survive
        ledger.steps = done
        ledger.wall = self.clock() - start
        return ledger

    def _step(self) -> tuple[float, int, float]:
        """One step, its padding, then the agreement: (back at, failures, latest clock) over all workers."""
        failed_at: float | None = None

        def check() -> None:
            nonlocal failed_at
            if failed_at is None and self.faults.due():
                self.faults.fail()
                failed_at = self.clock()
                raise WorkerDown

        began = self.clock()
        try:
            check()  # before the step, as an island
        except WorkerDown:
            pass
        self.train_step()  # even when down: its collectives need every worker (the result is thrown away)
        if failed_at is None:
            try:
                self.pacer.pad(self.clock() - began, check=check)
            except WorkerDown:
                pass
        own = (failed_at + self.faults.return_after, 1.0, self.clock()) if failed_at is not None else (0.0, 0.0, self.clock())
        agreed = self.agree(own)
        return max(a[0] for a in agreed), int(sum(a[1] for a in agreed)), max(a[2] for a in agreed)

    def _wait_out(self, back: float, *, end: float) -> bool:
        """Every worker waits until the last failed one is back (a failure meanwhile extends the wait);
        False when the horizon comes first. Every worker decides alike: `back` and `end` are agreed."""
        waiting = self.clock()
        try:
            while True:
                until = min(back, end)
                own, failures = 0.0, 0.0
                while (now := self.clock()) < until:
                    if self.faults.due():
                        self.faults.fail()
                        own, failures = max(own, now + self.faults.return_after), failures + 1
                    self.sleep(min(SLICE, until - now))
                agreed = self.agree((own, failures, self.clock()))
                self.ledger.failures += int(sum(a[1] for a in agreed))
                if until >= end:
                    return False
                later = max(a[0] for a in agreed)
                if later <= back:
                    return True
                back = later
        finally:
            self.ledger.down += self.clock() - waiting


# --- the real processes ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """What every worker process is told (written as JSON by the launcher)."""

    config: str
    run: str  # a routed and sharded run directory (its tokenizer, shards)
    overrides: list[str]
    workers: int
    steps: int
    horizon: float
    step_seconds: float
    mtbf: float
    return_after: float
    checkpoint_steps: int
    out: str
    port: int


def worker(spec: Spec, rank: int) -> None:
    """Worker `rank` of the job: builds the model and data, joins the process group, runs `Job`, writes
    `<out>/worker-<rank>.json`."""
    import torch
    import torch.distributed as dist

    from dipaco.config import load_config
    from dipaco.islands.island.faults import FaultClock
    from dipaco.optim.inner import lr_at, make_optimizer
    from dipaco.pipeline.context import PathFactory
    from dipaco.run_dir import RunDir

    torch.set_num_threads(1)
    config = load_config(spec.config, spec.overrides)
    factory = PathFactory(config, RunDir(spec.run))
    model = factory.new_model(seed=config.run.seed)
    optimizer = make_optimizer(model, config.inner)
    params = [p for p in model.parameters() if p.requires_grad]
    batches = factory.reader.iter_batches(None, "train", batch_size=config.inner.batch_size,
                                          seed=config.run.seed * 1_000_003 + rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec.port}", rank=rank, world_size=spec.workers)
    checkpoint = Path(spec.out) / "checkpoint.pt"
    state = {"step": 0}
    losses: list[float] = []

    def train_step() -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(state["step"], config=config.inner, total_steps=spec.steps)
        input_ids = torch.as_tensor(next(batches), dtype=torch.long)  # (B, T)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # every gradient, one all-reduce
        dist.all_reduce(flat)
        flat /= spec.workers
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        if config.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, config.inner.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] += 1
        losses.append(float(loss))

    def save(step: int) -> None:
        if rank == 0:
            torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()},
                       checkpoint.with_suffix(".tmp"))
            os.replace(checkpoint.with_suffix(".tmp"), checkpoint)
        dist.barrier()

    def restore() -> int:
        saved = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state["step"] = saved["step"]
        return saved["step"]

    def agree(own: tuple[float, float, float]) -> list[tuple[float, float, float]]:
        gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(spec.workers)]
        dist.all_gather(gathered, torch.tensor(own, dtype=torch.float64))
        return [tuple(t.tolist()) for t in gathered]

    save(0)
    faults = FaultClock(mtbf=spec.mtbf, return_after=spec.return_after, mode="die", seed=config.run.seed,
                        island=f"island-{rank}")
    pacer = Pacer(step_seconds=spec.step_seconds)
    job = Job(faults=faults, pacer=pacer, agree=agree, train_step=train_step, save=save, restore=restore,
              checkpoint_steps=spec.checkpoint_steps)
    ledger = job.run(steps=spec.steps, horizon=spec.horizon)
    dist.barrier()
    dist.destroy_process_group()
    out = {"rank": rank, "ledger": asdict(ledger), "goodput": ledger.goodput, "own_failures": faults.failures,
           "pace": {"steps": pacer.steps, "compute": pacer.compute, "padding": pacer.padding,
                    "slowest": pacer.slowest, "over_pace": pacer.over_pace},
           "loss_first": losses[:5], "loss_last": losses[-5:],
           "tokens_per_step": config.inner.batch_size * factory.reader.seq_len}
    (Path(spec.out) / f"worker-{rank}.json").write_text(json.dumps(out, indent=1) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_data_parallel(*, config: str, run: str, overrides: Sequence[str], workers: int, steps: int, horizon: float,
                      step_seconds: float, mtbf: float, return_after: float, checkpoint_steps: int, out: Path,
                      env: dict | None = None) -> dict:
    """Start the `workers` processes, wait for them, and combine what they wrote: worker 0's ledger (the
    same for all), every worker's pace; returns and writes `<out>/data-parallel.json`."""
    out.mkdir(parents=True, exist_ok=True)
    spec = Spec(config=str(config), run=str(run), overrides=list(overrides), workers=workers, steps=steps,
                horizon=horizon, step_seconds=step_seconds, mtbf=mtbf, return_after=return_after,
                checkpoint_steps=checkpoint_steps, out=str(out), port=free_port())
    (out / "spec.json").write_text(json.dumps(asdict(spec), indent=1) + "\n")
    env = {**(env or os.environ), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = []
    for rank in range(workers):
        with open(out / f"worker-{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(rank), "--spec", str(out / "spec.json")],
                                          cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        bad = next(rank for rank, code in enumerate(codes) if code)
        tail = (out / f"worker-{bad}.log").read_text()[-3000:]
        raise RuntimeError(f"data-parallel worker {bad} exited with {codes[bad]}:\n{tail}")
    ranks = [json.loads((out / f"worker-{r}.json").read_text()) for r in range(workers)]
    ledger = ranks[0]["ledger"]
    paces = [r["pace"] for r in ranks]
    result = {
        "workers": workers, "steps": steps, "horizon": horizon, "step_seconds": step_seconds, "mtbf": mtbf,
        "return_after": return_after, "checkpoint_steps": checkpoint_steps, "ledger": ledger,
        "goodput": ranks[0]["goodput"], "own_failures": [r["own_failures"] for r in ranks],
        "tokens_per_second": ledger["steps"] * workers * ranks[0]["tokens_per_step"] / ledger["wall"],
        "pace": {"steps": sum(p["steps"] for p in paces), "compute": sum(p["compute"] for p in paces),
                 "padding": sum(p["padding"] for p in paces), "slowest": max(p["slowest"] for p in paces),
                 "over_pace": sum(p["over_pace"] for p in paces)},
        "loss_first": ranks[0]["loss_first"], "loss_last": ranks[0]["loss_last"],
    }
    (out / "data-parallel.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    parser.add_argument("--run", help="a routed and sharded run directory")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--horizon", type=float, default=float("inf"), help="wall-clock seconds at most")
    parser.add_argument("--step-seconds", type=float, default=2.0)
    parser.add_argument("--mtbf", type=float, default=0.0, help="per worker, seconds (0: no failures)")
    parser.add_argument("--return-after", type=float, default=3.0)
    parser.add_argument("--checkpoint-steps", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "runs" / "data-parallel"))
    parser.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(Spec(**json.loads(Path(args.spec).read_text())), args.worker)
        return
    result = run_data_parallel(config=args.config, run=args.run, overrides=args.overrides, workers=args.workers,
                               steps=args.steps, horizon=args.horizon, step_seconds=args.step_seconds, mtbf=args.mtbf,
                               return_after=args.return_after, checkpoint_steps=args.checkpoint_steps, out=Path(args.out))
    print(json.dumps({k: v for k, v in result.items() if k != "own_failures"}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
