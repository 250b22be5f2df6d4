"""experiments/capacity.py's sweep plan and its summary of a point (no training here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dipaco.config import load_config
from experiments.capacity import (
    CAPACITY_DIPACO,
    CAPACITY_SET,
    Point,
    embedding_parameters,
    markdown,
    parse_points,
    plan,
    summarise,
)

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "configs" / "demo.yaml"


def test_points_parse_as_rounds_by_h_and_bad_ones_are_named():
    assert parse_points("2x100, 4x125") == [(2, 100), (4, 125)]
    for bad in ("2x", "x100", "0x100", "2y100", "2x100,2x100"):
        with pytest.raises(ValueError, match="points"):
            parse_points(bad)


def test_the_warm_start_is_its_share_of_each_points_compute_and_largest_runs_first():
    config = load_config(DEMO, [*CAPACITY_SET, *CAPACITY_DIPACO, "topology.levels=[2,4]"])
    points = plan(config, [(2, 100), (8, 200)], warm_fraction=0.25)
    assert [p.name for p in points] == ["8x200", "2x100"]
    small = points[1]
    assert small.n_paths == 8 and small.pretrain_steps == 533  # 8 x 2 x 100 = 1600 grid steps are 75%
    assert small.total_steps == 533 + 1600
    assert abs(small.pretrain_steps / small.total_steps - 0.25) < 1e-3
    assert small.overrides() == ["run.rounds=2", "inner.steps=100", f"warm_start.fraction={533 / 2133!r}"]
    assert load_config(DEMO, [*CAPACITY_SET, *CAPACITY_DIPACO, "topology.levels=[2,4]", *small.overrides()]).pretrain_steps == 533
    assert plan(config, [(2, 100)], warm_fraction=0)[0].pretrain_steps == 0
    with pytest.raises(ValueError, match="warm-fraction"):
        plan(config, [(2, 100)], warm_fraction=1.0)
    assert embedding_parameters(config) == 1024 * 32


def _row(kind: str, perplexity: float, tokens: int, per_path: int, total: int) -> dict:
    return {"model": kind, "kind": kind, "perplexity": perplexity, "total_tokens": tokens, "params_per_path": per_path,
            "params_total": total, "paths": 1}


def test_a_point_reports_tokens_per_parameter_epochs_and_ratios():
    point = Point(rounds=2, inner_steps=100, pretrain_steps=267, n_paths=4)
    rows = [_row("dipaco-prefix", 90.0, 1_000_000, 60_000, 200_000), _row("dipaco-oracle", 88.0, 1_000_000, 60_000, 200_000),
            _row("diloco", 100.0, 1_000_000, 60_000, 60_000), _row("dense-equal-compute", 120.0, 1_200_000, 60_000, 60_000),
            _row("dense-equal-steps", 150.0, 300_000, 60_000, 60_000)]
    out = summarise(point, {"rows": rows, "scored_tokens": 5}, embedding=30_000, corpus_tokens=400_000)
    assert out["ratio"] == pytest.approx(0.75) and out["vs_diloco"] == pytest.approx(0.10)
    assert out["dense_tokens_per_param"] == pytest.approx(20.0) and out["epochs"] == pytest.approx(3.0)
    assert out["total_steps"] == 1067 and out["oracle"] == 88.0 and out["dense_equal_steps"] == 150.0
    dipaco_row = out["rows"][0]
    assert dipaco_row["params_non_embedding"] == 30_000 and dipaco_row["tokens_per_param"] == pytest.approx(5.0)
    no_diloco = summarise(point, {"rows": [r for r in rows if r["kind"] != "diloco"], "scored_tokens": 5},
                          embedding=30_000, corpus_tokens=0)
    assert no_diloco["vs_diloco"] is None and no_diloco["diloco"] is None and no_diloco["epochs"] is None


def _model(name: str, perplexity: float, *, paths: int, total: int, steps: int) -> dict:
    return {"model": name, "perplexity": perplexity, "paths": paths, "params_per_path": 100, "params_total": total,
            "steps_per_path": steps, "tokens_seen": steps * paths * 1024, "pretrain_steps": 0}


def test_collecting_a_point_whose_diloco_never_ran_keeps_the_point(tmp_path):
    import json

    from bench.bench_quality import compare
    from bench.quality_runs import Runner

    point = Point(rounds=2, inner_steps=100, pretrain_steps=267, n_paths=4)
    run = tmp_path / point.name / "dipaco"
    run.mkdir(parents=True)
    eval_json = {"scored_tokens": 40, "test_documents": 3, "per_path": [],
                 "models": [_model("DiPaCo 2x2 routed", 90.0, paths=4, total=300, steps=200),
                            _model("dense-equal-steps", 150.0, paths=1, total=100, steps=467),
                            _model("dense-equal-compute", 100.0, paths=1, total=100, steps=1067)],
                 "modes": {"rows": [{"mode": "prefix", "checkpoints": "last", "perplexity": 90.0},
                                    {"mode": "likelihood", "checkpoints": "last", "perplexity": 87.0},
                                    {"mode": "oracle", "checkpoints": "last", "perplexity": 85.0}]}}
    (run / "eval.json").write_text(json.dumps(eval_json))
    overrides = [*CAPACITY_SET, *CAPACITY_DIPACO, *point.overrides()]
    result = compare(Runner(tmp_path / point.name, keep=True), DEMO, overrides, diloco_dipaco_outer=False,
                     modes=["prefix", "likelihood", "oracle"], collect_only=True)
    kinds = [r["kind"] for r in result["rows"]]
    assert kinds == ["dipaco-prefix", "dipaco-likelihood", "dipaco-oracle", "dense-equal-steps", "dense-equal-compute"]
    out = summarise(point, result, embedding=50, corpus_tokens=0)
    assert out["ratio"] == pytest.approx(0.9) and out["diloco"] is None and out["oracle"] == 85.0
    assert out["ratio_likelihood"] == pytest.approx(0.87) and out["dipaco_likelihood"] == 87.0
    table = markdown({"points": [out], "set": [], "dipaco": [], "warm_fraction": 0.25, "config": "configs/demo.yaml",
                      "threads": 1, "jobs": 1, "embedding_params": 50, "seconds": 1.0})
    lines = table.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("| point"))
    header, row = lines[start], lines[start + 2]
    cells = dict(zip([h.strip() for h in header.split("|")], [c.strip() for c in row.split("|")], strict=True))
    assert cells["DiPaCo, routed by the paths' likelihood"] == "87.00" and cells["its ÷ dense equal compute"] == "0.870"
    assert cells["oracle"] == "85.00" and cells["DiPaCo (prefix)"] == "90.00"
