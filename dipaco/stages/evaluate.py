"""Routed evaluation (the paper's protocol) against the dense baselines.

    dipaco eval --config configs/tiny.yaml --run runs/tiny

Each held-out test document is routed by the text of its first `routing.prefix_tokens` tokens to one
path (`dipaco.eval.prefix_routing`), and that path scores the tokens after the prefix. Only one path
is in memory at a time. The baselines score the very same tokens, so the perplexities are
comparable. Then every eval mode (`eval.modes`, `dipaco.eval.modes`) is computed from the same table
of per-token losses, so the `prefix` mode is the headline row, not scored again. Results go to
`eval.json` (with the training's store traffic as measured, `traffic`: `dipaco.store.ledger`) and are printed as a table; each model's row says how many tokens it scored
(`scored_tokens`) and that each document's first `skipped_prefix_tokens` (the routing prefix) were not. Every model's row says the dense warm-start steps it started
from (`pretrain_steps`), its own steps, the steps in all, and the training tokens in all (warm start
included): the baselines' budgets count the warm start (`dipaco.eval.dense_baselines`), which a path-sized
baseline continues from by default (its row then has the warm start's steps and tokens too). Results holding a
NaN or infinite number (a broken module) never replace eval.json: they go to `eval-rejected.json` and
the command fails naming them. A path no test document was routed to is not broken: its per-path and
all-paths cells are null and `paths_without_test_documents` names it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from functools import partial
from pathlib import Path

import numpy as np

from dipaco.atomic import write_json
from dipaco.config import Config
from dipaco.device import resolve_device
from dipaco.eval.dense_baselines import continues_warm_start
from dipaco.eval.document_losses import document_losses
from dipaco.eval.modes import LossTable, evaluate_modes, format_modes, prefix_routes, routed_scores
from dipaco.eval.prefix_routing import PrefixRouter
from dipaco.eval.scoring import perplexity, score_documents, token_losses
from dipaco.model.path_model import count_parameters
from dipaco.model.topology import Topology
from dipaco.optim.dense import is_trained, load_dense
from dipaco.pipeline.context import PathFactory, baseline_budgets
from dipaco.pipeline.fingerprints import check
from dipaco.run_dir import RunDir
from dipaco.store.ledger import read_summary
from dipaco.store.module_store import ModuleStore
from dipaco.store.run_state import applied_tokens
from dipaco.tables import format_table
from dipaco.threads import use_threads

log = logging.getLogger(__name__)


def _routed_row(config: Config, run: RunDir, factory: PathFactory, *, round: int, nll: np.ndarray,
                tokens: np.ndarray, summary: dict) -> dict:
    """The routed mixture's row of the comparison table: its size at module version `round`, the steps and
    tokens it trained (the warm start's included), and its perplexity over the routed documents' `nll` and
    `tokens` (one entry per document)."""
    topology, store = factory.topology, factory.store
    warm = warm_start(config, run)
    steps = steps_per_path(store, topology.n_paths, tokens_per_step=config.inner.batch_size * factory.reader.seq_len,
                           fallback=round * config.inner.steps)
    return {
        "model": f"DiPaCo {'x'.join(map(str, topology.levels))} routed",
        "paths": topology.n_paths,
        "params_per_path": count_parameters(factory.new_model()),
        "params_total": sum(t.numel() for name in topology.modules for t in store.read_module(round, name).values()),
        "pretrain_steps": warm["steps"],
        "steps_per_path": steps,
        "steps_total": warm["steps"] + steps,
        "tokens_seen": summary.get("tokens"),
        "train_tokens_total": warm["tokens"] + summary["tokens"] if summary.get("tokens") is not None else None,
        "train_seconds": summary.get("seconds"),
        "perplexity": perplexity(nll.sum(), tokens.sum()),
        "scored_tokens": int(tokens.sum()),
        "skipped_prefix_tokens": factory.prefix_tokens,
    }


def _baseline_rows(config: Config, run: RunDir, factory: PathFactory, *, docs: list[np.ndarray],
                   scoring: dict) -> list[dict]:
    """A row per trained dense baseline, each scoring the tokens after the routing prefix of every test
    document in `docs` (the routed paths' tokens); a baseline not trained is left out (logged)."""
    prefix, device = factory.prefix_tokens, scoring["device"]
    rows = []
    for name, budget in baseline_budgets(config, factory.topology.n_paths).items():
        folder = run.baselines / name
        if not is_trained(folder):
            log.info("baseline %s not trained; run `dipaco baselines` to compare with it", name)
            continue
        model, info = load_dense(folder, factory.spec)
        started = int(info.get("pretrain_steps", 0))  # the warm start it continued from (0: from scratch)
        _warn_if_stale(config, name, folder, info, budget=budget)
        b_nll, b_tokens = score_documents(model.to(device), docs, skip=prefix, **scoring)  # the routed paths' tokens
        rows.append({"model": name, "paths": 1, "params_per_path": info["parameters"],
                     "params_total": info["parameters"], "pretrain_steps": started, "steps_per_path": info["steps"],
                     "steps_total": started + info["steps"], "tokens_seen": info["tokens"],
                     "train_tokens_total": int(info.get("pretrain_tokens", 0)) + info["tokens"],
                     "train_seconds": info["seconds"], "perplexity": perplexity(b_nll.sum(), b_tokens.sum()),
                     "scored_tokens": int(b_tokens.sum()), "skipped_prefix_tokens": prefix})
    return rows


def _warn_if_stale(config: Config, name: str, folder: Path, info: dict, *, budget: int) -> None:
    """Log a warning when baseline `name` (its `info` as saved in `folder`) was trained for another budget
    (warm-start steps included) or from another init (`eval.baselines_init`) than `config` asks for."""
    started = int(info.get("pretrain_steps", 0))
    if started + info["steps"] != budget:
        log.warning("baseline %s in %s trained %d steps (+%d of the warm start), but this config's budget is %d "
                    "(%d warm-start steps included): delete the folder and run `dipaco baselines` again", name,
                    folder, info["steps"], started, budget, config.pretrain_steps)
    init = "warm-start" if continues_warm_start(name, init=config.eval.baselines_init,
                                                pretrain_steps=config.pretrain_steps,
                                                warm_start=config.warm_start.init_modules) else "scratch"
    if info.get("init", "scratch") != init:
        log.warning("baseline %s in %s was trained from %s, this config asks for %s (eval.baselines_init): "
                    "delete the folder and run `dipaco baselines` again", name, folder,
                    info.get("init", "scratch"), init)


def _paths_without_documents(per_path: list[dict]) -> list[int]:
    """The paths no test document was routed to (logged): their cells are null, not NaN, since an empty path
    is not a broken one."""
    empty = [row["path"] for row in per_path if not row["documents"]]
    if empty:
        log.warning("no test document was routed to path(s) %s: they are not scored (null in eval.json)",
                    ", ".join(map(str, empty)))
    return empty


def _evaluate_modes(config: Config, factory: PathFactory, table: LossTable, *, route: PrefixRouter,
                    paths: np.ndarray, modes: list[str], rounds: dict[int, int], best: bool) -> dict:
    """Every eval mode in `modes` from the loss `table`, at the last `rounds` and, when `best`, also at each
    path's round with the lowest validation loss (`dipaco.eval.modes`)."""
    topology = factory.topology
    best_rounds = None
    if best:
        from dipaco.eval.early_stopping import best_of_run

        best_rounds = best_of_run(factory.store, topology, factory.spec, factory.validation,
                                  device=resolve_device(config.hardware.device))[0]
    return evaluate_modes(table, route=route, paths=paths, modes=modes, rounds=rounds,
                          best=best_rounds, n_paths=topology.n_paths, prefix=factory.prefix_tokens,
                          shortlist=route.shortlist)


def _refuse_non_finite(run: RunDir, results: dict, *, round: int) -> None:
    """When `results` (of module version `round`) hold a NaN or infinite number: write them to
    eval-rejected.json (eval.json is left as it was) and fail naming the numbers."""
    broken = non_finite(results)
    if broken:
        rejected = write_json(run.root / "eval-rejected.json", results)
        raise ValueError(f"evaluation gave non-finite numbers ({', '.join(broken[:4])}); {run.eval_results} "
                         f"was not replaced, the results are in {rejected}. Check the store's module files "
                         f"(round {round}) and the baselines")


def evaluate(config: Config, run: RunDir, *, modes: list[str] | None = None, best: bool | None = None) -> dict:
    """The routed model (prefix routing, last round) against the baselines, then every eval mode
    (`modes`, default `eval.modes`; each path at its best round too when `best`, default `eval.best`)."""
    use_threads(config.hardware.threads_per_island)
    check(run, config, ("route", "shard", "train"))  # shards of another router would score nonsense
    factory = PathFactory(config, run)
    device = resolve_device(config.hardware.device)
    topology, store = factory.topology, factory.store
    round = store.current_round()
    if round == 0:
        raise ValueError(f"store {store.url} has no trained round: run `dipaco train --run {run.root}` first")
    docs, _, shard_paths = factory.reader.test_documents()
    prefix = factory.prefix_tokens
    router = PrefixRouter(factory.router, factory.tokenizer, topology, prefix_tokens=prefix)
    scoring = dict(batch_size=config.eval.batch_size, device=device, precision=config.hardware.precision,
                   pad_id=factory.tokenizer.pad_token_id or 0)
    table = LossTable(docs=docs, load=lambda path, version: factory.load_path(path=path, round=version, device=device),
                      score=partial(token_losses, **scoring))
    paths = router(docs)
    last = {topology.representative(q): round for q in range(topology.n_routed)}  # replicas are one model
    routed = routed_scores(table, prefix_routes(docs, paths, prefix=prefix), last, topology.n_paths)
    nll, tokens = routed["nll"], routed["tokens"]
    summary = _load(run.train_summary)
    rows = [_routed_row(config, run, factory, round=round, nll=nll, tokens=tokens, summary=summary)]
    rows += _baseline_rows(config, run, factory, docs=docs, scoring=scoring)
    results = {
        "round": round,
        "test_documents": len(docs),
        "scored_tokens": int(tokens.sum()),
        "prefix_tokens": prefix,
        "routing_agrees_with_shards": float(np.mean(paths == topology.representative(topology.routed_path(shard_paths))))
        if len(docs) else None,
        "models": rows,
        "per_path": per_path_table(topology, paths, nll, tokens),
        "bytes": wire_bytes(summary, n_paths=topology.n_paths),
        "traffic": read_summary(factory.store),  # the training's store traffic, measured by every process
    }
    results["paths_without_test_documents"] = _paths_without_documents(results["per_path"])
    modes = config.eval.modes if modes is None else modes
    best = config.eval.best if best is None else best
    if modes:
        results["modes"] = _evaluate_modes(config, factory, table, route=router, paths=paths, modes=modes,
                                           rounds=last, best=best)
    _refuse_non_finite(run, results, round=round)
    write_json(run.eval_results, results)
    write_json(run.root / "eval-documents.json", document_losses(table, routed=paths, rounds=last, prefix=prefix,
                                                                 features=router.features(docs),
                                                                 router=factory.router.kind))
    return results


def wire_bytes(summary: dict, *, n_paths: int) -> dict | None:
    """What the paths' pseudo-gradients cost on the wire (train.json's counts): sent in all and per path,
    the peak round (and without the paths' last tasks, which sync every module with `outer.fragments`),
    and what float32 DiLoCo and data parallel would have sent for the same training. None before training
    recorded them."""
    sent = summary.get("bytes_up")
    if not sent:
        return None
    float32, data_parallel = summary.get("bytes_float32") or 0, summary.get("bytes_data_parallel") or 0
    return {"sent": sent, "sent_per_path": sent / n_paths, "peak_round": summary.get("bytes_up_peak_round"),
            "peak_round_excluding_final": summary.get("bytes_up_peak_round_excluding_final"),
            "float32_diloco": float32, "data_parallel": data_parallel,
            "times_fewer_than_float32_diloco": float32 / sent if float32 else None,
            "times_fewer_than_data_parallel": data_parallel / sent if data_parallel else None}


def steps_per_path(store: ModuleStore, n_paths: int, *, tokens_per_step: int, fallback: int) -> int:
    """Inner steps a path trained in the applied results, on average over the paths (async runs commit more
    versions than rounds; a partial result counts its own tokens): from the round manifests, `fallback`
    for a store without them."""
    tokens = applied_tokens(store, n_paths)
    if tokens is None:
        return fallback
    return round(sum(tokens) / n_paths / tokens_per_step)


def non_finite(obj, where: str = "") -> list[str]:
    """Where a results object holds a NaN or infinite float, e.g. `models[0].perplexity`."""
    if isinstance(obj, float):
        return [] if math.isfinite(obj) else [f"{where}={obj}"]
    if isinstance(obj, dict):
        return [w for k, v in obj.items() for w in non_finite(v, f"{where}.{k}" if where else str(k))]
    if isinstance(obj, (list, tuple)):
        return [w for i, v in enumerate(obj) for w in non_finite(v, f"{where}[{i}]")]
    return []


def warm_start(config: Config, run: RunDir) -> dict:
    """Steps and tokens of the dense warm start the run's paths started from (zeros without one):
    `pretrain/summary.json` when there is a warm start and `warm_start.init_modules` is set."""
    record = run.pretrain / "summary.json"
    if not (config.pretrain_steps and config.warm_start.init_modules and record.exists()):
        return {"steps": 0, "tokens": 0}
    pretrained = json.loads(record.read_text())
    return {"steps": int(pretrained["steps"]), "tokens": int(pretrained["tokens"])}


def per_path_table(topology: Topology, paths: np.ndarray, nll: np.ndarray, tokens: np.ndarray) -> list[dict]:
    """Documents, scored tokens and perplexity of each path over the documents routed to it
    (`paths`, `nll`, `tokens`: one entry per document)."""
    table = []
    for path in range(topology.n_paths):
        index = np.flatnonzero(paths == path)
        table.append({"path": path, "label": topology.path_label(path), "documents": int(len(index)),
                      "tokens": int(tokens[index].sum()),
                      "perplexity": perplexity(nll[index].sum(), tokens[index].sum()) if len(index) else None})
    return table


def format_results(results: dict) -> str:
    """The comparison table and the per-path table, as text."""
    headers = ["model", "paths", "params/path", "params total", "warm start", "steps/path", "steps in all",
               "train tokens (all)", "train s", "tokens scored", "perplexity"]
    main = [[r["model"], r["paths"], f"{r['params_per_path']:,}", f"{r['params_total']:,}", r.get("pretrain_steps", 0),
             r["steps_per_path"], r.get("steps_total", r["steps_per_path"]), _tokens(r),
             f"{r['train_seconds']:.0f}" if r["train_seconds"] else "-",
             f"{r['scored_tokens']:,}" if "scored_tokens" in r else "-", f"{r['perplexity']:.2f}"]
            for r in results["models"]]
    paths = [[p["path"], p.get("label", ""), p["documents"], p["tokens"],
              f"{p['perplexity']:.2f}" if p["perplexity"] else "-"] for p in results["per_path"]]
    text = (
        f"Routed evaluation on {results['test_documents']} held-out documents, "
        f"{results['scored_tokens']:,} tokens scored after a {results['prefix_tokens']}-token routing prefix\n"
        + format_table(headers, main)
        + "\n\nPer path\n"
        + format_table(["path", "choice", "documents", "tokens", "perplexity"], paths)
    )
    if results.get("paths_without_test_documents"):
        text += ("\nno test document was routed to path(s) "
                 + ", ".join(map(str, results["paths_without_test_documents"])) + ": not scored")
    wire = results.get("bytes")
    if wire:
        peak = f", peak round {wire['peak_round'] / 1e6:,.2f} MB" if wire.get("peak_round") else ""  # older train.json: none
        text += (f"\n\nPseudo-gradients on the wire: {wire['sent'] / 1e6:,.2f} MB sent ({wire['sent_per_path'] / 1e6:,.2f} MB "
                 f"per path{peak}); float32 DiLoCo would send "
                 f"{_times(wire['times_fewer_than_float32_diloco'])}, data parallel {_times(wire['times_fewer_than_data_parallel'])}")
    traffic = results.get("traffic")
    if traffic and traffic.get("by_owner"):
        text += (f"\nStore traffic measured in training: {traffic['up_bytes'] / 1e6:,.2f} MB up, "
                 f"{traffic['down_bytes'] / 1e6:,.2f} MB down ({traffic['up_requests'] + traffic['down_requests']:,} requests)")
    if results.get("modes"):
        text += "\n\n" + format_modes(results["modes"])
    return text


def _times(ratio: float | None) -> str:
    return f"{ratio:,.1f}x that" if ratio else "-"


def _tokens(row: dict) -> str:
    """A row's training tokens, the warm start's included (eval.json files from before it say tokens_seen)."""
    tokens = row.get("train_tokens_total", row.get("tokens_seen"))
    return f"{tokens:,}" if tokens else "-"


def _load(path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def command(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    results = evaluate(config, run, modes=getattr(args, "mode", None), best=getattr(args, "best", None))
    print(format_results(results))
    print(f"\nresults in {run.eval_results}")
