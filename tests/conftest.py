"""Shared test setup: offline Hugging Face, one torch thread, and the tiny runs several modules read.

    make test          # everything but the tests marked slow
    make test-slow     # the slow ones: kill / pause and resume, a re-routing phase, torchrun islands (one and two nodes)

Session fixtures (built once per worker process, on first use; `tiny_trained` once for all `make test`'s
pytest-xdist workers; tests that write into a run work on a `copy_run` of it):
- `tiny_routed`: configs/tiny.yaml routed and sharded through the Python API (tokenizer, routing,
  shards); test_coordinator and test_end_to_end start their own training from it;
- `tiny_straight`: a copy of it trained for two rounds by the real coordinator and islands in this
  process (tests/tiny_runs.py), the modules that resumed, S3 and Ray runs must end with;
- `tiny_trained`: a copy of it through the rest of `dipaco run` (train with real island processes,
  baselines, eval, report; the command's entry point called in this process), with the settings
  test_end_to_end and test_routed_inference both need (`TRAINED_OVERRIDES`);
- `tiny_mixture`: `tiny_trained` exported whole (`dipaco export --baselines --per-path`), then moved elsewhere and the
  original deleted, so what the mixture, harness and server tests load stands alone;
- `s3_env`: moto's S3 server (tests/s3_server.py), for the S3 store tests and the kill tests on S3.

The models here are tiny: a second torch thread costs more than it gains, and on a loaded machine
oversubscribed threads make a training step many times slower, so every process uses one.
"""

import os
import shutil
from pathlib import Path

import pytest
from cli_helpers import ROOT, TINY, copy_run, dipaco_in_process

from dipaco.run_dir import RunDir

# before anything imports huggingface_hub or datasets; subprocesses inherit it. PYTHONPATH: every
# `python -m dipaco` a test starts, directly or as an island, runs this checkout whatever its directory
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
for var in ("DIPACO_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")
NO_CUDA = pytest.StashKey[int]()  # how many `cuda` tests were deselected for want of a device


def pytest_configure(config):
    import torch

    torch.set_num_threads(1)


@pytest.hookimpl(trylast=True)  # after `-m` has deselected what it does (the slow cuda test)
def pytest_collection_modifyitems(config, items):
    """Where torch sees no CUDA device, the tests marked `cuda` are deselected (counted in the summary and
    named by `pytest_terminal_summary`) rather than reported as skipped: after `make install` no test skips,
    so a skip means a missing dependency (.ci/run fails on one). `-m` naming cuda (`pytest -m cuda`) keeps
    them, and there they skip with the reason."""
    import torch

    if "cuda" in (config.option.markexpr or "") or torch.cuda.is_available():
        return
    cuda = [item for item in items if item.get_closest_marker("cuda")]
    if cuda:
        config.hook.pytest_deselected(items=cuda)
        items[:] = [item for item in items if not item.get_closest_marker("cuda")]
        config.stash[NO_CUDA] = len(cuda)


# `make test` runs on parallel workers (pytest-xdist, `-n auto --dist loadfile`): each worker is a process with
# its own session fixtures, and takes whole files (a module fixture, such as a trained result or a Ray cluster, is
# built once). The costliest session fixtures, the routed and the trained run, are built once for all of them
# (`built_once`).
def built_once(tmp_path_factory, name: str, build) -> Path:
    """`build(folder)` done once per test session, also across xdist workers: the first worker that needs it
    builds it under a lock in the folder the workers share, the others wait for it and read it."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # pytest-N/, above popen-gwK/
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that failed in another worker
            build(folder)
            done.touch()
    return folder


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: the count goes to the controller's summary
        session.config.workeroutput["cuda_deselected"] = session.config.stash.get(NO_CUDA, 0)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """An xdist worker finished: the controller keeps the count of cuda tests it deselected (each worker
    collects every test, so the counts are the same)."""
    node.config.stash[NO_CUDA] = node.workeroutput.get("cuda_deselected", 0) if hasattr(node, "workeroutput") else 0


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if config.stash.get(NO_CUDA, 0):
        terminalreporter.write_line(f"{config.stash[NO_CUDA]} tests marked cuda deselected: torch sees no CUDA "
                                    f"device (`pytest -m cuda` runs them where there is one)")


# 3 rounds with one module version kept, so pruning has to keep each path's best version; every eval mode
TRAINED_OVERRIDES = ["run.rounds=3", "store.keep_versions=1", "eval.best=true",
                     "eval.modes=[prefix,every:16,every:64,oracle,oracle-split,all-paths]"]


@pytest.fixture(scope="session")
def s3_env():
    """moto's S3 server on loopback (tests/s3_server.py), one for the session: its environment variables
    (AWS_ENDPOINT_URL, credentials) stay set from the first test that uses it to the session's end."""
    from s3_server import moto_server

    with moto_server() as env:
        yield env


@pytest.fixture(scope="session")
def tiny_routed(tmp_path_factory) -> RunDir:
    """configs/tiny.yaml after `dipaco route` and `dipaco shard` (read only: copy it to write); built once for
    all the xdist workers."""
    from dipaco.config import load_config
    from dipaco.stages.route import route
    from dipaco.stages.shard import shard

    def build(folder: Path) -> None:
        (folder / "run").mkdir(parents=True)
        config, run = load_config(TINY), RunDir(folder / "run")
        route(config, run)
        shard(config, run)

    return RunDir(built_once(tmp_path_factory, "tiny-routed", build) / "run")


@pytest.fixture(scope="session")
def tiny_straight(tiny_routed, tmp_path_factory):
    """`tiny_routed` trained for configs/tiny.yaml's two rounds by two islands in this process (tests/tiny_runs.py;
    a `TinyRun`, read only): the reference run that the resumed, S3 and Ray runs end equal to."""
    from tiny_runs import Clock, drive, make_run

    clock = Clock()
    run = make_run(tiny_routed, tmp_path_factory.mktemp("tiny-straight") / "run", [])
    drive(run.coordinator(clock), [run.island(f"i{k}", clock) for k in range(2)], clock)
    return run


@pytest.fixture(scope="session")
def tiny_trained(tiny_routed, tmp_path_factory) -> RunDir:
    """`tiny_routed` through the rest of `dipaco run` with `TRAINED_OVERRIDES` (read only; built once for all
    the xdist workers)."""
    def train(folder: Path) -> None:
        run = copy_run(tiny_routed, folder / "run")
        code, log = dipaco_in_process("run", "--config", TINY, "--run", run.root, *TRAINED_OVERRIDES)
        assert code == 0, f"dipaco run failed:\n{log[-3000:]}"

    return RunDir(built_once(tmp_path_factory, "tiny-trained", train) / "run")


@pytest.fixture(scope="session")
def tiny_mixture(tiny_trained, tmp_path_factory):
    """`tiny_trained` as one mixture directory with its dense baselines, moved after the export (read only);
    exported once for all xdist workers (`built_once`)."""
    from dipaco.cli import main

    def export(folder: Path) -> None:
        out = tmp_path_factory.mktemp("export") / "mixture"
        assert main(["export", str(out), "--run", str(tiny_trained.root), "--baselines", "--per-path"]) == 0
        shutil.copytree(out, folder / "mixture")
        shutil.rmtree(out)

    return built_once(tmp_path_factory, "tiny-mixture", export) / "mixture"
