"""Every stage that computes honours `hardware.threads_per_island` (issue 39, item 5): pretrain, route,
reroute and eval each call the real stage function with a thread count unlike the test process's, and the
first thing the stage calls after its prologue sees torch, faiss and the BLAS pools at that count."""

import faiss
import pytest
import torch
from cli_helpers import TINY
from threadpoolctl import threadpool_info

from dipaco.config import load_config
from dipaco.run_dir import RunDir
from dipaco.threads import use_threads

THREADS = 2  # the test processes compute with one (conftest.py)


class Reached(Exception):
    """Raised where the stage's first step is replaced: the threads are recorded, the stage goes no further."""


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads(), faiss.omp_get_max_threads()
    yield
    use_threads(before[0])
    faiss.omp_set_num_threads(before[1])


def thread_counts() -> dict:
    return {"torch": torch.get_num_threads(), "faiss": faiss.omp_get_max_threads(),
            "blas": sorted({p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"})}


STAGES = [  # (stage module, stage function, the first thing it calls after setting the threads)
    ("dipaco.stages.pretrain", "pretrain", "save_config"),
    ("dipaco.stages.route", "route", "record_path"),
    ("dipaco.stages.reroute", "reroute", "check"),
    ("dipaco.stages.evaluate", "evaluate", "check"),
]


@pytest.mark.parametrize(("module", "function", "first"), STAGES, ids=[s[1] for s in STAGES])
def test_the_stage_computes_with_threads_per_island(module, function, first, tmp_path, monkeypatch,
                                                    restore_threads):
    import importlib

    stage = importlib.import_module(module)
    use_threads(1)
    assert thread_counts() == {"torch": 1, "faiss": 1, "blas": [1]}
    seen = []

    def record(*args, **kwargs):
        seen.append(thread_counts())
        raise Reached

    monkeypatch.setattr(stage, first, record)
    config = load_config(TINY, [f"hardware.threads_per_island={THREADS}", "warm_start.fraction=0.5"])
    with pytest.raises(Reached):
        getattr(stage, function)(config, RunDir(tmp_path / "run"))
    assert seen == [{"torch": THREADS, "faiss": THREADS, "blas": [THREADS]}]


def test_zero_leaves_the_threads_as_they_are(restore_threads):
    use_threads(1)
    use_threads(0)
    assert thread_counts() == {"torch": 1, "faiss": 1, "blas": [1]}
    with pytest.raises(ValueError, match="-1"):
        use_threads(-1)


def test_a_worker_takes_its_launchers_thread_count_through_the_same_helper(monkeypatch, restore_threads):
    """The island and baseline workers (`dipaco.islands.processes`): DIPACO_THREADS sizes every pool too."""
    from dipaco.islands.processes import THREADS_ENV, set_threads_from_env

    use_threads(1)
    monkeypatch.setenv(THREADS_ENV, str(THREADS))
    set_threads_from_env()
    assert thread_counts() == {"torch": THREADS, "faiss": THREADS, "blas": [THREADS]}
