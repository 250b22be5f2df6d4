"""bench/record_run.py: the quality figures it derives from a run's eval.json."""

from __future__ import annotations

import pytest

from bench.record_run import checks


def test_checks_derive_each_figure_from_the_rows_present():
    evaluation = {
        "models": [{"model": "DiPaCo 2x2 routed", "perplexity": 93.0}, {"model": "dense-equal-steps", "perplexity": 112.0},
                   {"model": "dense-equal-compute", "perplexity": 78.0}],
        "modes": {"rows": [{"mode": "prefix", "checkpoints": "last", "perplexity": 93.0},
                           {"mode": "likelihood", "checkpoints": "last", "perplexity": 92.0},
                           {"mode": "oracle", "checkpoints": "last", "perplexity": 90.0},
                           {"mode": "oracle", "checkpoints": "best", "perplexity": 1.0}]},
    }
    out = checks(evaluation)
    assert out["dipaco_over_dense_equal_compute"] == pytest.approx(93 / 78)
    assert out["dipaco_vs_dense_equal_steps"] == pytest.approx(93 / 112 - 1)
    assert out["routed_over_oracle"] == pytest.approx(93 / 90 - 1)  # the last checkpoints, not `best`
    assert out["likelihood_over_oracle"] == pytest.approx(92 / 90 - 1)
    without = checks({"models": evaluation["models"][:1], "modes": {"rows": evaluation["modes"]["rows"][:1]}})
    assert without == {}
