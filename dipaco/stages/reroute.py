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
each phase appended to `routing/phases.json` with its report (docs/routing.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from functools import partial

import numpy as np

from dipaco.atomic import write_json
from dipaco.config import Config, save_config
from dipaco.device import resolve_device
from dipaco.eval.modes import LossTable
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
from routing.router import ROUTER_JSON, ROUTER_TENSORS, Router
from routing.routing_report import routing_report, write_report
from sharding.tokenizer import encode_batch, prefix_texts

log = logging.getLogger(__name__)


def candidate_losses(table: LossTable, candidates: np.ndarray, *, round: int, n_paths: int, skip: int) -> np.ndarray:
    """Mean token NLL (D, paths) of each document of `table` under each of its `candidates` (D, c)
    paths at module version `round`, on its tokens after the first `skip` (inf where not a candidate)."""
    nll = np.full((len(table.docs), n_paths), np.inf)
    table.ensure({(p, round): set(np.flatnonzero((candidates == p).any(axis=1)).tolist()) for p in range(n_paths)})
    for path in range(n_paths):
        for d in np.flatnonzero((candidates == path).any(axis=1)):
            nll[d, path] = table.get(path, round, d)[skip:].sum() / max(len(table.docs[d]) - skip, 1)
    return nll


def reroute(config: Config, run: RunDir) -> dict:
    """One discriminative phase; returns its record (also appended to routing/phases.json)."""
    started = time.perf_counter()
    use_threads(config.hardware.threads_per_island)
    check(run, config, ("route", "shard", "train"))
    save_config(config, run.config)
    factory = PathFactory(config, run)
    round = factory.store.current_round()
    if round == 0:
        raise ValueError(f"store {factory.store.url} has no trained round: run `dipaco train --run {run.root}` first")
    if round >= config.run.rounds and config.reroute.target == "current":
        log.info("training has finished (version %d): this phase only re-fits the router evaluation uses, and "
                 "reroute.target=labels fits it better than matching the training path sizes "
                 "(docs/routing.md)", round)
    router = Router.load(run.require(run.routing / ROUTER_JSON, "route").parent)
    old = Assignments.load(run.routing)
    dataset = load_run_corpus(config.corpus)
    split = run_splits(config.corpus, len(dataset))
    if len(split) != len(old.split) or (split != old.split).any():
        raise ValueError(f"{run.routing / ASSIGN_JSON} was made with other corpus / split settings: route again")
    router_docs = np.flatnonzero(split == ROUTER)
    if factory.topology.replicas > 1:
        raise ValueError(f"discriminative re-routing picks among the routed paths; it does not support "
                         f"topology.replicas {factory.topology.replicas} (DiLoCo replicas): set it to 1")
    if len(router_docs) < factory.topology.n_paths:
        raise ValueError(f"the router split has {len(router_docs)} documents; set corpus.router_fraction > 0 "
                         f"(e.g. 0.05) and run `dipaco route` and `dipaco shard` again")
    texts = dataset["text"]
    tokenizer = factory.tokenizer
    skip, seq_len = factory.prefix_tokens, config.sharding.seq_len
    features_file = run.routing / "features.npy"
    features = np.load(features_file, mmap_mode="r") if features_file.exists() else None
    if features is None or features.shape != (len(texts), router.featurizer.dim):
        prefixes = prefix_texts(tokenizer, texts, n_tokens=skip)
        features = stream_features(router.featurizer, prefixes, features_file)
    docs = [t[:seq_len] for t in encode_batch(tokenizer, [texts[int(i)] for i in router_docs])]
    keep = np.array([len(d) > skip for d in docs], dtype=bool)
    router_docs, docs = router_docs[keep], [d for d, k in zip(docs, keep) if k]
    x = np.asarray(features[router_docs])
    n_paths = factory.topology.n_paths
    c = config.reroute.candidates or n_paths
    candidates = router.assign_topk(x, min(c, n_paths))
    device = resolve_device(config.hardware.device)
    table = LossTable(docs=docs, load=lambda path, version: factory.load_path(path=path, round=version, device=device),
                      score=partial(token_losses, batch_size=config.eval.batch_size, device=device,
                                    precision=config.hardware.precision, pad_id=tokenizer.pad_token_id or 0))
    nll = candidate_losses(table, candidates, round=round, n_paths=n_paths, skip=skip)
    labels = np.argmin(nll, axis=1)
    sizes = np.bincount(old.path[old.split == TRAIN], minlength=n_paths).astype(np.float64)
    target = {"uniform": np.full(n_paths, 1.0 / n_paths), "current": np.maximum(sizes, 1),
              "labels": None}[config.reroute.target]
    (w, b), fit_stats = fit_discriminative(x, labels, n_paths=n_paths, target=target, c=config.reroute.c,
                                           seed=config.routing.seed)
    new_router = Router(levels=router.levels, method=router.method, featurizer=router.featurizer,
                        centroids=router.centroids, config=router.config, penalties=router.penalties, linear=(w, b))
    phases_file = run.routing / "phases.json"
    phases = json.loads(phases_file.read_text()) if phases_file.exists() else []
    phase = len(phases) + 1
    archive = run.routing / f"phase-{phase - 1}"
    archive.mkdir(parents=True, exist_ok=True)
    for name in (ROUTER_JSON, ROUTER_TENSORS, ASSIGN_JSON, ASSIGN_TENSORS):
        shutil.copy2(run.routing / name, archive / name)
    paths, topk = assign_all(new_router, features, split, top_k=config.routing.train_top_k)
    new_router.save(run.routing)
    assignments = Assignments(path=paths, split=split, levels=list(router.levels),
                              router_fingerprint=new_router.fingerprint(), topk=topk)
    assignments.save(run.routing)
    sources = dataset["source"] if "source" in dataset.column_names else None
    report = routing_report(paths=paths, split=split, n_paths=n_paths, previous=old.path, labels=sources,
                            train_paths=assignments.train_paths(), name=f"reroute-{phase}")
    write_report(report, run.routing, name=f"report-reroute-{phase}")
    record = {
        "phase": phase,
        "after_round": round,
        "router_documents": int(len(router_docs)),
        "candidates_per_document": int(candidates.shape[1]),
        "label_sizes": np.bincount(labels, minlength=n_paths).tolist(),
        "label_agrees_with_previous_router": float(np.mean(labels == old.path[router_docs])),
        "mean_nll_best": float(nll[np.arange(len(labels)), labels].mean()),
        "mean_nll_previous_route": float(np.nanmean(np.where(np.isfinite(nll[np.arange(len(labels)), old.path[router_docs]]),
                                                          nll[np.arange(len(labels)), old.path[router_docs]], np.nan))),
        "fit": fit_stats,
        "report": report,
        "previous_router": str(archive.relative_to(run.root)),
        "seconds": time.perf_counter() - started,
    }
    phases.append(record)
    write_json(phases_file, phases)
    log.info("reroute phase %d: %.1f%% of documents changed path", phase, 100 * report["changed"])
    return record


def format_phase(record: dict) -> str:
    from routing.routing_report import format_report

    return (f"reroute phase {record['phase']} after round {record['after_round']}: "
            f"{record['router_documents']} router documents x {record['candidates_per_document']} candidate paths; "
            f"labels agree with the previous router on {record['label_agrees_with_previous_router']:.1%}; "
            f"logistic regression accuracy {record['fit']['accuracy']:.1%}\n" + format_report(record["report"]))


def command(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    """One re-routing phase, then the shards rewritten for the new assignments (`dipaco shard`)."""
    record = reroute(config, run)
    try:
        shard(config, run)
    except ValueError as err:
        raise ValueError(f"{err}\n(re-routing phase {record['phase']} is recorded in {run.routing / 'phases.json'}; "
                         f"`dipaco shard --run {run.root}` writes the shards of its routing)") from err
    accept_new_shards(run)  # training goes on from the current modules on the new shards, on purpose
    print(format_phase(record))
