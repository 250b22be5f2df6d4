"""bench/bench_islands.py: the benchmark's settings reach the runs whatever configs/demo.yaml says."""

from __future__ import annotations

from pathlib import Path

from bench.bench_islands import Setting
from dipaco.config import load_config

DEMO = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def test_the_benchmarks_inner_steps_override_the_demos_own_h():
    # The default H (25) used to be passed only when it differed from 25, so the demo's H = 10 ran instead.
    for h in (25, 10, 7):
        config = load_config(DEMO, Setting(inner_steps=h).common)
        assert config.inner.steps == h
    assert load_config(DEMO, Setting(rounds=3).common).run.rounds == 3
