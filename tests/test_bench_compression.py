"""bench/bench_compression.py's byte figures come from the counts the islands measured (train.json's `traffic`),
not from the round manifests (no training here)."""

from __future__ import annotations

import json

import pytest

from bench.bench_compression import wire


def test_the_ratios_are_the_measured_bytes_against_float32_and_data_parallel(tmp_path):
    cell = lambda b: {"bytes": b, "requests": 1}  # noqa: E731
    islands = {"up": {"pseudo_gradient": cell(100), "inner_state": cell(50), "heartbeats": cell(10)},
               "down": {"module": cell(400), "manifests": cell(20), "board": cell(5), "inputs": cell(1000)}}
    coordinator = {"up": {"module": cell(7_000)}, "down": {"pseudo_gradient": cell(9_000)}}  # not an island's link
    train = {"traffic": {"by_role": {"island": islands, "coordinator": coordinator}}, "results_applied": 4,
             "bytes_float32": 500, "bytes_data_parallel": 2_000, "data_parallel_workers": 4, "rounds_completed": 1}
    (tmp_path / "train.json").write_text(json.dumps(train))
    b = wire(tmp_path)
    training = 100 + 400 + 20  # pseudo-gradients up, modules down, manifests read
    everything = 100 + 50 + 10 + 400 + 20 + 5  # all but the published inputs
    assert b["ratio_training_traffic"] == pytest.approx(2 * 500 / training)  # float32 DiLoCo: up and down
    assert b["ratio_everything"] == pytest.approx(2 * 500 / everything)
    assert b["ratio_vs_data_parallel"] == pytest.approx(2 * 2_000 / everything)  # each way, so twice
    assert b["per_result"]["up_pseudo_gradient"] == 25 and b["per_result"]["down_inputs"] == 250
    assert b["training_traffic_per_result"] == training / 4
