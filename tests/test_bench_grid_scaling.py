"""The grid benchmark's comparisons: each grid step under every routing scored on the same seeds."""

from __future__ import annotations

import pytest

from bench.bench_grid_scaling import checks, dense_models, grid_levels, markdown


def _row(model: str, paths: int, modes: dict[str, list[float]], *, dense: bool = False) -> dict:
    seeds = range(max(len(v) for v in modes.values()))
    summary = {m: {"mean": sum(v) / len(v), "std": 0.0, "seeds": len(v)} for m, v in modes.items()}
    per_seed = {s: {"modes": {m: (v[s] if s < len(v) else None) for m, v in modes.items()}, "scored_tokens": 100,
                    "outer_steps": ["average"], "train_seconds": 90.0} for s in seeds}
    return {"model": model, "dense": dense, "seeds": list(seeds), "modes": summary, "paths": paths,
            "params_per_path": 10, "params_total": 10 * paths, "warm_start_steps": 4, "steps_per_path": 2,
            "shards": {"tokens_min": 5, "tokens_median": 6, "epochs_max": 0.4},
            "test_documents": {"min": 1, "median": 2}, "inner_lr": 3e-3, "per_seed": per_seed}


def test_each_grid_step_is_compared_under_every_routing_scored_on_the_same_seeds():
    small = _row("DiPaCo 2x2", 4, {"prefix": [100.0, 110.0], "likelihood:4": [96.0], "likelihood": [95.0, 105.0],
                                   "oracle-split": [90.0]})
    large = _row("DiPaCo 4x4", 16, {"prefix": [90.0, 99.0], "likelihood:4": [86.4], "likelihood": [95.0],
                                    "oracle-split": [81.0]})
    dense = _row("dense 1x", 1, {"prefix": [120.0, 130.0]}, dense=True)
    out = checks([small, large, dense])
    assert out["DiPaCo 4x4 routed vs DiPaCo 2x2"] == 94.5 / 105 - 1
    assert out["DiPaCo 4x4 vs DiPaCo 2x2, both routed by likelihood among the k-means router's 4 best paths"] == 86.4 / 96 - 1
    assert out["DiPaCo 4x4 vs DiPaCo 2x2, both by the split oracle"] == 81 / 90 - 1
    # likelihood routing was scored on 2 seeds at 2x2 and 1 at 4x4: not the same seeds, so no comparison
    assert not any("the paths' likelihood" in name for name in out)
    assert out["DiPaCo 4x4 routed vs dense 1x"] == 94.5 / 125 - 1


def test_the_results_name_the_recipes_config():
    rows = [_row("DiPaCo 2x2", 4, {"prefix": [100.0]})]
    results = {"rows": rows, "checks": checks(rows), "warm_start_steps": 4, "path_params": 10, "dense_widths": {},
               "common": ["model.hidden_size=64"], "seconds": 1.0, "config": "configs/large.yaml"}
    text = markdown(results)
    assert text.count("`configs/large.yaml`'s recipe with model.hidden_size=64") == 1
    assert "routed (likelihood among the k-means router's 4 best paths)" in text
    assert "Wall time: 0 min; training (min, all seeds): DiPaCo 2x2 1.5." in text
    collected = markdown({**results, "collected_only": True})
    assert "earlier invocations (`--keep`). Training took (min, all seeds, train.json): DiPaCo 2x2 1.5." in collected
    assert grid_levels("16x16") == [16, 16]


def test_a_dense_model_of_a_grids_compute_trains_as_many_flops_as_its_paths_together():
    models = dict(dense_models([1, 4], {1: 64, 4: 160}, compute_of=["2x2", "4x4"], rounds=10))
    assert models == {
        "dense 1x": ["model.hidden_size=64"],
        "dense 1x, 2x2 compute": ["model.hidden_size=64", "run.rounds=40"],
        "dense 1x, 4x4 compute": ["model.hidden_size=64", "run.rounds=160"],
        "dense 4x": ["model.hidden_size=160"],  # 4 paths' compute at 4x a path is its equal-steps model
        "dense 4x, 4x4 compute": ["model.hidden_size=160", "run.rounds=40"],
    }
    with pytest.raises(ValueError, match="--dense-compute 2x2: 12 path rounds"):
        dense_models([8], {8: 200}, compute_of=["2x2"], rounds=3)


def test_each_equal_compute_dense_model_is_compared_with_its_own_grid():
    small = _row("DiPaCo 2x2", 4, {"prefix": [100.0]})
    large = _row("DiPaCo 4x4", 16, {"prefix": [90.0]})
    rows = [small, large, _row("dense 1x", 1, {"prefix": [150.0]}, dense=True),
            _row("dense 1x, 2x2 compute", 1, {"prefix": [120.0]}, dense=True),
            _row("dense 4x, 4x4 compute", 1, {"prefix": [80.0]}, dense=True)]
    out = checks(rows)
    assert out["DiPaCo 4x4 routed vs dense 1x"] == 90 / 150 - 1
    assert out["DiPaCo 2x2 routed vs dense 1x, 2x2 compute"] == 100 / 120 - 1
    assert out["DiPaCo 4x4 routed vs dense 4x, 4x4 compute"] == 90 / 80 - 1
    assert len(out) == 4  # and the grid step
