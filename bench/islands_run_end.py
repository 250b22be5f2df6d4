"""Goodput before the run's end: the work the islands applied until the first of them ran out of work, over that
time x the capacity. A run of fixed length whose paths' steps are sequential ends when its unluckiest path has
trained its last step; the islands whose paths are done wait from their last result to the run's end. This
figure leaves that wait out, so beside the whole run's goodput it says how much of the loss is the run's end
(which a longer run pays a smaller share of) and how much each failure costs while every island has work.

    before = before_the_end(applied_tasks(store), run_seconds=480.0)  # bench/islands_applied.py's
    goodput = before["tokens"] / (before["seconds"] * capacity)

The run's start is its end minus the run's seconds (first heartbeat to last commit); its end is taken as the last
applied result's upload (its commit follows within the coordinator's tick). The cut is the earliest of the
islands' last uploads. Results uploaded by the cut count whole; an island's result in flight at the cut counts
the share of its tokens that the time from the island's previous upload (or the run's start) to the cut is of
the time to its own upload.
"""

from __future__ import annotations


def before_the_end(results: list[dict], *, run_seconds: float) -> dict | None:
    """{"seconds": from the run's start to the cut, "tokens": applied by then, "cut_share": of the run's seconds}
    from the applied `results` (island, finished: its upload on the island's wall clock, tokens); None without
    results or a clock."""
    if not results or any(r["finished"] <= 0 for r in results):
        return None
    end = max(r["finished"] for r in results)
    start = end - run_seconds
    by_island: dict[str, list[dict]] = {}
    for r in sorted(results, key=lambda r: r["finished"]):
        by_island.setdefault(r["island"], []).append(r)
    cut = min(rs[-1]["finished"] for rs in by_island.values())
    tokens = 0.0
    for rs in by_island.values():
        previous = start
        for r in rs:
            if r["finished"] <= cut:
                tokens += r["tokens"]
                previous = r["finished"]
                continue
            span = r["finished"] - previous
            tokens += r["tokens"] * min(1.0, max(0.0, (cut - previous) / span)) if span > 0 else 0.0
            break
    return {"seconds": cut - start, "tokens": tokens, "cut_share": (cut - start) / run_seconds}


def goodput_before_end(row: dict, *, capacity: float) -> float | None:
    """A results row's goodput before the run's end (None: not measured)."""
    before = row.get("before_the_end")
    return before["tokens"] / (before["seconds"] * capacity) if before and before["seconds"] > 0 < capacity else None
