"""The dense baselines DiPaCo is compared with: their names, step budgets and architectures.

    budgets = baseline_steps(steps_per_path=rounds * H, n_paths=4, large=cfg.eval.large_hidden_size > 0,
                             pretrain_steps=cfg.pretrain_steps)
    model_config = baseline_model_config(cfg.model, cfg.eval, "dense-large")

- `dense-equal-steps`: as many inner steps as each path took (rounds x H): equal wall-clock when
  the islands run in parallel, the paper's headline comparison;
- `dense-equal-compute`: as many steps as all paths together (paths x rounds x H): equal compute;
- `dense-large` (when `eval.large_hidden_size` is set): a wider / deeper dense model (the paper's
  1.3B against 150M paths: about 8x a path's parameters) for as many steps as each path.

The warm start counts: with P warm-start steps (`Config.pretrain_steps`), DiPaCo's paths start from a dense model trained for P
steps, so every budget is P + the grid's share above: a path's P + rounds x H, all paths' P + paths x
rounds x H (docs/evaluation.md, "Warm start"). With `eval.baselines_init: warm-start` (the default, as
in the DiLoCo / DiPaCo papers, where every model starts from the same pretrained checkpoint) the
path-sized baselines continue from that very dense model for the rest of their budget (`own_steps`);
with `scratch`, and always for `dense-large` (another shape), a baseline trains its whole budget from a
fresh model in one schedule.

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


def continues_warm_start(name: str, *, init: str, pretrain_steps: int, warm_start: bool) -> bool:
    """Whether baseline `name` starts from the dense warm start rather than from scratch: `init` (the
    config's `eval.baselines_init`) is `warm-start`, the paths started from a warm start (`pretrain_steps`
    > 0 and `warm_start`), and the baseline is path-sized (`dense-large` is not)."""
    return init == "warm-start" and pretrain_steps > 0 and warm_start and name != LARGE


def own_steps(budget: int, *, pretrain_steps: int, warm_started: bool) -> int:
    """The steps a baseline trains itself: its whole `budget` from scratch, the rest of it after the
    `pretrain_steps` of the warm start it continues from."""
    return budget - pretrain_steps if warm_started else budget


def baseline_model_config(model: ModelConfig, settings: EvalConfig, name: str) -> ModelConfig:
    """The architecture of a baseline: a path's (`model`), or the `dense-large` one (`settings`'
    width and depth, a path's head size)."""
    if name != LARGE:
        return model
    head = model.hidden_size // model.n_heads
    return dataclasses.replace(model, hidden_size=settings.large_hidden_size,
                               n_heads=settings.large_hidden_size // head,
                               n_layers=settings.large_n_layers or model.n_layers)
