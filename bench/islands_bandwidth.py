"""bench/bench_islands.py's bandwidth rows (`--bandwidth B [B ...]`): the same paced island rows (`island_row`:
`dipaco train` then `dipaco eval`, failure-free, sync) with every island's store traffic limited to B bytes per
second each way (`faults.store_bandwidth`, dipaco/store/bandwidth.py), for float32 DiLoCo and a compressed
setting (`--variants`, bench/bench_compression.py's names); goodput by work per bandwidth, the bandwidth each
setting needs for 90%, and whether the compressed one keeps 90% where float32 is at 50% or less.

    python bench/bench_islands.py --bandwidth 1e5 3e5 1e6 1e7              # bench/results/islands-bandwidth.*
    python bench/bench_islands.py --bandwidth 1e5 --variants "float32" --rounds 2 --name islands-bw-smoke

A task moves its pseudo-gradient up and its modules (or module updates) down at B; with the pace p a task's
inner loop takes T = H p, so a setting whose task moves S bytes each way is about T / (T + S / B) busy.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

from bench.bench_compression import VARIANTS, slug
from bench.bench_islands import Row, Setting, git_commit, island_row, log, prepare
from bench.recording import RESULTS, markdown_table, write_results

BUSY, FLOAT32_AT_MOST = 0.90, 0.50  # the bar: the chosen setting >= 90% where float32 DiLoCo is <= 50%
DEFAULT_VARIANTS = ("float32", "topk 1% 2b EF decay 0.95")


def bandwidth_rows(bandwidths: list[float], variants: list[str]) -> list[tuple[str, float, Row]]:
    """One failure-free sync row per (variant, bandwidth), with them; bandwidth 0 = unlimited."""
    return [(v, b, Row(f"{slug(v)}-bw{b:g}", "sync", f"store {_rate(b)} each way",
                       overrides=[*VARIANTS[v], f"faults.store_bandwidth={b:g}"]))
            for v in variants for b in bandwidths]


def needed_for(points: dict[float, float], target: float = BUSY) -> dict:
    """From {bandwidth: goodput} (0 = unlimited): the lowest measured bandwidth at `target` or above, and the
    bandwidth where goodput crosses `target` interpolated in log bandwidth between the measured points around it."""
    limited = sorted((b, g) for b, g in points.items() if b > 0)
    reached = [b for b, g in limited if g >= target]
    crossing = None
    for (b0, g0), (b1, g1) in zip(limited, limited[1:]):
        if g0 < target <= g1:
            crossing = math.exp(math.log(b0) + (target - g0) / (g1 - g0) * (math.log(b1) - math.log(b0)))
            break
    return {"lowest_measured": min(reached) if reached else None, "interpolated": crossing}


def summarize(rows: list[dict], variants: list[str]) -> dict:
    """Goodput by variant and bandwidth, the bandwidth each needs for 90%, and the issue's check."""
    goodput = {v: {r["bandwidth"]: r["goodput"] for r in rows if r["variant"] == v} for v in variants}
    float32, others = variants[0], variants[1:]
    checks = {}
    for v in others:
        where = [b for b, g in goodput[v].items() if b > 0 and g >= BUSY and goodput[float32].get(b, 1) <= FLOAT32_AT_MOST]
        checks[v] = {"bandwidths": sorted(where), "passes": bool(where)}
    return {"goodput": goodput, "needed_for_90": {v: needed_for(goodput[v]) for v in variants}, "checks": checks,
            "baseline": float32}


def _rate(b: float | None) -> str:
    return "—" if b is None else (f"{b / 1e6:.3g} MB/s" if b else "unlimited")


def markdown(out: dict) -> str:
    s = out["summary"]
    bandwidths = sorted({b for by in s["goodput"].values() for b in by}, key=lambda b: (b == 0, b))
    lines = [[v, *(f"{by[b]:.1%}" if b in by else "—" for b in bandwidths), _rate(s["needed_for_90"][v]["lowest_measured"]),
              _rate(s["needed_for_90"][v]["interpolated"])] for v, by in s["goodput"].items()]
    checks = [f"- {v}: ≥ {BUSY:.0%} where {s['baseline']} is ≤ {FLOAT32_AT_MOST:.0%}: "
              + (f"yes, at {', '.join(_rate(b) for b in c['bandwidths'])}" if c["passes"] else "**no** (at no measured bandwidth)")
              for v, c in s["checks"].items()]
    first = {r["variant"]: r["bytes_per_result"] for r in reversed(out["rows"])}  # the same at every bandwidth
    bytes_lines = [f"- {v}: {per.get('up_pseudo_gradient', 0):,.0f} B pseudo-gradient up, "
                   f"{per.get('down_module_update', 0):,.0f} B module updates and {per.get('down_module', 0):,.0f} B "
                   f"whole modules down per applied result (measured at the store)" for v, per in first.items()]
    return (
        "# Goodput by work against the store bandwidth of each island\n\n"
        f"bench/bench_islands.py's failure-free sync rows ({out['setting']['islands']} paced islands, pace "
        f"{out['setting']['step_seconds']:g} s, H = {out['setting']['inner_steps']}, {out['setting']['rounds']} rounds) "
        "with every island's store reads and writes limited to the bandwidth each way (`faults.store_bandwidth`, a "
        "token bucket in the store client, dipaco/store/bandwidth.py). Goodput by work as in islands.md#goodput. "
        "Needed for 90%: the lowest measured bandwidth at 90% or more, and the crossing interpolated in log bandwidth.\n\n"
        + markdown_table(["variant", *(_rate(b) for b in bandwidths), "90%: lowest measured", "90%: interpolated"], lines)
        + "\n\n" + "\n".join(checks) + "\n\n" + "\n".join(bytes_lines)
        + f"\n\nWall time: {out['total_seconds'] / 60:.0f} min.\n"
    )


def main(setting: Setting, *, bandwidths: list[float], variants: list[str], keep: bool) -> None:
    """Train the rows (the ones the results file has are kept with `keep`), writing the results after each."""
    started = time.perf_counter()
    if setting.name == "islands":
        setting = dataclasses.replace(setting, name="islands-bandwidth")
    path = RESULTS / f"{setting.name}.json"
    previous = json.loads(path.read_text()) if keep and path.exists() else {}
    rows = {r["name"]: r for r in previous.get("rows", [])}
    base = prepare(setting)
    out = {"setting": {**dataclasses.asdict(setting), "islands": setting.islands, "common": setting.common,
                       "bandwidths": bandwidths, "variants": variants}, "rows": []}

    def record() -> None:
        out["rows"] = [r for r in rows.values() if r["variant"] in variants]
        out["total_seconds"] = previous.get("total_seconds", 0.0) + time.perf_counter() - started
        out["summary"] = summarize(out["rows"], variants)
        write_results(setting.name, out, markdown(out))

    for variant, bandwidth, row in bandwidth_rows(bandwidths, variants):
        if row.name in rows:
            continue
        log(f"{row.name}: {variant} at {_rate(bandwidth)}")
        rows[row.name] = {**island_row(setting, base, row), "variant": variant, "bandwidth": bandwidth,
                          "commit": git_commit()}
        record()
    record()
    print(path.with_suffix(".md").read_text())


def check_variants(variants: list[str]) -> list[str]:
    """`variants`, float32 DiLoCo first (the baseline of the check), each one bench/bench_compression.py knows."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or variants[0] != "float32":
        raise SystemExit(f"--variants {variants}: float32 first, then names of bench/bench_compression.py "
                         f"({'unknown: ' + ', '.join(unknown) if unknown else 'float32 is not first'})")
    return variants
