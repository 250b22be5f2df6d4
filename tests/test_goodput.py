"""Goodput by work (docs/islands.md#goodput) on recorded runs, recomputed independently: train.json's from the
round manifests with numpy, `dipaco status`'s estimate while a run goes (the median result's speed, or the
pace's), and bench/results/islands.json's by-work column from the figures each row records."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from bench.islands_goodput import recompute
from dipaco.config import load_config
from dipaco.run_dir import RunDir
from dipaco.stages.status import Source, collect
from dipaco.store.board import read_manifest
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import RoundStats

ROOT = Path(__file__).resolve().parent.parent


def applied_entries(store: ModuleStore) -> list:
    return [e for r in range(1, store.current_round() + 1) for e in read_manifest(store, r).applied]


def test_train_json_goodput_is_the_applied_tokens_over_the_islands_capacity(tiny_trained):
    recorded = json.loads(tiny_trained.train_summary.read_text())["goodput"]
    entries = applied_entries(ModuleStore(str(tiny_trained.store)))
    tokens = np.array([e.tokens for e in entries], dtype=float)
    seconds = np.array([e.seconds for e in entries])
    speed = np.median(tokens / seconds)  # an island's failure-free tokens/s: the median result's (not paced)
    assert recorded["applied_tokens"] == tokens.sum()
    assert recorded["goodput"] == pytest.approx(tokens.sum() / (recorded["island_seconds"] * speed), rel=1e-9)
    assert recorded["goodput_by_time"] == pytest.approx(seconds.sum() / recorded["island_seconds"], rel=1e-9)
    assert 0 < recorded["goodput"] <= 1


def test_status_estimates_goodput_by_work_while_a_run_goes(tiny_straight, tmp_path):
    """train.json with round seconds but no goodput yet (a run going on): applied tokens / (islands that
    heart-beat x the rounds' seconds x an island's speed), the median result's, or the pace's when the
    config paces the islands; the time-based share beside it."""
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    rounds = [dataclasses.replace(RoundStats.of(read_manifest(tiny_straight.store, r), in_flight=0), seconds=seconds)
              for r, seconds in ((1, 30.0), (2, 20.0))]
    run.train_summary.write_text(json.dumps({"rounds": [r.to_json() for r in rounds]}))
    entries = applied_entries(tiny_straight.store)
    tokens = sum(e.tokens for e in entries)
    islands = 2  # tiny_straight's islands i0 and i1
    median = np.median([e.tokens / e.seconds for e in entries])
    status = collect(Source(store=tiny_straight.store, run=run))
    assert status["goodput"]["value"] == pytest.approx(tokens / (islands * 50.0 * median), rel=1e-9)
    assert status["goodput"]["by_time"] == pytest.approx(sum(e.seconds for e in entries) / (islands * 50.0))
    paced = load_config(tiny_straight.dir.config, ["faults.step_seconds=0.25"])
    status = collect(Source(store=tiny_straight.store, run=run, config=paced))
    speed = paced.inner.batch_size * paced.sharding.seq_len / 0.25
    assert status["goodput"]["value"] == pytest.approx(tokens / (islands * 50.0 * speed), rel=1e-9)


def test_the_islands_benchmarks_goodput_by_work_is_recomputed_from_its_rows():
    """bench/results/islands.json's rows: goodput = applied tokens / (run seconds x 8 islands x tokens per step
    / the pace), the tokens per step those of the sync row's whole tasks; recomputing changes nothing."""
    record = json.loads((ROOT / "bench" / "results" / "islands.json").read_text())
    s = record["setting"]
    sync = next(r for r in record["rows"] if r["name"] == "sync")
    per_step = sync["applied_tokens"] / (sync["applied_tasks"] * s["inner_steps"])  # every sync task is whole
    for row in record["rows"]:
        expected = row["applied_tokens"] / (row["run_seconds"] * s["islands"] * per_step / s["step_seconds"])
        assert row["goodput"] == pytest.approx(expected, rel=1e-12), row["name"]
        assert "goodput_by_time" in row
    slow = {r["name"]: r for r in record["rows"] if r["slowdown"] > 1}
    assert all(r["goodput"] < r["goodput_by_time"] for r in slow.values())  # the straggler's seconds are not work
    again = recompute(json.loads(json.dumps(record)))
    assert [r["goodput"] for r in again["rows"]] == [r["goodput"] for r in record["rows"]]
