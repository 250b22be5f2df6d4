"""Local worker processes: parallelism plan, and failures that name the log."""


import pytest

from dipaco.islands import processes as launch
from dipaco.islands.processes import Task, plan_parallelism, run_tasks


def test_plan_gives_each_process_its_share_of_the_cores(monkeypatch):
    monkeypatch.setattr(launch, "available_cores", lambda: 8)
    assert plan_parallelism(16) == (8, 1)
    assert plan_parallelism(2) == (2, 4)
    assert plan_parallelism(16, processes=4) == (4, 2)
    assert plan_parallelism(16, processes=4, threads=3) == (4, 3)


def test_a_failing_task_raises_with_its_log(tmp_path):
    good = Task(name="help", args=["--help"], log=tmp_path / "good.log")
    bad = Task(name="bad task", args=["no-such-command"], log=tmp_path / "bad.log")
    with pytest.raises(RuntimeError, match=r"bad task failed .*bad\.log"):
        run_tasks([good, bad], processes=1, threads=1, desc="test")
    assert "usage" in (tmp_path / "good.log").read_text()


def test_tasks_run_and_pass(tmp_path):
    tasks = [Task(name=f"t{i}", args=["--help"], log=tmp_path / f"{i}.log") for i in range(2)]
    run_tasks(tasks, processes=2, threads=1, desc="test")
    assert all((tmp_path / f"{i}.log").stat().st_size > 0 for i in range(2))
