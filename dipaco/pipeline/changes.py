"""What a `--config` given for an existing run changes, said before anything runs or is written.

    lines = config_changes(run_config, config, run=RunDir("runs/tiny"))   # [] when they agree

Every command reads the run's own `config.yaml` when no `--config` is given; with one, each key that
differs from the run's is named with what it does: a key a finished stage's artifacts were made with
(`fingerprints.STAGE_KEYS`) is refused by the commands that read them (the drift check); a change to the
run's length (`run.rounds`, `inner.steps`) says how many inner steps per path the run now plans, how
many are trained and whether `dipaco train` trains more; any other key applies from this command on.
"""

from __future__ import annotations

import json
from typing import Any

from dipaco.config import Config
from dipaco.pipeline.fingerprints import MADE_BY, STAGE_KEYS, completed, stage_values
from dipaco.run_dir import RunDir

LENGTH_KEYS = ("run.rounds", "inner.steps")  # the run's planned inner steps per path: their product


def flat(config: Config) -> dict[str, Any]:
    """`section.key` → value of every key of `config`."""
    return {f"{section}.{key}": value for section, keys in config.to_dict().items() for key, value in keys.items()}


def config_changes(old: Config, new: Config, *, run: RunDir) -> list[str]:
    """One line per key that differs between the run's config `old` and `new`, saying what the change does."""
    before, after = flat(old), flat(new)
    changed = [key for key in after if before.get(key) != after[key]]
    made = {stage: stage_values(old, stage) for stage in STAGE_KEYS if _made(run, stage)}
    lines = []
    for key in changed:
        change = f"{key}: {json.dumps(before.get(key), default=str)} → {json.dumps(after[key], default=str)}"
        stages = [stage for stage, values in made.items() if key in values]
        if stages:
            lines.append(f"{change}: the run's {MADE_BY[stages[0]]} were made with the old value; the commands "
                         f"that read them refuse to go on with the new one (set it back to keep this run)")
        elif key not in LENGTH_KEYS:
            lines.append(f"{change}: used by this command and the ones after it")
    if any(key in changed for key in LENGTH_KEYS):
        lines.append(_length_change(old, new, run=run))
    return lines


def _made(run: RunDir, stage: str) -> bool:
    return completed(run, stage) if stage != "train" else run.train_summary.exists()


def _length_change(old: Config, new: Config, *, run: RunDir) -> str:
    """What a new run.rounds or inner.steps does to the run's length (inner steps per path)."""
    planned_old = old.run.rounds * old.inner.steps
    planned = new.run.rounds * new.inner.steps
    what = (f"run.rounds × inner.steps: {old.run.rounds} × {old.inner.steps} → {new.run.rounds} × "
            f"{new.inner.steps}: the run plans {planned} inner steps per path (was {planned_old}), the inner lr "
            f"schedule spans them")
    trained = _trained_steps(run)
    if trained is None:
        return what
    if planned > trained:
        return (f"{what}; {trained} are trained, so `dipaco train` trains {planned - trained} more per path, in "
                f"tasks of {new.inner.steps} steps")
    return f"{what}; {trained} are trained: `dipaco train` trains no more"


def _trained_steps(run: RunDir) -> int | None:
    """The inner steps every path has had applied, as train.json says (None before training)."""
    try:
        return int(json.loads(run.train_summary.read_text())["inner_steps_per_path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
