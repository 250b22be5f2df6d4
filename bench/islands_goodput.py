"""Goodput by work of bench/bench_islands.py's rows, from what its results JSON records: the applied tokens
over (the run's seconds x the islands' failure-free capacity, islands x tokens per step / the pace).

    python bench/bench_islands.py --recompute-goodput    # bench/results/islands.{json,md}, then the simulator's column

A results file measured before goodput by work (its rows' `goodput` was time-based) keeps that figure as
`goodput_by_time`; the by-work figure is exact from the rows' `applied_tokens` and `run_seconds` and the
setting's islands and pace, with tokens per step from the config the rows ran (`setting.common`), checked
against the failure-free sync row (every sync task is a whole task: tokens = tasks x inner steps x tokens
per step).
"""

from __future__ import annotations

from dipaco.config import load_config


def tokens_per_step(setting: dict) -> int:
    """inner.batch_size x sharding.seq_len of the config the rows ran (recorded, or loaded from it)."""
    if setting.get("tokens_per_step"):
        return int(setting["tokens_per_step"])
    config = load_config(setting["config"], setting["common"])
    return config.inner.batch_size * config.sharding.seq_len


def capacity(setting: dict) -> float:
    """The islands' failure-free tokens per second: islands x tokens per step / the pace."""
    return setting["islands"] * tokens_per_step(setting) / setting["step_seconds"]


def check_tokens_per_step(record: dict) -> None:
    """The failure-free sync row's applied tokens are its tasks' whole tokens; a mismatch means the config
    read is not the one the rows ran."""
    s = record["setting"]
    sync = next((r for r in record.get("rows", []) if r["name"] == "sync"), None)
    if sync is None or "applied_tasks" not in sync:
        return
    expected = sync["applied_tasks"] * s["inner_steps"] * tokens_per_step(s)
    if sync["applied_tokens"] != expected:
        raise ValueError(f"the sync row applied {sync['applied_tokens']} tokens, not {sync['applied_tasks']} tasks x "
                         f"{s['inner_steps']} steps x {tokens_per_step(s)} tokens per step: the config "
                         f"({s['config']} with setting.common) is not the one the rows ran")


def recompute(record: dict) -> dict:
    """The record with every row's `goodput` by work (a time-based `goodput` measured before kept as
    `goodput_by_time`) and the setting's tokens per step and capacity; in place, and returned."""
    check_tokens_per_step(record)
    s = record["setting"]
    s["tokens_per_step"] = tokens_per_step(s)
    s["capacity_tokens_per_second"] = capacity(s)
    for row in record.get("rows", []):
        if "goodput_by_time" not in row:
            row["goodput_by_time"] = row["goodput"]
            record["goodput_recomputed"] = ("goodput by work recomputed from the rows' applied_tokens and run_seconds "
                                            "(python bench/bench_islands.py --recompute-goodput); the time-based "
                                            "figure measured is goodput_by_time")
        row["goodput"] = row["applied_tokens"] / (row["run_seconds"] * s["capacity_tokens_per_second"])
    return record
