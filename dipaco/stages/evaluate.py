"""Routed evaluation (the paper's protocol) against the dense baselines.

    dipaco eval --config configs/tiny.yaml --run runs/tiny

Each held-out test document is routed by the text of its first `routing.prefix_tokens` tokens to one
path, and that path scores the tokens after the prefix. Only one path is in memory at a time. The
baselines score the very same tokens, so the perplexities are comparable. Results go to `eval.json`
and are printed as a table.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
from tqdm import tqdm

from dipaco.config import Config
from dipaco.device import resolve_device
from dipaco.eval.modes import evaluate_modes, format_modes
from dipaco.eval.scoring import perplexity, score_documents
from dipaco.model.path_model import count_parameters
from dipaco.run_dir import RunDir
from dipaco.stages.baselines import baseline_steps, load_baseline
from dipaco.stages.context import PathFactory
from dipaco.tables import format_table
from routing.router import Router
from sharding.tokenizer import decode_prefix

log = logging.getLogger(__name__)


def route_test_documents(router: Router, tokenizer, docs: list[np.ndarray], *, prefix_tokens: int) -> np.ndarray:
    """The path of each document, chosen from the text of its first `prefix_tokens` tokens."""
    prefixes = [decode_prefix(tokenizer, doc, prefix_tokens) for doc in docs]
    return router.route(prefixes)


def evaluate(config: Config, run: RunDir, *, modes: list[str] | None = None, best: bool | None = None) -> dict:
    """The routed model (prefix routing, last round) against the baselines, then every eval mode
    (`modes`, default `eval.modes`; each path at its best round too when `best`, default `eval.best`)."""
    factory = PathFactory(config, run)
    device = resolve_device(config.eval.device)
    topology, store = factory.topology, factory.store
    round = store.current_round()
    if round == 0:
        raise ValueError(f"store {store.url} has no trained round: run `dipaco train --run {run.root}` first")
    router = Router.load(run.require(run.routing / "router.json", "route").parent)
    docs, doc_ids, shard_paths = factory.reader.test_documents()
    skip = config.routing.prefix_tokens
    paths = topology.representative(route_test_documents(router, factory.tokenizer, docs, prefix_tokens=skip))
    score = dict(skip=skip, batch_size=config.eval.batch_size, device=device, precision=config.eval.precision,
                 pad_id=factory.tokenizer.pad_token_id or 0)

    nll = np.zeros(len(docs))
    counts = np.zeros(len(docs), dtype=np.int64)
    per_path = []
    for path in tqdm(range(topology.n_paths), desc="routed eval", unit="path", leave=False, disable=None):
        index = np.flatnonzero(paths == path)
        if len(index) == 0:
            per_path.append({"path": path, "documents": 0, "tokens": 0, "perplexity": None})
            continue
        model = factory.load_path(path=path, round=round, device=device)
        nll[index], counts[index] = score_documents(model, [docs[i] for i in index], **score)
        per_path.append({"path": path, "label": topology.path_label(path), "documents": int(len(index)),
                         "tokens": int(counts[index].sum()),
                         "perplexity": perplexity(nll[index].sum(), counts[index].sum())})
        del model
    params_per_path = count_parameters(factory.new_model())
    total_params = sum(t.numel() for name in topology.modules for t in store.read_module(round, name).values())
    summary = _load(run.train_summary)
    rows = [{
        "model": f"DiPaCo {'x'.join(map(str, topology.levels))} routed",
        "paths": topology.n_paths,
        "params_per_path": params_per_path,
        "params_total": total_params,
        "steps_per_path": round * config.inner.steps,
        "tokens_seen": summary.get("tokens"),
        "train_seconds": summary.get("seconds"),
        "perplexity": perplexity(nll.sum(), counts.sum()),
    }]
    for name in baseline_steps(config, topology.n_paths):
        if not (run.baselines / name / "summary.json").exists():
            log.info("baseline %s not trained; run `dipaco baselines` to compare with it", name)
            continue
        model, info = load_baseline(factory, name)
        b_nll, b_counts = score_documents(model.to(device), docs, **score)
        rows.append({"model": name, "paths": 1, "params_per_path": info["parameters"],
                     "params_total": info["parameters"], "steps_per_path": info["steps"],
                     "tokens_seen": info["tokens"], "train_seconds": info["seconds"],
                     "perplexity": perplexity(b_nll.sum(), b_counts.sum())})
    results = {
        "round": round,
        "test_documents": len(docs),
        "scored_tokens": int(counts.sum()),
        "prefix_tokens": skip,
        "routing_agrees_with_shards": float(np.mean(paths == topology.representative(topology.routed_path(shard_paths)))) if len(docs) else None,
        "models": rows,
        "per_path": per_path,
    }
    modes = config.eval.modes if modes is None else modes
    best = config.eval.best if best is None else best
    if modes:
        from dipaco.eval.early_stopping import best_of_run

        best_rounds = best_of_run(factory.store, topology, factory.spec, factory.validation,
                                  device=resolve_device(config.train.device))[0] if best else None
        results["modes"] = evaluate_modes(factory, router=router, docs=docs, modes=modes, best=best_rounds,
                                          device=device)
    tmp = run.eval_results.with_name("eval.json.tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, run.eval_results)
    return results


def format_results(results: dict) -> str:
    """The comparison table and the per-path table, as text."""
    headers = ["model", "paths", "params/path", "params total", "steps/path", "tokens seen", "train s", "perplexity"]
    main = [[r["model"], r["paths"], f"{r['params_per_path']:,}", f"{r['params_total']:,}", r["steps_per_path"],
             f"{r['tokens_seen']:,}" if r["tokens_seen"] else "-",
             f"{r['train_seconds']:.0f}" if r["train_seconds"] else "-", f"{r['perplexity']:.2f}"]
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
    if results.get("modes"):

        text += "\n\n" + format_modes(results["modes"])
    return text


def _load(path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}
