"""`dipaco reroute`: one discriminative re-routing phase (DiPaCo §2.4.2, approximate hard EM), then the
shards rewritten for the new routing.

    dipaco route --config configs/demo.yaml --run runs/d corpus.router_fraction=0.05
    dipaco shard ... ; dipaco train ... run.rounds=8 run.stop_after_round=4
    dipaco reroute --config configs/demo.yaml --run runs/d corpus.router_fraction=0.05
    dipaco train --config configs/demo.yaml --run runs/d corpus.router_fraction=0.05 run.rounds=8

Every document of the router split is scored by the current modules under each candidate path
(`reroute.candidates`), labelled with its lowest-loss path; a logistic regression on the prefix
features (`routing.discriminative`, bias per `reroute.target`) routes every document again, and
training continues from the current modules. The replaced router is kept in `routing/phase-<n>/`,
each phase appended to `routing/phases.json` with its report (docs/routing.md), and the router split's
losses under each candidate path in `routing/phase-<n>-losses.json` (a head fitted again without scoring).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from functools import partial
from pathlib import Path

import numpy as np

from dipaco.atomic import write_json
from dipaco.config import Config, save_config
from dipaco.device import resolve_device
from dipaco.eval.modes import LossTable
from dipaco.eval.path_labels import best_paths, candidate_losses, candidate_prefix_losses, losses_record
from dipaco.eval.scoring import token_losses
from dipaco.pipeline.context import PathFactory
from dipaco.pipeline.documents import assign_all, load_run_corpus, run_splits, stream_features
from dipaco.pipeline.fingerprints import accept_new_shards, check
from dipaco.run_dir import RunDir
from dipaco.stages.shard import shard
from dipaco.threads import use_threads
from routing.assignments import ASSIGN_JSON, ASSIGN_TENSORS, Assignments
from routing.corpus import ROUTER, TRAIN
from routing.discriminative import fit_discriminative
from routing.loss_regression import fit_loss_regression
from routing.router import ROUTER_JSON, ROUTER_TENSORS, Router
from routing.router_cost import load_balance, routing_cost
from routing.routing_report import routing_report, write_report
from sharding.tokenizer import encode_batch, prefix_texts

log = logging.getLogger(__name__)


def reroute(config: Config, run: RunDir) -> dict:
    """One discriminative phase; returns its record (also appended to routing/phases.json)."""
    started = time.perf_counter()
    use_threads(config.hardware.threads_per_island)
    check(run, config, ("route", "shard", "train"))
    save_config(config, run.config)
    factory = PathFactory(config, run)
    round = _trained_round(factory, config, run)
    router = Router.load(run.require(run.routing / ROUTER_JSON, "route").parent)
    old = Assignments.load(run.routing)
    dataset = load_run_corpus(config.corpus)
    texts = dataset["text"]
    split = _checked_split(config, run, old, factory, n_documents=len(texts))
    features = _prefix_features(run, router, texts, factory)
    router_docs, docs = _router_documents(texts, split, factory, seq_len=config.sharding.seq_len)
    x = np.asarray(features[router_docs])
    n_paths = factory.topology.n_paths
    candidates = router.assign_topk(x, min(config.reroute.candidates or n_paths, n_paths))
    table = _loss_table(docs, factory, config)
    nll = candidate_losses(table, candidates, round=round, n_paths=n_paths, skip=factory.prefix_tokens)
    labels = best_paths(nll)
    new_router, fit_stats = _fit_learned(router, x, labels, old, config, nll=nll)
    phase, archive = _archive_previous(run)
    prefix_nll = candidate_prefix_losses(table, candidates, round=round, n_paths=n_paths, prefix=factory.prefix_tokens)
    write_json(run.routing / f"phase-{phase}-losses.json",
               losses_record(nll, prefix_nll, documents=router_docs, round=round, prefix=factory.prefix_tokens))
    paths, topk = assign_all(new_router, features, split, top_k=config.routing.train_top_k)
    new_router.save(run.routing)
    assignments = Assignments(path=paths, split=split, levels=list(router.levels),
                              router_fingerprint=new_router.fingerprint(), topk=topk)
    assignments.save(run.routing)
    sources = dataset["source"] if "source" in dataset.column_names else None
    report = routing_report(paths=paths, split=split, n_paths=n_paths, previous=old.path, labels=sources,
                            train_paths=assignments.train_paths(), name=f"reroute-{phase}")
    write_report(report, run.routing, name=f"report-reroute-{phase}")
    previous = old.path[router_docs]
    chosen = nll[np.arange(len(labels)), previous]
    record = {
        "phase": phase,
        "after_round": round,
        "router_documents": int(len(router_docs)),
        "candidates_per_document": int(candidates.shape[1]),
        "label_sizes": np.bincount(labels, minlength=n_paths).tolist(),
        "label_agrees_with_previous_router": float(np.mean(labels == previous)),
        "mean_nll_best": float(nll[np.arange(len(labels)), labels].mean()),
        "mean_nll_previous_route": float(np.nanmean(np.where(np.isfinite(chosen), chosen, np.nan))),
        "fit": fit_stats,
        **_cost_and_balance({"previous": router, "new": new_router}, {"previous": old.path, "new": paths},
                            split=split, prefixes=_cost_prefixes(texts, router_docs, factory), n_paths=n_paths),
        "report": report,
        "previous_router": str(archive.relative_to(run.root)),
        "seconds": time.perf_counter() - started,
    }
    _append_phase(run, record)
    log.info("reroute phase %d: %.1f%% of documents changed path", phase, 100 * report["changed"])
    return record


def _trained_round(factory: PathFactory, config: Config, run: RunDir) -> int:
    """The store's current module version, the one whose paths label the router split (refused before training)."""
    round = factory.store.current_round()
    if round == 0:
        raise ValueError(f"store {factory.store.url} has no trained round: run `dipaco train --run {run.root}` first")
    if round >= config.run.rounds and config.reroute.target == "current":
        log.info("training has finished (version %d): this phase only re-fits the router evaluation uses, and "
                 "reroute.target=labels fits it better than matching the training path sizes "
                 "(docs/routing.md)", round)
    return round


def _checked_split(config: Config, run: RunDir, old: Assignments, factory: PathFactory, *,
                   n_documents: int) -> np.ndarray:
    """The run's document splits, refused when the assignments were made with others, with DiLoCo replicas,
    or with too small a router split."""
    split = run_splits(config.corpus, n_documents)
    if len(split) != len(old.split) or (split != old.split).any():
        raise ValueError(f"{run.routing / ASSIGN_JSON} was made with other corpus / split settings: route again")
    if factory.topology.replicas > 1:
        raise ValueError(f"discriminative re-routing picks among the routed paths; it does not support "
                         f"topology.replicas {factory.topology.replicas} (DiLoCo replicas): set it to 1")
    n_router = int((split == ROUTER).sum())
    if n_router < factory.topology.n_paths:
        raise ValueError(f"the router split has {n_router} documents; set corpus.router_fraction > 0 "
                         f"(e.g. 0.05) and run `dipaco route` and `dipaco shard` again")
    return split


def _prefix_features(run: RunDir, router: Router, texts, factory: PathFactory) -> np.ndarray:
    """Every document's prefix features under `router`'s featurizer: routing/features.npy (`dipaco route`'s,
    memory-mapped), or computed again when it is missing or of another shape."""
    features_file = run.routing / "features.npy"
    features = np.load(features_file, mmap_mode="r") if features_file.exists() else None
    if features is None or features.shape != (len(texts), router.featurizer.dim):
        prefixes = prefix_texts(factory.tokenizer, texts, n_tokens=factory.prefix_tokens)
        features = stream_features(router.featurizer, prefixes, features_file)
    return features


def _router_documents(texts, split: np.ndarray, factory: PathFactory, *,
                      seq_len: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """The router split's document ids and token ids (cut to `seq_len`), those with a token after the prefix."""
    router_docs = np.flatnonzero(split == ROUTER)
    docs = [t[:seq_len] for t in encode_batch(factory.tokenizer, [texts[int(i)] for i in router_docs])]
    keep = np.array([len(d) > factory.prefix_tokens for d in docs], dtype=bool)
    return router_docs[keep], [d for d, k in zip(docs, keep) if k]


def _loss_table(docs: list[np.ndarray], factory: PathFactory, config: Config) -> LossTable:
    device = resolve_device(config.hardware.device)
    return LossTable(docs=docs, load=lambda path, version: factory.load_path(path=path, round=version, device=device),
                     score=partial(token_losses, batch_size=config.eval.batch_size, device=device,
                                   precision=config.hardware.precision, pad_id=factory.tokenizer.pad_token_id or 0))


def _fit_learned(router: Router, x: np.ndarray, labels: np.ndarray, old: Assignments, config: Config, *,
                 nll: np.ndarray) -> tuple[Router, dict]:
    """The learned router: `router`'s featurizer with a linear head on the features `x`: a logistic
    regression to the `labels`, its bias matched to `reroute.target`, or (`reroute.head` regression) a ridge
    regression to every path's loss `nll` (D, paths)."""
    n_paths = router.n_paths
    if config.reroute.head == "regression":
        if not np.isfinite(nll).all():
            raise ValueError(f"reroute.head regression needs every path's loss on every router document: set "
                             f"reroute.candidates 0 (got {config.reroute.candidates})")
        (w, b), fit_stats = fit_loss_regression(x, nll)
    else:
        sizes = np.bincount(old.path[old.split == TRAIN], minlength=n_paths).astype(np.float64)
        target = {"uniform": np.full(n_paths, 1.0 / n_paths), "current": np.maximum(sizes, 1),
                  "labels": None}[config.reroute.target]
        (w, b), fit_stats = fit_discriminative(x, labels, n_paths=n_paths, target=target, c=config.reroute.c,
                                               seed=config.routing.seed)
    return Router(levels=router.levels, method=router.method, featurizer=router.featurizer,
                  centroids=router.centroids, config=router.config, penalties=router.penalties,
                  linear=(w, b)), fit_stats


def _archive_previous(run: RunDir) -> tuple[int, Path]:
    """This phase's number, and the copy of the router and assignments it replaces (routing/phase-<n - 1>/)."""
    phases_file = run.routing / "phases.json"
    phase = len(json.loads(phases_file.read_text())) + 1 if phases_file.exists() else 1
    archive = run.routing / f"phase-{phase - 1}"
    archive.mkdir(parents=True, exist_ok=True)
    for name in (ROUTER_JSON, ROUTER_TENSORS, ASSIGN_JSON, ASSIGN_TENSORS):
        shutil.copy2(run.routing / name, archive / name)
    return phase, archive


def _append_phase(run: RunDir, record: dict) -> None:
    phases_file = run.routing / "phases.json"
    phases = json.loads(phases_file.read_text()) if phases_file.exists() else []
    write_json(phases_file, [*phases, record])


COST_DOCUMENTS = 512  # router documents whose prefixes time the routers (a prefix's cost does not depend on N)


def _cost_prefixes(texts, router_docs: np.ndarray, factory: PathFactory) -> list[str]:
    """The decoded prefix texts of the first `COST_DOCUMENTS` router documents: what a router reads."""
    sample = [texts[int(i)] for i in router_docs[:COST_DOCUMENTS]]
    return prefix_texts(factory.tokenizer, sample, n_tokens=factory.prefix_tokens)


def _cost_and_balance(routers: dict[str, Router], paths: dict[str, np.ndarray], *, split: np.ndarray,
                      prefixes: list[str], n_paths: int) -> dict:
    """"routing_cost": ms per routed prefix of each router ("previous", "new") and the new one's over the
    previous one's; "balance": the training documents per path under each router (`routing.router_cost`)."""
    cost = routing_cost(routers, prefixes)
    for name, router in routers.items():
        cost[name]["router"] = router.kind
    cost["new_over_previous"] = cost["new"]["ms_per_document"] / max(cost["previous"]["ms_per_document"], 1e-12)
    balance = {name: {"router": routers[name].kind, **load_balance(p[split == TRAIN], n_paths=n_paths)}
               for name, p in paths.items()}
    return {"routing_cost": cost, "balance": balance}


def format_phase(record: dict) -> str:
    from routing.routing_report import format_report

    return (f"reroute phase {record['phase']} after round {record['after_round']}: "
            f"{record['router_documents']} router documents x {record['candidates_per_document']} candidate paths; "
            f"labels agree with the previous router on {record['label_agrees_with_previous_router']:.1%}; "
            f"{record['fit'].get('head', 'logistic')} head: best path predicted for {record['fit']['accuracy']:.1%}\n"
            + "".join(f"{name} router ({cost['router']}): {cost['ms_per_document']:.3f} ms per prefix "
                      f"({cost['assign_ms_per_document']:.4f} ms to pick the path); training documents per path "
                      f"min {balance['min']} / median {balance['median']:g} / max {balance['max']}, entropy "
                      f"{balance['entropy_bits']:.2f} of {balance['max_entropy_bits']:.2f} bits\n"
                      for name, cost, balance in ((n, record["routing_cost"][n], record["balance"][n])
                                                  for n in ("previous", "new")))
            + format_report(record["report"]))


def command(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    """One re-routing phase, then the shards rewritten for the new assignments (`dipaco shard`)."""
    record = reroute(config, run)
    try:
        shard(config, run)
    except ValueError as err:
        raise ValueError(f"{err}\n(re-routing phase {record['phase']} is recorded in {run.routing / 'phases.json'}; "
                         f"the previous routing's shards are kept as they were, and its router and assignments in "
                         f"{record['previous_router']}; `dipaco shard --run {run.root}` writes the shards of the new "
                         "routing once it fits)") from err
    accept_new_shards(run)  # training goes on from the current modules on the new shards, on purpose
    print(format_phase(record))
