"""Injected failures are reproducible: the same seed and island name give the same schedule, in every run."""

import json
import os
import subprocess
import sys

from dipaco.islands.island.faults import FaultClock


def schedule(*, seed: int, island: str, n: int = 5) -> list[float]:
    now = [0.0]
    clock = FaultClock(mtbf=60.0, return_after=10.0, mode="die", seed=seed, island=island, clock=lambda: now[0])
    times = []
    for _ in range(n):
        now[0] = clock.next_at
        assert clock.due()
        times.append(now[0])
        assert clock.fail() == 10.0
        assert clock.next_at >= now[0] + 10.0  # the next failure comes after the island is back
    return times


def schedule_in_a_new_process(*, seed: int, island: str, hash_seed: str) -> list[float]:
    """`schedule` computed by another interpreter, whose str hashes are salted with `hash_seed`."""
    code = f"import json, test_faults; print(json.dumps(test_faults.schedule(seed={seed}, island={island!r})))"
    out = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": hash_seed}, check=True, timeout=60).stdout
    return json.loads(out)


def test_the_failure_schedule_depends_only_on_seed_and_island():
    # the same in another run of dipaco: a new process, other hash salts (Python's hash() of a str is not)
    here = schedule(seed=1, island="island-0")
    assert here == schedule_in_a_new_process(seed=1, island="island-0", hash_seed="1")  # this one's salt is random
    assert schedule(seed=1, island="island-0") != schedule(seed=1, island="island-1")
    assert schedule(seed=1, island="island-0") != schedule(seed=2, island="island-0")
    gaps = [b - a - 10.0 for a, b in zip(schedule(seed=3, island="x", n=400), schedule(seed=3, island="x", n=400)[1:])]
    assert 45 < sum(gaps) / len(gaps) < 75  # exponential gaps with mean fail_mtbf = 60 s


def test_no_mtbf_means_no_failures():
    clock = FaultClock(mtbf=0.0, return_after=5.0, mode="die", seed=0, island="a", clock=lambda: 1e12)
    assert not clock.due()
