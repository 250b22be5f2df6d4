"""bench/quality_seeds.py: the spread over seeds of bench_quality results, and what it refuses to average."""

import json
import statistics

import pytest

from bench import quality_seeds

KINDS = {"dipaco-prefix": "DiPaCo 2x2, prefix routing", "dipaco-oracle": "DiPaCo 2x2, oracle path",
         "diloco": "DiLoCo, its own outer step (4 replicas)", "diloco-dipaco-outer": "DiLoCo, DiPaCo's outer step (4 replicas)",
         "dense-equal-steps": "dense path-size, equal steps", "dense-equal-compute": "dense path-size, equal compute"}


def record(seed: int, perplexities: dict[str, float], *, clean: bool = True, extra: tuple = ()) -> dict:
    """A bench_quality results record as `write_results` leaves it (the fields quality_seeds reads)."""
    rows = [{"model": KINDS[k], "kind": k, "paths": 4 if k.startswith(("dipaco", "diloco")) else 1,
             "params_per_path": 1000, "params_total": 4000, "pretrain_steps": 400, "steps_per_path": 100,
             "total_tokens": 10_000, "flops": 6e7, "perplexity": p} for k, p in perplexities.items()]
    return {"config": "configs/demo.yaml", "budget": 1.0, "rounds": 10, "scored_tokens": 89_078, "test_documents": 420,
            "dipaco_overrides": ["hardware.precision=fp32", *extra, f"run.seed={seed}", "run.rounds=10"],
            "rows": rows, "pretrain": {"steps": 400, "tokens": 819_200}, "outer_steps": {"DiPaCo": "rounds 1-10: plain"},
            "commit": "a" * 40, "clean": clean,
            "trained_at": [{"what": "dipaco: rounds from 1", "commit": "a" * 40, "clean": clean}]}


SEEDS = {
    "s0": record(0, {"dipaco-prefix": 90.0, "dipaco-oracle": 88.0, "diloco": 110.0, "diloco-dipaco-outer": 99.0,
                     "dense-equal-steps": 112.0, "dense-equal-compute": 80.0}),
    "s1": record(1, {"dipaco-prefix": 96.0, "dipaco-oracle": 93.0, "diloco": 104.0, "diloco-dipaco-outer": 108.0,
                     "dense-equal-steps": 118.0, "dense-equal-compute": 84.0}),
    "s2": record(2, {"dipaco-prefix": 93.0, "dipaco-oracle": 90.0, "diloco": 112.0, "diloco-dipaco-outer": 101.0,
                     "dense-equal-steps": 115.0, "dense-equal-compute": 82.0}),
}


def test_rows_are_the_seeds_mean_and_spread():
    results = quality_seeds.aggregate(SEEDS)
    assert results["seeds"] == [0, 1, 2]
    prefix = next(r for r in results["rows"] if r["kind"] == "dipaco-prefix")
    assert prefix["per_seed"] == {"0": 90.0, "1": 96.0, "2": 93.0}
    assert prefix["perplexity"]["mean"] == pytest.approx(93.0)
    assert prefix["perplexity"]["std"] == pytest.approx(3.0)
    assert (prefix["perplexity"]["min"], prefix["perplexity"]["max"]) == (90.0, 96.0)


def test_best_diloco_is_chosen_on_the_means_and_compared_on_every_seed():
    # own outer step: mean 108.67; DiPaCo's outer step: mean 102.67 -> the best, although seed 1 prefers the other
    results = quality_seeds.aggregate(SEEDS)
    assert results["best_diloco"] == KINDS["diloco-dipaco-outer"]
    best = results["checks"]["dipaco_vs_best_diloco"]
    assert best["on_means"] == pytest.approx(1 - 93.0 / (308.0 / 3))
    each = [1 - 90 / 99, 1 - 96 / 108, 1 - 93 / 101]
    assert list(best["per_seed"].values()) == pytest.approx(each)
    assert best["mean"] == pytest.approx(statistics.fmean(each))
    ratio = results["checks"]["dipaco_over_dense_equal_compute"]
    assert ratio["on_means"] == pytest.approx(93.0 / 82.0)
    assert list(ratio["per_seed"].values()) == pytest.approx([90 / 80, 96 / 84, 93 / 82])


def test_markdown_says_how_many_seeds_meet_each_target():
    text = quality_seeds.markdown(quality_seeds.aggregate(SEEDS))
    # against the best DiLoCo: seed 0 9.1%, seed 1 11.1%, seed 2 7.9% lower; on the means 9.4%
    assert ("9.4% lower on the means; per seed 9.1% lower (seed 0), 11.1% lower (seed 1), 7.9% lower (seed 2), "
            "std 1.6 points; target at least 10% lower: missed on the means, met by 1 of 3 seeds") in text
    assert "DiPaCo ÷ dense equal compute: 1.134 on the means" in text
    assert "≤ 1.0 at 4x" not in text  # the 4x target is not judged at the demo's budget
    at_4x = quality_seeds.markdown(quality_seeds.aggregate({k: {**r, "budget": 4.0} for k, r in SEEDS.items()}))
    assert "target ≤ 1.0 at 4x the demo's budget: missed on the means, met by 0 of 3 seeds" in at_4x
    assert "| 93.00 ± 3.00 | 90.00–96.00 | 90.00 | 96.00 | 93.00 |" in text


def test_refuses_files_that_differ_in_more_than_the_seed():
    other = {**SEEDS, "s2": record(2, {k: 1.0 for k in KINDS}, extra=("model.hidden_size=64",))}
    with pytest.raises(SystemExit, match=r"s2: model\.hidden_size differ from s0's"):
        quality_seeds.aggregate(other)
    with pytest.raises(SystemExit, match="seeds \\[0, 1, 1\\]: each seed once"):
        quality_seeds.aggregate({**SEEDS, "s2": record(1, {k: 1.0 for k in KINDS})})
    fewer = record(2, {k: 1.0 for k in KINDS if k != "diloco"})
    with pytest.raises(SystemExit, match="s2: models"):
        quality_seeds.aggregate({**SEEDS, "s2": fewer})


def test_one_dirty_seed_makes_the_aggregate_unquotable(tmp_path, monkeypatch):
    from bench import recording

    monkeypatch.setattr(recording, "code_version", lambda root: {"commit": "b" * 40, "clean": True})
    for name, r in {**SEEDS, "s1": {**SEEDS["s1"], "clean": False}}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    monkeypatch.setattr("sys.argv", ["quality_seeds.py", "s0", "s1", "s2", "--name", "out", "--results-dir", str(tmp_path)])
    quality_seeds.main()
    out = json.loads((tmp_path / "out.json").read_text())
    assert not recording.quotable(out)
    assert "(not quotable)" in out["source"]
    assert "[s1](s1.md) (seed 1, commit aaaaaaa, not quotable)" in (tmp_path / "out.md").read_text()
    assert (tmp_path / "out.png").stat().st_size > 0


def test_a_capacity_sweep_point_is_read_as_its_comparison():
    def capacity(record: dict) -> dict:
        seed = next(o for o in record["dipaco_overrides"] if o.startswith("run.seed="))
        return {"config": "configs/demo.yaml", "set": ["hardware.precision=fp32", seed], "dipaco": [],
                "points": [{"point": "16x250", "rounds": 16, "inner_steps": 250, "pretrain_steps": 5333,
                            "scored_tokens": 40_271, "rows": record["rows"]},
                           {"point": "8x200", "rounds": 8, "inner_steps": 200, "pretrain_steps": 1000,
                            "scored_tokens": 40_271, "rows": record["rows"]}],
                "commit": "a" * 40, "clean": True}

    with pytest.raises(SystemExit, match=r"s0: give --point, one of \['16x250', '8x200'\]"):
        quality_seeds.capacity_point(capacity(SEEDS["s0"]), None, name="s0")
    records = {n: quality_seeds.capacity_point(capacity(r), "16x250", name=n) for n, r in SEEDS.items()}
    results = quality_seeds.aggregate(records)
    assert results["seeds"] == [0, 1, 2] and results["rounds"] == 16
    assert results["checks"]["dipaco_over_dense_equal_compute"]["on_means"] == pytest.approx(93.0 / 82.0)
    assert "held-out documents" not in quality_seeds.markdown(results)  # a sweep does not record them


def test_the_router_before_the_last_re_routing_is_compared_with_the_best_diloco_too():
    KINDS["dipaco-prefix-before-reroute"] = "DiPaCo 2x2, prefix routing by the router before the last re-routing"
    try:
        seeds = {name: record(seed, {**{r["kind"]: r["perplexity"] for r in r0["rows"]},
                                     "dipaco-prefix-before-reroute": before})
                 for (name, r0), seed, before in zip(SEEDS.items(), (0, 1, 2), (91.0, 97.0, 95.0))}
        results = quality_seeds.aggregate(seeds)
    finally:
        del KINDS["dipaco-prefix-before-reroute"]
    before = results["checks"]["before_reroute_vs_best_diloco"]
    assert list(before["per_seed"].values()) == pytest.approx([1 - 91 / 99, 1 - 97 / 108, 1 - 95 / 101])
    assert "by the router before the last re-routing (k-means, where one phase ran) against DiLoCo" in (
        quality_seeds.markdown(results))
    assert quality_seeds.aggregate(SEEDS)["checks"]["before_reroute_vs_best_diloco"] is None  # no phase, no row
