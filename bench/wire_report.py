"""bench/results/wire.md from bench/bench_compression.py's rows (`bench.wire_rows`): the table, the float32
check, and the verdict on the chosen setting, each computed from the rows.

    verdict(row)        # the issue's bars: >= 100x training traffic, <= +1.0% mean and <= +2% each seed, ...
    markdown(results)   # the page
"""

from __future__ import annotations

from bench.recording import markdown_table
from dipaco.tables import format_table

MIN_RATIO, MIN_RATIO_EVERYTHING, MIN_ROUNDS = 100.0, 50.0, 100  # the bars
MAX_MEAN_PCT, MAX_SEED_PCT, MIN_SEEDS = 1.0, 2.0, 2
FLOAT32_SLACK = 1.05  # float32 DiLoCo's training traffic <= this x 2 x the path's float32 bytes


def verdict(row: dict) -> dict:
    """The issue's bars for one row, each seed's ratios and perplexities included (not only their means)."""
    seeds = row["per_seed"]
    by_seed = row["perplexity_vs_float32_pct_by_seed"]
    checks = {
        "ratio_training_traffic": min(s["bytes"]["ratio_training_traffic"] for s in seeds.values()) >= MIN_RATIO,
        "ratio_everything": min(s["bytes"]["ratio_everything"] for s in seeds.values()) >= MIN_RATIO_EVERYTHING,
        "rounds": row["rounds"] >= MIN_ROUNDS,
        "seeds": len(row["baseline_seeds"]) >= MIN_SEEDS,
        "perplexity_mean": row["perplexity_vs_float32_pct"] is not None and row["perplexity_vs_float32_pct"] <= MAX_MEAN_PCT,
        "perplexity_each_seed": bool(by_seed) and max(by_seed.values()) <= MAX_SEED_PCT,
    }
    return {**checks, "passes": all(checks.values())}


def float32_check(row: dict) -> dict:
    """A float32 DiLoCo row's training traffic per path-round against 2 x the path's float32 bytes."""
    worst = max(s["bytes"]["training_traffic_per_result"] / s["bytes"]["float32_per_result"]
                for s in row["per_seed"].values())
    return {"variant": row["variant"], "training_over_2x_float32": worst, "passes": worst <= FLOAT32_SLACK}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}%"


def table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    headers = ["variant", "inner", "outer decay", "K", "rounds", "seeds", "perplexity (mean)", "vs float32 (mean)",
               "vs float32 (each seed)", "pseudo-gradient up", "module updates down",
               "modules down (joining + fallbacks)", "fallbacks", "inner state up / down",
               "manifests + checksums read", "board + heartbeats", "x training traffic", "x everything",
               "x vs data parallel"]
    out = []
    for r in rows:
        per = r["bytes_per_result"]
        small = sum(v for k, v in per.items() if k.split("_", 1)[1] in ("board", "heartbeats"))
        out.append([r["variant"], r["inner_optimizer"], r["outer_decay"], str(r["inner_checkpoint_every"]),
                    str(r["rounds"]), ",".join(map(str, r["seeds"])), f"{r['perplexity']:.2f}",
                    _pct(r["perplexity_vs_float32_pct"]),
                    " ".join(f"{s}: {_pct(v)}" for s, v in r["perplexity_vs_float32_pct_by_seed"].items()) or "-",
                    f"{per.get('up_pseudo_gradient', 0):,.0f}", f"{per.get('down_module_update', 0):,.0f}",
                    f"{per.get('down_module', 0):,.0f}", "-" if r["module_fallbacks"] is None else str(r["module_fallbacks"]),
                    f"{per.get('up_inner_state', 0):,.0f} / {per.get('down_inner_state', 0):,.0f}",
                    f"{per.get('down_manifests', 0):,.0f}", f"{small:,.0f}", f"{r['ratio_training_traffic']:.1f}",
                    f"{r['ratio_everything']:.1f}",
                    f"{r['ratio_vs_data_parallel']:.1f}" if r["ratio_vs_data_parallel"] else "-"])
    return headers, out


def verdict_lines(results: dict) -> list[str]:
    rows = {r["variant"]: r for r in results["rows"]}
    how = "`--chosen`" if results.get("chosen_by") == "--chosen" else (
        f"the lowest perplexity at ≥ {results['min_ratio']:g}x on training traffic at the first seed")
    lines = [f"Chosen setting ({how}): {', '.join(results['chosen']) or 'none reaches that ratio'}."]
    for name in results["chosen"]:
        r, v = rows[name], results["verdicts"][name]
        mark = {True: "yes", False: "**no**"}
        lines.append(
            f"- {name} against {r['baseline']} (seeds {', '.join(map(str, r['baseline_seeds']))}): "
            f"≥ {MIN_RATIO:g}x training traffic at every seed {mark[v['ratio_training_traffic']]} "
            f"({r['ratio_training_traffic']:.1f}x mean); perplexity ≤ +{MAX_MEAN_PCT:g}% on the mean "
            f"{mark[v['perplexity_mean']]} ({_pct(r['perplexity_vs_float32_pct'])}); ≤ +{MAX_SEED_PCT:g}% at each seed "
            f"{mark[v['perplexity_each_seed']]}; ≥ {MIN_SEEDS} seeds {mark[v['seeds']]}; ≥ {MIN_ROUNDS} rounds "
            f"{mark[v['rounds']]} ({r['rounds']}); ≥ {MIN_RATIO_EVERYTHING:g}x everything at "
            f"K = {r['inner_checkpoint_every']} {mark[v['ratio_everything']]} ({r['ratio_everything']:.1f}x). "
            f"**{'Passes' if v['passes'] else 'Fails'}.**")
    whole = [r["variant"] for r in results["rows"] if not r["bytes_per_result"].get("down_module_update")
             and r["bytes_per_result"].get("down_module")]
    if whole:
        lines.append(f"- No module updates downloaded, only whole modules, in: {', '.join(whole)} (code before "
                     "compressed downloads, or `compression.download: full`): their training traffic leaves the "
                     "module downloads out, so their x training traffic and float32 check say nothing about downloads.")
    for check in results["float32_checks"]:
        lines.append(f"- Float32 check, {check['variant']}: training traffic {check['training_over_2x_float32']:.3f} "
                     f"x 2 x the path's float32 bytes (≤ {FLOAT32_SLACK}: {'yes' if check['passes'] else '**no**'}).")
    return lines


def markdown(results: dict) -> str:
    headers, rows = table(results["rows"])
    first = results["rows"][0]
    tokens = next(iter(first["per_seed"].values()))["scored_tokens"]
    return (
        "# Every byte on the wire against quality: codecs, inner optimizers and outer decay, one island per path\n\n"
        f"`{results['config']}`'s recipe with {' '.join(results['common'])}; per seed every variant from the same warm "
        f"start, shards, version 0 and data order; routed perplexity (prefix) on {tokens:,} held-out tokens, against "
        f"float32 DiLoCo with the same inner optimizer and outer decay, on the seeds both trained. Bytes: measured by "
        f"the islands at the store (train.json's `traffic`), per applied result (path-round). **x training "
        f"traffic**: float32 DiLoCo's 2 x the path's float32 bytes over pseudo-gradients up + module updates down + "
        f"manifests and checksums read. Full module reads (an island's joining read and its counted fallbacks, "
        f"train.json's `module_fallbacks`) are **not** training traffic; they are in **x everything**: every byte "
        f"the islands moved but the published inputs (shards, config), inner-state checkpoints every K tasks "
        f"(`resilience.inner_checkpoint_every`, 0 = only on hand-offs and a path's last task), board reads and "
        f"heartbeats included. **x vs data parallel**: a ring all-reduce of a float32 gradient per inner step among "
        f"the same islands, both ways, over everything. topk: per chunk the `density` largest at `bits` bits; EF = "
        f"error feedback, decay = its β (SparseLoCo; below 1 the accumulator takes the outer momentum's place); "
        f"decay keep = `outer.decay=keep` (the outer momentum kept in the inner lr's decay).\n\n"
        + markdown_table(headers, rows) + "\n\n" + "\n".join(verdict_lines(results))
        + f"\n\nWall time: {results['seconds'] / 60:.0f} min this invocation; the runs' training "
        f"{results['train_seconds'] / 60:.0f} min (train.json's `seconds`, summed over every run, earlier "
        f"invocations' included).\n\n```\n" + format_table(headers, rows) + "\n```\n"
    )
