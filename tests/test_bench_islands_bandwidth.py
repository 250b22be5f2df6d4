"""bench/bench_islands.py --bandwidth (bench/islands_bandwidth.py): its rows are configs the run accepts, and the
bandwidth needed for 90% goodput and the issue's check are computed from hand-made rows (no training here)."""

from __future__ import annotations

import pytest

from bench.bench_islands import Setting
from bench.islands_bandwidth import bandwidth_rows, markdown, needed_for, summarize
from dipaco.config import load_config

CHOSEN = "topk 1% 2b EF decay 0.95"


def test_each_row_limits_every_island_and_keeps_its_codec():
    rows = bandwidth_rows([0, 2.5e5], ["float32", CHOSEN])
    assert [(v, b) for v, b, _ in rows] == [("float32", 0), ("float32", 2.5e5), (CHOSEN, 0), (CHOSEN, 2.5e5)]
    assert len({row.name for _, _, row in rows}) == 4
    config = load_config(None, [*Setting().common, *rows[3][2].overrides])
    assert config.faults.store_bandwidth == 2.5e5 and config.compression.codec == "topk"
    assert config.compression.density == 0.01 and config.compression.ef_decay == 0.95
    assert load_config(None, rows[0][2].overrides).faults.store_bandwidth == 0  # unlimited


def test_the_bandwidth_for_90_percent_and_the_check():
    float32 = {0: 0.97, 1e5: 0.20, 1e6: 0.45, 1e7: 0.92}
    chosen = {0: 0.97, 1e5: 0.80, 1e6: 0.95, 1e7: 0.96}
    needed = needed_for(float32)
    assert needed["lowest_measured"] == 1e7
    assert needed["interpolated"] == pytest.approx(1e6 * 10 ** ((0.90 - 0.45) / (0.92 - 0.45)))  # log-linear
    assert needed_for(chosen) == {"lowest_measured": 1e6,
                                  "interpolated": pytest.approx(1e5 * 10 ** ((0.90 - 0.80) / (0.95 - 0.80)))}
    assert needed_for({1e5: 0.5, 1e6: 0.6}) == {"lowest_measured": None, "interpolated": None}
    rows = [{"variant": v, "bandwidth": b, "goodput": g, "bytes_per_result": {"up_pseudo_gradient": 10.0}}
            for v, by in (("float32", float32), (CHOSEN, chosen)) for b, g in by.items()]
    summary = summarize(rows, ["float32", CHOSEN])
    assert summary["checks"][CHOSEN] == {"bandwidths": [1e6], "passes": True}  # 95% where float32 is 45%
    assert not summarize(rows[:4] + [dict(r, goodput=0.85) for r in rows[4:]], ["float32", CHOSEN])["checks"][CHOSEN]["passes"]
    setting = {"islands": 4, "step_seconds": 2, "inner_steps": 10, "rounds": 3}
    page = markdown({"setting": setting, "rows": rows, "summary": summary, "total_seconds": 60})
    assert "yes, at 1 MB/s" in page and "95.0%" in page and "unlimited" in page
