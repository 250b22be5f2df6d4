"""The grid benchmark's comparisons: each grid step under every routing scored on the same seeds."""

from __future__ import annotations

from bench.bench_grid_scaling import checks, grid_levels, markdown


def _row(model: str, paths: int, modes: dict[str, list[float]], *, dense: bool = False) -> dict:
    seeds = range(max(len(v) for v in modes.values()))
    summary = {m: {"mean": sum(v) / len(v), "std": 0.0, "seeds": len(v)} for m, v in modes.items()}
    per_seed = {s: {"modes": {m: (v[s] if s < len(v) else None) for m, v in modes.items()}, "scored_tokens": 100,
                    "outer_steps": ["average"]} for s in seeds}
    return {"model": model, "dense": dense, "seeds": list(seeds), "modes": summary, "paths": paths,
            "params_per_path": 10, "params_total": 10 * paths, "warm_start_steps": 4, "steps_per_path": 2,
            "shards": {"tokens_min": 5, "tokens_median": 6, "epochs_max": 0.4},
            "test_documents": {"min": 1, "median": 2}, "per_seed": per_seed}


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
    assert grid_levels("16x16") == [16, 16]
