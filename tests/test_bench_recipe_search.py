"""experiments/recipe_search.py: every variant spends the same compute, and rows measured before are kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.quality_runs import warm_start_steps_as_fraction
from dipaco.config import load_config
from experiments.recipe_search import REDUCED, ROUND1, ROUND6, VARIANTS, earlier_rows

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "configs" / "demo.yaml"


def variant(name: str) -> list[str]:
    """The overrides a variant runs with (its warm start in steps written as a fraction)."""
    return warm_start_steps_as_fraction(DEMO, [*REDUCED, *VARIANTS[name][1]])


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "grid-4x4"])  # 4x4 is 768 steps, said in its text
def test_every_variant_spends_800_path_model_steps(name):
    config = load_config(DEMO, variant(name))
    paths = 1
    for k in config.topology.levels:
        paths *= k
    assert paths * config.run.rounds * config.inner.steps + config.pretrain_steps == 800


def test_round_two_variants_build_on_round_ones_best():
    best = load_config(DEMO, variant("warm25-diloco-outer")).to_dict()
    round2 = [n for n in VARIANTS if n not in ROUND1]
    assert round2 and "warm25-diloco-outer" in ROUND1
    lr = load_config(DEMO, variant("wdo-lr6e-3"))
    assert lr.inner.lr == 6e-3 and lr.to_dict()["outer"] == best["outer"]
    assert load_config(DEMO, variant("wdo-outer-lr0.5")).outer.lr == 0.5
    h10 = load_config(DEMO, variant("wdo-H10"))
    assert (h10.inner.steps, h10.run.rounds, h10.pretrain_steps) == (10, 15, 200)


def test_rows_of_the_earlier_results_are_kept_unless_measured_again(tmp_path):
    path = tmp_path / "recipe-search.json"
    rows = [{"variant": "base", "perplexity": 404.95}, {"variant": "warm25", "perplexity": 284.0},
            {"variant": "gone-variant", "perplexity": 1.0}]
    path.write_text(json.dumps({"source": "measured by X", "rows": rows}))
    kept = earlier_rows(path, measured={"base"})
    assert [r["variant"] for r in kept] == ["warm25"]
    assert kept[0]["measured_here"] is False and kept[0]["round"] == 1 and kept[0]["source"] == "measured by X"
    assert earlier_rows(tmp_path / "missing.json", measured=set()) == []


def test_the_search_pins_the_schedule_it_measured_with():
    """configs/demo.yaml took round 4's schedule (wsd, the warm start's AdamW continued); the variants of
    rounds 1-3 were measured under cosine with a fresh AdamW and must still resolve to it."""
    demo = load_config(DEMO, [])
    assert demo.inner.schedule == "wsd" and demo.warm_start.continue_optimizer
    for name in ("base", "warm25-diloco-outer", "w50-H10", "w50-H10-private-emb"):
        config = load_config(DEMO, variant(name))
        assert (config.inner.schedule, config.warm_start.continue_optimizer) == ("cosine", False), name
    adam = load_config(DEMO, variant("w50-H10-wsd-adam"))
    assert (adam.inner.schedule, adam.warm_start.continue_optimizer) == ("wsd", True)
    # the demo then took outer.decay: average (round 5); the earlier variants keep their outer step throughout
    assert demo.outer.decay == "average"
    configs = {name: load_config(DEMO, variant(name)) for name in VARIANTS}
    decaying = {name for name, c in configs.items() if c.outer.decay != "keep"}
    assert decaying == {"w25-H10-wsd-adam-decay-avg", "w50-H25-wsd-adam-decay-avg",
                        "w50-H10-wsd-adam-decay-avg-private-emb", *ROUND6}
