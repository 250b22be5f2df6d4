"""The dense baselines DiPaCo is compared with: their names, step budgets and architectures.

    budgets = baseline_steps(steps_per_path=rounds * H, n_paths=4, large=cfg.eval.large_hidden_size > 0)
    model_config = baseline_model_config(cfg.model, cfg.eval, "dense-large")

- `dense-equal-steps`: as many inner steps as each path took (rounds x H): equal wall-clock when
  the islands run in parallel, the paper's headline comparison;
- `dense-equal-compute`: as many steps as all paths together (paths x rounds x H): equal compute;
- `dense-large` (when `eval.large_hidden_size` is set): a wider / deeper dense model (the paper's
  1.3B against 150M paths: about 8x a path's parameters) for as many steps as each path.

`dipaco baselines` trains them (`dipaco.optim.dense.train_dense`); `dipaco eval` loads them
(`dipaco.optim.dense.load_dense`) and scores the same tokens as the routed model.
"""

from __future__ import annotations

import dataclasses

from dipaco.config import EvalConfig, ModelConfig

EQUAL_STEPS, EQUAL_COMPUTE, LARGE = "dense-equal-steps", "dense-equal-compute", "dense-large"


def baseline_steps(*, steps_per_path: int, n_paths: int, large: bool) -> dict[str, int]:
    """The inner-step budget of each baseline (`dense-large` only when `large`)."""
    budgets = {EQUAL_STEPS: steps_per_path, EQUAL_COMPUTE: steps_per_path * n_paths}
    if large:
        budgets[LARGE] = steps_per_path
    return budgets


def baseline_model_config(model: ModelConfig, settings: EvalConfig, name: str) -> ModelConfig:
    """The architecture of a baseline: a path's (`model`), or the `dense-large` one (`settings`'
    width and depth, a path's head size)."""
    if name != LARGE:
        return model
    head = model.hidden_size // model.n_heads
    return dataclasses.replace(model, hidden_size=settings.large_hidden_size,
                               n_heads=settings.large_hidden_size // head,
                               n_layers=settings.large_n_layers or model.n_layers)
