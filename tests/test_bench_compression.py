"""bench/bench_compression.py's rows (bench/wire_rows.py, bench/wire_report.py) from hand-made runs: the byte
ratios from the counts the islands measured (train.json's `traffic`, not the manifests), the perplexity against
float32 DiLoCo with the same inner optimizer and outer decay, and the issue's bars (no training here)."""

from __future__ import annotations

import json

import pytest

from bench.wire_report import float32_check, markdown, verdict
from bench.wire_rows import collect, wire
from dipaco.config import load_config, save_config

cell = lambda b: {"bytes": b, "requests": 1}  # noqa: E731


def make_run(root, *, pseudo_gradient: int, update: int, perplexity: float, overrides=(), results=4) -> object:
    """A finished run's train.json, eval.json and config.yaml: `results` applied results of a path whose
    float32 pseudo-gradient is 500 bytes."""
    root.mkdir(parents=True)
    islands = {"up": {"pseudo_gradient": cell(pseudo_gradient), "inner_state": cell(50), "heartbeats": cell(10)},
               "down": {"module_update": cell(update), "module": cell(400), "manifests": cell(20), "board": cell(5),
                        "inputs": cell(1000)}}
    coordinator = {"up": {"module": cell(7_000)}, "down": {"pseudo_gradient": cell(9_000)}}  # not an island's link
    train = {"traffic": {"by_role": {"island": islands, "coordinator": coordinator}}, "results_applied": results,
             "bytes_float32": 500 * results, "bytes_data_parallel": 2_000, "data_parallel_workers": 4,
             "rounds_completed": 100, "module_fallbacks": 1, "seconds": 60.0}
    (root / "train.json").write_text(json.dumps(train))
    (root / "eval.json").write_text(json.dumps({"scored_tokens": 1234, "modes": {"rows": [
        {"mode": "prefix", "checkpoints": "last", "perplexity": perplexity}]}}))
    save_config(load_config(None, list(overrides)), root / "config.yaml")
    return root


def test_the_ratios_are_the_measured_island_bytes_against_float32_and_data_parallel(tmp_path):
    run = make_run(tmp_path / "run", pseudo_gradient=100, update=60, perplexity=30.0)
    b = wire(run)
    training = 100 + 60 + 20  # pseudo-gradients up, module updates down, manifests and checksums read
    everything = 100 + 50 + 10 + 60 + 400 + 20 + 5  # every island byte but the published inputs
    assert b["ratio_training_traffic"] == pytest.approx(2 * 500 * 4 / training)  # float32 DiLoCo: up and down
    assert b["ratio_everything"] == pytest.approx(2 * 500 * 4 / everything)  # full module reads count here only
    assert b["ratio_vs_data_parallel"] == pytest.approx(2 * 2_000 / everything)  # train.json's is each way
    assert b["per_result"]["up_pseudo_gradient"] == 25 and b["per_result"]["down_module"] == 100
    assert b["training_traffic_per_result"] == training / 4 and b["module_fallbacks"] == 1


def test_rows_compare_with_the_float32_of_their_inner_optimizer_and_outer_decay(tmp_path):
    muon, keep = ["inner.optimizer=muon"], ["outer.decay=keep"]
    runs = {"float32": {0: make_run(tmp_path / "f0", pseudo_gradient=2000, update=2200, perplexity=30.0),
                        1: make_run(tmp_path / "f1", pseudo_gradient=2000, update=2000, perplexity=32.0)},
            "float32, Muon, decay keep": {0: make_run(tmp_path / "m0", pseudo_gradient=2000, update=2000,
                                                      perplexity=20.0, overrides=[*muon, *keep])},
            "sparse": {0: make_run(tmp_path / "s0", pseudo_gradient=10, update=10, perplexity=30.3),
                       1: make_run(tmp_path / "s1", pseudo_gradient=10, update=10, perplexity=32.8)},
            "sparse, Muon, decay keep": {0: make_run(tmp_path / "k0", pseudo_gradient=10, update=10, perplexity=21.0,
                                                     overrides=[*muon, *keep, "resilience.inner_checkpoint_every=5"])}}
    results = collect(runs, chosen=["sparse"], overrides={name: [] for name in runs})
    rows = {r["variant"]: r for r in results["rows"]}
    sparse, keep_row = rows["sparse"], rows["sparse, Muon, decay keep"]
    assert sparse["baseline"] == "float32" and keep_row["baseline"] == "float32, Muon, decay keep"
    assert (keep_row["inner_optimizer"], keep_row["outer_decay"], keep_row["inner_checkpoint_every"]) == ("muon", "keep", 5)
    assert sparse["perplexity"] == pytest.approx((30.3 + 32.8) / 2)
    assert sparse["perplexity_vs_float32_pct"] == pytest.approx(100 * ((30.3 + 32.8) / (30.0 + 32.0) - 1))
    assert sparse["perplexity_vs_float32_pct_by_seed"] == pytest.approx({0: 1.0, 1: 2.5})
    assert keep_row["perplexity_vs_float32_pct"] == pytest.approx(5.0)  # 21 against Muon-keep's 20, not float32's 30
    assert sparse["ratio_training_traffic"] == pytest.approx(2 * 500 * 4 / (10 + 10 + 20))  # 100x
    v = verdict(sparse)  # 100x, 100 rounds, 2 seeds; +1.77% mean fails +1%, seed 1's +2.5% fails +2%
    assert v["ratio_training_traffic"] and v["rounds"] and v["seeds"]
    assert not v["perplexity_mean"] and not v["perplexity_each_seed"] and not v["passes"]
    assert not v["ratio_everything"]  # 4000 / (10+50+10+10+400+20+5) = 7.9x < 50x: the joining reads count
    check = float32_check(rows["float32"])  # seed 0's (2000 + 2200 + 20) / 4 per result against 2 x 500; seed 1 1.005
    assert check["training_over_2x_float32"] == pytest.approx((2000 + 2200 + 20) / 4 / 1000) and not check["passes"]
    assert float32_check(rows["float32, Muon, decay keep"])["passes"]  # (2000 + 2000 + 20) / 4000 = 1.005
    results.update(config="configs/demo.yaml", chosen_by="--chosen", min_ratio=100, common=["x=1"], seconds=60, verdicts={"sparse": v},
                   float32_checks=[check])
    page = markdown(results)
    assert "**Fails.**" in page and "joining + fallbacks" in page and "+1.77%" in page
    assert "No module updates downloaded" not in page  # every row downloaded module updates
