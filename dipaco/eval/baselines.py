"""The dense baselines DiPaCo is compared with: their names, step budgets and architectures.

    budgets = baseline_steps(steps_per_path=rounds * H, n_paths=4, large=cfg.eval.large_hidden_size > 0,
                             pretrain_steps=cfg.pretrain.steps)
    model_config = baseline_model_config(cfg.model, cfg.eval, "dense-large")

- `dense-equal-steps`: as many inner steps as each path took (rounds x H): equal wall-clock when
  the islands run in parallel, the paper's headline comparison;
- `dense-equal-compute`: as many steps as all paths together (paths x rounds x H): equal compute;
- `dense-large` (when `eval.large_hidden_size` is set): a wider / deeper dense model (the paper's
  1.3B against 150M paths: about 8x a path's parameters) for as many steps as each path.

The warm start counts: with `pretrain.steps` = P, DiPaCo's paths start from a dense model trained for P
steps, so every baseline trains from scratch for P more steps than the grid's share above, in one
schedule (docs/evaluation.md, "Warm start"): a path's P + rounds x H, all paths' P + paths x rounds x H.

`dipaco baselines` trains them (`dipaco.optim.dense.train_dense`); `dipaco eval` loads them
(`dipaco.optim.dense.load_dense`) and scores the same tokens as the routed model.
"""

from __future__ import annotations

import dataclasses

from dipaco.config import EvalConfig, ModelConfig

EQUAL_STEPS, EQUAL_COMPUTE, LARGE = "dense-equal-steps", "dense-equal-compute", "dense-large"


def baseline_steps(*, steps_per_path: int, n_paths: int, large: bool, pretrain_steps: int = 0) -> dict[str, int]:
    """The step budget of each baseline (`dense-large` only when `large`), the `pretrain_steps` of the
    dense warm start the paths started from included."""
    budgets = {EQUAL_STEPS: pretrain_steps + steps_per_path, EQUAL_COMPUTE: pretrain_steps + steps_per_path * n_paths}
    if large:
        budgets[LARGE] = pretrain_steps + steps_per_path
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
