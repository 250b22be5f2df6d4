"""The CUDA path checked end to end in one command, with one table of results.

    make gpu-check                          # = python bench/gpu_check.py; needs a CUDA device
    python bench/gpu_check.py --smoke       # the same steps on the CPU with tiny settings (no GPU needed)
    python bench/gpu_check.py --only torch,torchrun

The checks, in order; each is timed, and a failing one does not stop the others:
  torch     what torch reports: GPU name and count, compute capability, memory, bf16 support, NCCL,
            torch and CUDA versions.
  pipeline  `dipaco run --config configs/demo.yaml` (the whole demo as `make demo` runs it: 8 rounds,
            both baselines, every eval mode) with hardware.device=cuda hardware.precision=auto.
            Every perplexity in eval.json must be finite.
  torchrun  a `torchrun` island on configs/tiny.yaml in fp32: 2 processes with NCCL when 2 GPUs exist,
            1 otherwise (NCCL needs one GPU per rank). Its pseudo-gradient for the task (round 1,
            path 0) must equal one process's within a relative L2 difference of 1e-2 (reduction
            order and cuBLAS kernels differ with the batch split; a wrong split is off by O(1)).
  compile   `dipaco run` on configs/tiny.yaml for 2 rounds with hardware.compile on: losses and
            perplexities finite.
  speed     `python bench/bench_speed.py --device cuda --name speed-cuda` (results in
            bench/results/speed-cuda, next to the CPU's speed). Skipped, with a note, when the script
            is absent or takes no --device option.

Prints the table (check, result, seconds, detail) and writes it to bench/results/gpu_check.{json,md}
through bench/recording.py, with the machine. Run directories and one log per check go to
runs/gpu-check/. Budget: under 10 minutes on one modern GPU (the demo's route and shard stages run
on the CPU: about a minute on 16 cores). Exit status: 0 when every check passed or was skipped, 1 when
one failed, 2 when torch sees no CUDA device and --smoke was not given.

--smoke runs the same steps on the CPU, in about 5 minutes on 2 cores: the pipeline on the tiny
config for 1 round without baselines, a 2-process gloo island, compile on the tiny config, and for
the speed benchmark only its `--help` (the CPU measurement is `python bench/bench_speed.py`). It
writes bench/results/gpu_check_smoke.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.gpu_commands import Failed, dipaco, environment, run_command, start, stop, tail  # noqa: E402
from bench.recording import write_results  # noqa: E402
from dipaco.config import PRECISIONS, load_config  # noqa: E402
from dipaco.run_dir import RunDir  # noqa: E402

if TYPE_CHECKING:
    from dipaco.islands.coordinator.service import Coordinator
    from dipaco.islands.island.training import TrainedTask
    from dipaco.store.module_store import ModuleStore

log = logging.getLogger("gpu_check")

DEMO = ROOT / "configs" / "demo.yaml"
TINY = ROOT / "configs" / "tiny.yaml"
SPEED = ROOT / "bench" / "bench_speed.py"
SMOKE_PIPELINE = ["run.rounds=1", "eval.baselines=false", "eval.modes=[prefix]"]
TIMEOUTS = {"pipeline": 480, "torchrun": 240, "compile": 300, "speed": 360}  # seconds on CUDA; x3 for --smoke


class Skip(Exception):
    """The check cannot run here; the message says why."""


@dataclass(frozen=True)
class Outcome:
    check: str
    result: str  # ok | FAIL | skip
    seconds: float
    detail: str


@dataclass(frozen=True)
class Plan:
    """What the checks run: on CUDA, or on the CPU with tiny settings (`smoke`)."""

    smoke: bool
    work: Path  # run directories and logs
    gpus: int  # CUDA devices torch sees
    compile_value: str = "true"  # the value given to hardware.compile

    @property
    def device(self) -> str:
        return "cpu" if self.smoke else "cuda"

    @property
    def pipeline_config(self) -> Path:
        return TINY if self.smoke else DEMO

    @property
    def pipeline_overrides(self) -> list[str]:
        return SMOKE_PIPELINE if self.smoke else []

    @property
    def ranks(self) -> int:
        """torchrun processes: 2 with gloo on the CPU; on CUDA one per GPU, at most 2."""
        return 2 if self.smoke else max(1, min(2, self.gpus))

    @property
    def tolerance(self) -> float:
        """Largest relative L2 difference between the torchrun and the 1-process pseudo-gradient."""
        return 1e-3 if self.smoke else 1e-2

    def timeout(self, check: str) -> float:
        return TIMEOUTS[check] * (3 if self.smoke else 1)


def fresh_run(root: Path) -> RunDir:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    return RunDir(root)


# --- what the checks read --------------------------------------------------------------------------
def torch_report() -> dict:
    """What torch reports about CUDA (and the CPU) on this machine."""
    import torch.distributed as dist

    report = {"torch": torch.__version__, "cuda_build": torch.version.cuda,
              "cuda_available": torch.cuda.is_available(), "gpus": torch.cuda.device_count(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "nccl_available": dist.is_available() and dist.is_nccl_available()}
    if report["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        report |= {"device": props.name, "capability": f"{props.major}.{props.minor}",
                   "memory_gib": round(props.total_memory / 2**30, 1), "bf16": torch.cuda.is_bf16_supported(),
                   "cudnn": torch.backends.cudnn.version()}
        if report["nccl_available"]:
            version = torch.cuda.nccl.version()
            report["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return report


def describe_torch(report: dict) -> str:
    versions = f"torch {report['torch']}, CUDA build {report['cuda_build'] or 'none'}"
    if not report["cuda_available"]:
        return f"no CUDA device; {versions}; CPU capability {report['cpu_capability']}"
    nccl = f"NCCL {report['nccl']}" if report.get("nccl") else "no NCCL"
    return (f"{report['gpus']} x {report['device']} (capability {report['capability']}, {report['memory_gib']} GiB), "
            f"bf16 {'yes' if report['bf16'] else 'no'}, {nccl}, {versions}, cuDNN {report['cudnn']}")


def precision_setting(device: str) -> tuple[str, str]:
    """(the value for hardware.precision, a note): `auto` where this dipaco takes it, else what auto
    would pick (bf16 on a GPU that has it, fp32 elsewhere)."""
    if "auto" in PRECISIONS:
        from dipaco import device as device_mod

        resolve = getattr(device_mod, "resolve_precision", None)
        chosen = resolve("auto", torch.device(device)) if resolve else "?"
        return "auto", f"precision auto -> {chosen}"
    fallback = "bf16" if device == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return fallback, f"this dipaco has no precision auto (precisions {list(PRECISIONS)}); used {fallback}"


def device_overrides(device: str, precision: str) -> list[str]:
    return [f"hardware.device={device}", f"hardware.precision={precision}"]


def finite_perplexities(run: RunDir) -> dict[str, float]:
    """Each model's perplexity from the run's eval.json; Failed when any perplexity there is not finite."""
    if not run.eval_results.exists():
        raise Failed(f"{run.eval_results} was not written")
    results = json.loads(run.eval_results.read_text())
    models = {m["model"]: m["perplexity"] for m in results["models"]}
    paths = {f"path {p['path']}": p["perplexity"] for p in results.get("per_path", []) if p.get("documents")}
    bad = {name: value for name, value in {**models, **paths}.items()
           if not isinstance(value, (int, float)) or not math.isfinite(value)}
    if not models or bad:
        raise Failed(f"perplexities not finite in {run.eval_results}: {bad or 'no models'}")
    return models


def pseudo_gradient_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(relative L2 difference |a - b| / |b| over all tensors, largest absolute difference)."""
    if a.keys() != b.keys():
        raise Failed(f"the pseudo-gradients name different tensors: {sorted(a.keys() ^ b.keys())[:4]}")
    diff = torch.cat([(a[k].float().cpu() - b[k].float().cpu()).flatten() for k in b])
    ref = torch.cat([b[k].float().cpu().flatten() for k in b])
    return (diff.norm() / ref.norm().clamp_min(1e-30)).item(), diff.abs().max().item()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the checks ------------------------------------------------------------------------------------
def check_torch(plan: Plan) -> str:
    report = torch_report()
    if not plan.smoke and not report["nccl_available"]:
        raise Failed(f"this torch has no NCCL: {describe_torch(report)}")
    return describe_torch(report)


def check_pipeline(plan: Plan) -> str:
    precision, note = precision_setting(plan.device)
    run = fresh_run(plan.work / "pipeline")
    overrides = [*device_overrides(plan.device, precision), *plan.pipeline_overrides]
    run_command(dipaco("run", "--config", str(plan.pipeline_config), "--run", str(run.root), *overrides),
                log_file=plan.work / "pipeline.log", timeout=plan.timeout("pipeline"))
    shown = ", ".join(f"{name} {ppl:.2f}" for name, ppl in finite_perplexities(run).items())
    config = " ".join([plan.pipeline_config.name, *plan.pipeline_overrides])
    return f"{config}: perplexity {shown}; {note}"


def one_process_task(plan: Plan, run: RunDir) -> tuple[ModuleStore, Coordinator, TrainedTask]:
    """The tiny run routed, sharded and initialised in `run`, a coordinator with round 1's tasks open,
    and one process's training of the task (round 1, path 0), which writes nothing."""
    from dipaco.islands.coordinator.service import Coordinator, CoordinatorSettings
    from dipaco.islands.island.training import train_task
    from dipaco.pipeline.context import PathFactory
    from dipaco.pipeline.version_zero import start_or_resume_store
    from dipaco.stages.island import island_setup
    from dipaco.stages.route import route
    from dipaco.stages.shard import shard
    from dipaco.store.records import task_key

    config = load_config(TINY, [f"hardware.device={plan.device}", "hardware.precision=fp32"])
    route(config, run)
    shard(config, run)
    start_or_resume_store(PathFactory(config, run))
    setup = island_setup(config, run)
    coordinator = Coordinator(setup.store, setup.topology, settings=CoordinatorSettings.from_config(config),
                              sizes=PathFactory(config, run).path_sizes)
    coordinator.tick()
    return setup.store, coordinator, train_task(setup, coordinator.tasks[task_key(0, 0)])


def run_torchrun_island(plan: Plan, run: RunDir, store: ModuleStore, coordinator: Coordinator) -> None:
    """`torchrun --nproc-per-node <ranks> -m dipaco -- island` pinned to path 0 for one task, with the
    coordinator ticking until its result is in the store."""
    from dipaco.store.board import result_exists

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(plan.ranks), "--master-port",
           str(free_port()), "-m", "dipaco", "--", "island", "--config", str(run.config), "--run", str(run.root),
           "--pull", "--path", "0", "--name", "torchrun", "--max-tasks", "1"]
    log_file = plan.work / "torchrun.log"
    proc = start(cmd, log_file, threads=1 if plan.smoke else 0)  # 2 ranks share the CPU's cores in --smoke
    deadline = time.monotonic() + plan.timeout("torchrun")
    try:
        while not result_exists(store, round=1, path=0, attempt=0):
            if proc.poll() is not None:
                raise Failed(f"torchrun exited with {proc.returncode} before reporting; log {log_file}: {tail(log_file)}")
            if time.monotonic() > deadline:
                raise Failed(f"no result after {plan.timeout('torchrun'):.0f}s; log {log_file}")
            coordinator.tick()
            time.sleep(0.2)
        code = proc.wait(timeout=max(30.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise Failed(f"torchrun reported but did not exit; log {log_file}: {tail(log_file)}") from None
    finally:
        stop(proc)
    if code:
        raise Failed(f"torchrun exited with {code} after reporting; log {log_file}: {tail(log_file)}")


def check_torchrun(plan: Plan) -> str:
    """A torchrun island's pseudo-gradient for one task against one process's, as
    tests/test_coordinator.py does with gloo on the CPU."""
    from dipaco.store.board import read_result

    run = fresh_run(plan.work / "torchrun")
    store, coordinator, single = one_process_task(plan, run)
    run_torchrun_island(plan, run, store, coordinator)
    tensors, meta = read_result(store, round=1, path=0, attempt=0)
    if meta.data_parallel_ranks != plan.ranks or meta.tokens != single.meta.tokens:
        raise Failed(f"the island ran {meta.data_parallel_ranks} ranks on {meta.tokens} tokens; expected "
                     f"{plan.ranks} ranks on the 1-process run's {single.meta.tokens}")
    relative, largest = pseudo_gradient_difference(tensors, single.pseudo_gradient)
    backend = "gloo" if plan.smoke else ("NCCL" if plan.ranks > 1 else "no collective: 1 GPU")
    summary = (f"{plan.ranks} process(es) ({backend}), fp32, tiny: pseudo-gradient differs from 1 process by "
               f"{relative:.1e} relative L2 (max abs {largest:.1e}; tolerance {plan.tolerance:.0e})")
    if not relative <= plan.tolerance:
        raise Failed(summary)
    return summary


def check_compile(plan: Plan) -> str:
    precision, note = precision_setting(plan.device)
    run = fresh_run(plan.work / "compile")
    overrides = [*device_overrides(plan.device, precision), f"hardware.compile={plan.compile_value}", "run.rounds=2",
                 "eval.baselines=false", "eval.modes=[prefix]"]
    run_command(dipaco("run", "--config", str(TINY), "--run", str(run.root), *overrides),
                log_file=plan.work / "compile.log", timeout=plan.timeout("compile"))
    rounds = json.loads(run.train_summary.read_text())["rounds"]
    losses = [loss for r in rounds for loss in r["train_loss"].values()]
    if not losses or not all(math.isfinite(loss) for loss in losses):
        raise Failed(f"train losses not finite with hardware.compile={plan.compile_value}: {losses}")
    model, ppl = next(iter(finite_perplexities(run).items()))
    return (f"tiny, 2 rounds, hardware.compile={plan.compile_value}: mean train loss "
            f"{mean(rounds[0]['train_loss'])} -> {mean(rounds[-1]['train_loss'])}, {model} perplexity {ppl:.2f}; {note}")


def mean(losses: dict[str, float]) -> str:
    return f"{sum(losses.values()) / len(losses):.3f}"


def check_speed(plan: Plan) -> str:
    if not SPEED.exists():
        raise Skip(f"bench/{SPEED.name} is not in this checkout")
    helped = subprocess.run([sys.executable, str(SPEED), "--help"], cwd=ROOT, env=environment(), capture_output=True,
                            text=True, timeout=120)
    if helped.returncode:
        raise Failed(f"`bench_speed.py --help` exited with {helped.returncode}: {helped.stderr.strip()[-300:]}")
    if "--device" not in helped.stdout:
        raise Skip("bench_speed.py takes no --device option; run it by hand")
    if plan.smoke:
        raise Skip("smoke: `bench_speed.py --help` works and takes --device; `python bench/bench_speed.py` "
                   "measures the CPU")
    args = ["--device", "cuda", *(["--name", "speed-cuda"] if "--name" in helped.stdout else [])]  # keeps the CPU's speed.json
    log_file = plan.work / "speed.log"
    run_command([sys.executable, str(SPEED), *args], log_file=log_file, timeout=plan.timeout("speed"))
    return f"bench_speed.py {' '.join(args)}: {tail(log_file, lines=2)}"


CHECKS: dict[str, Callable[[Plan], str]] = {"torch": check_torch, "pipeline": check_pipeline,
                                            "torchrun": check_torchrun, "compile": check_compile,
                                            "speed": check_speed}


def run_check(name: str, plan: Plan) -> Outcome:
    """One check, timed; its Skip, Failed or crash is its outcome, so the next check still runs."""
    log.info("== %s", name)
    started = time.perf_counter()
    try:
        result, detail = "ok", CHECKS[name](plan)
    except Skip as why:
        result, detail = "skip", str(why)
    except Failed as why:
        result, detail = "FAIL", str(why)
    except Exception as err:  # a crash in one check is that check's failure
        log.exception("check %s crashed", name)
        result, detail = "FAIL", f"{type(err).__name__}: {err}"
    outcome = Outcome(check=name, result=result, seconds=round(time.perf_counter() - started, 1), detail=detail)
    log.info("%s: %s (%.1fs) %s", name, result, outcome.seconds, detail)
    return outcome


# --- the table -------------------------------------------------------------------------------------
def format_outcomes(outcomes: list[Outcome]) -> str:
    """Fixed-width: check, result, seconds (right-aligned), detail."""
    rows = [["check", "result", "seconds", "detail"]] + [[o.check, o.result, f"{o.seconds:.1f}", o.detail]
                                                          for o in outcomes]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]

    def line(row: list[str]) -> str:
        return f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:>{widths[2]}}  {row[3]}".rstrip()

    return "\n".join([line(rows[0]), line(["-" * w for w in widths] + ["------"]), *map(line, rows[1:])])


def markdown(plan: Plan, outcomes: list[Outcome]) -> str:
    title = "# GPU check, smoke run on the CPU" if plan.smoke else "# GPU check"
    rows = "\n".join(f"| {o.check} | {o.result} | {o.seconds:.1f} | {o.detail.replace('|', '/')} |" for o in outcomes)
    total = sum(o.seconds for o in outcomes)
    return (f"{title}\n\n`python bench/gpu_check.py{' --smoke' if plan.smoke else ''}` "
            f"(bench/gpu_check.py says what each check runs): {total:.0f} s in all.\n\n"
            f"| check | result | seconds | detail |\n|---|---|---:|---|\n{rows}\n")


def no_cuda_message() -> str:
    return (f"gpu_check: no CUDA device. torch {torch.__version__} (CUDA build {torch.version.cuda or 'none'}) "
            f"reports torch.cuda.is_available() == False, so there is no GPU to check here.\n"
            f"`python bench/gpu_check.py --smoke` (or `make gpu-check ARGS=--smoke`) runs the same steps "
            f"on the CPU with tiny settings.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the same steps on the CPU with tiny settings")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated checks (default: {','.join(CHECKS)})")
    parser.add_argument("--work", type=Path, default=None,
                        help="run directories and logs (default: runs/gpu-check, runs/gpu-check-smoke)")
    parser.add_argument("--results", default=None,
                        help="results name in bench/results/ (default: gpu_check, gpu_check_smoke)")
    parser.add_argument("--compile-value", default="true", help="the value given to hardware.compile")
    args = parser.parse_args(argv)
    unknown = [name for name in args.only.split(",") if name not in CHECKS]
    if unknown:
        parser.error(f"--only {args.only}: unknown checks {unknown}; checks are {list(CHECKS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s",
                        datefmt="%H:%M:%S")
    if not args.smoke and not torch.cuda.is_available():
        print(no_cuda_message(), file=sys.stderr)
        return 2
    suffix = "-smoke" if args.smoke else ""
    plan = Plan(smoke=args.smoke, work=(args.work or ROOT / "runs" / f"gpu-check{suffix}").resolve(),
                gpus=torch.cuda.device_count(), compile_value=args.compile_value)
    outcomes = [run_check(name, plan) for name in args.only.split(",")]
    table = format_outcomes(outcomes)
    print(f"\n{table}")
    record = {"smoke": plan.smoke, "device": plan.device, "torch_report": torch_report(),
              "passed": all(o.result != "FAIL" for o in outcomes),
              "checks": [dataclasses.asdict(o) for o in outcomes]}
    path = write_results(args.results or f"gpu_check{suffix.replace('-', '_')}", record, markdown(plan, outcomes))
    print(f"results in {path} and {path.with_suffix('.md')}")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
