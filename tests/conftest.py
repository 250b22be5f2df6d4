"""Shared test setup: offline Hugging Face, one torch thread, and the tiny runs several modules read.

    make test          # everything but the tests marked slow
    make test-slow     # the slow ones: kill / pause and resume, a re-routing phase, torchrun islands (one and two nodes)

Session fixtures (built once, on first use; tests that write into a run work on a `copy_run` of it):
- `tiny_routed`: configs/tiny.yaml routed and sharded through the Python API (tokenizer, routing,
  shards); test_coordinator and test_end_to_end start their own training from it;
- `tiny_trained`: a copy of it through the rest of `dipaco run` (train with real island processes,
  baselines, eval, report; the command's entry point called in this process), with the settings
  test_end_to_end and test_routed_inference both need (`TRAINED_OVERRIDES`).

The models here are tiny: a second torch thread costs more than it gains, and on a loaded machine
oversubscribed threads make a training step many times slower, so every process uses one.
"""

import os

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


def pytest_configure(config):
    import torch

    torch.set_num_threads(1)


# 3 rounds with one module version kept, so pruning has to keep each path's best version; every eval mode
TRAINED_OVERRIDES = ["run.rounds=3", "store.keep_versions=1", "eval.best=true",
                     "eval.modes=[prefix,every:16,every:64,oracle,all-paths]"]


@pytest.fixture(scope="session")
def tiny_routed(tmp_path_factory) -> RunDir:
    """configs/tiny.yaml after `dipaco route` and `dipaco shard` (read only: copy it to write)."""
    from dipaco.config import load_config
    from dipaco.stages.route import route
    from dipaco.stages.shard import shard

    run = RunDir(tmp_path_factory.mktemp("tiny-routed"))
    config = load_config(TINY)
    route(config, run)
    shard(config, run)
    return run


@pytest.fixture(scope="session")
def tiny_trained(tiny_routed, tmp_path_factory) -> RunDir:
    """`tiny_routed` through the rest of `dipaco run` with `TRAINED_OVERRIDES` (read only)."""
    run = copy_run(tiny_routed, tmp_path_factory.mktemp("tiny-trained") / "run")
    code, log = dipaco_in_process("run", "--config", TINY, "--run", run.root, *TRAINED_OVERRIDES)
    assert code == 0, f"dipaco run failed:\n{log[-3000:]}"
    return run
