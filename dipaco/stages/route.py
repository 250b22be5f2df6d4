"""`dipaco route`: the tokenizer, the router fitted on document prefixes, and every document's path.

    dipaco route --config configs/tiny.yaml --run runs/tiny

`route` loads the corpus (HF datasets), holds out test documents, trains the BPE tokenizer on the
training documents (or copies the configured one), cuts each document's first `prefix_tokens`
tokens, fits the router on the training prefixes and assigns every document to a path.
`dipaco shard` (`dipaco.stages.shard`) then packs each path's documents into shards.

The featurizer is fitted on the training prefixes (or a seeded sample of `routing.fit_sample` of them),
the prefix features of all documents are written in batches to `routing/features.npy` (a
memory-mapped array), the k-means is fitted on the fitting documents' rows of it and every document is
assigned in batches: each prefix is featurized once. With `routing.balance`, training documents are placed
by the exact capacity assignment; with `routing.train_top_k` > 1 each training document also goes to
its next-best paths (overlapping shards). A routing report (sizes, balance, churn, purity / NMI
against the corpus's `source`) is written to `routing/report-route.{json,md,png}`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections import Counter

import numpy as np

from dipaco.config import Config, save_config
from dipaco.model.topology import Topology
from dipaco.pipeline.context import PathFactory
from dipaco.pipeline.documents import assign_all, load_run_corpus, run_splits, run_tokenizer, stream_features
from dipaco.pipeline.fingerprints import corpus_digest, record, record_path
from dipaco.run_dir import RunDir
from dipaco.tables import format_table
from dipaco.threads import use_threads
from routing.assignments import Assignments
from routing.corpus import TRAIN
from routing.featurizers import make_featurizer
from routing.router import Router
from routing.routing_report import format_report, routing_report, write_report
from sharding.tokenizer import prefix_texts

log = logging.getLogger(__name__)


def routing_config(config: Config, run: RunDir):
    """config.routing with the base-model featurizer pointed at the run's pretrained dense model."""
    r = config.routing
    if r.featurizer == "base-model" and not r.hf_model:
        hf = run.require(run.root / "pretrain" / "hf" / "config.json", "pretrain").parent
        return dataclasses.replace(r, hf_model=str(hf))
    return r


def route(config: Config, run: RunDir) -> dict:
    """Tokenizer, router and document → path assignments; returns routing statistics."""
    use_threads(config.hardware.threads_per_island)
    record_path(run, "route").unlink(missing_ok=True)  # until this routing is complete, no record claims it
    context = PathFactory(config, run)
    dataset = load_run_corpus(config.corpus)
    split = run_splits(config.corpus, len(dataset))
    # the texts are read from the (memory-mapped) dataset a batch at a time, never held as one list
    tokenizer = run_tokenizer(config.sharding, run, _train_texts(dataset, split))
    prefixes = [prefix for batch in _text_batches(dataset)
                for prefix in prefix_texts(tokenizer, batch, n_tokens=context.prefix_tokens)]
    topology = context.topology
    fit_docs = np.flatnonzero(split == TRAIN)
    if 0 < config.routing.fit_sample < len(fit_docs):  # a seeded sample; all documents are assigned below
        fit_docs = np.sort(np.random.default_rng(config.routing.seed).choice(fit_docs, config.routing.fit_sample,
                                                                              replace=False))
    routing = routing_config(config, run)
    featurizer, featurizer_stats = make_featurizer([prefixes[i] for i in fit_docs], routing)
    features = stream_features(featurizer, prefixes, run.routing / "features.npy")  # every document's, once
    router, fit_stats = Router.fit_on_features(featurizer, np.asarray(features[fit_docs]), levels=list(topology.levels),
                                               config=routing, featurizer_stats=featurizer_stats)
    paths, topk = assign_all(router, features, split, top_k=config.routing.train_top_k)
    if topology.replicas > 1:  # DiLoCo replicas: each document to a random replica of its path
        if topk is not None and topk.shape[1] > 1:
            raise ValueError(f"topology.replicas {topology.replicas} cannot be combined with "
                             f"routing.train_top_k {config.routing.train_top_k}")
        paths, topk = assign_replicas(paths, replicas=topology.replicas, seed=config.corpus.seed), None
    previous = _previous_paths(run, len(paths))
    router.save(run.routing)
    assignments = Assignments(path=paths, split=split, levels=topology.data_levels,
                              router_fingerprint=router.fingerprint(), topk=topk)
    assignments.save(run.routing)
    sources = dataset["source"] if "source" in dataset.column_names else None
    stats = routing_summary(paths, split, topology, sources)
    stats["fit"] = fit_stats
    stats["report"] = routing_report(paths=paths, split=split, n_paths=topology.n_paths, previous=previous,
                                     labels=sources, train_paths=assignments.train_paths(), name="route")
    write_report(stats["report"], run.routing, name="report-route")
    record(run, "route", config, corpus=corpus_digest(config.corpus))
    save_config(config, run.config)  # only now: config.yaml claims what was run
    return stats


def _text_batches(dataset, *, batch_size: int = 8192):
    """The dataset's texts, a list of at most `batch_size` at a time, in order."""
    for start in range(0, len(dataset), batch_size):
        yield dataset[start : start + batch_size]["text"]


def _train_texts(dataset, split: np.ndarray, *, batch_size: int = 8192):
    """The training documents' texts, in order, read a batch at a time."""
    for start, batch in zip(range(0, len(dataset), batch_size), _text_batches(dataset, batch_size=batch_size)):
        yield from (text for text, s in zip(batch, split[start : start + batch_size]) if s == TRAIN)


def assign_replicas(routed: np.ndarray, *, replicas: int, seed: int) -> np.ndarray:
    """Routed path ids (N,) → data path ids: each document goes to a uniformly random replica of its
    path (`routed * replicas + r`), so DiLoCo replicas train on random shards of the data."""
    if replicas == 1:
        return routed
    return routed * replicas + np.random.default_rng([seed, 0xD1]).integers(0, replicas, size=len(routed))


def _previous_paths(run: RunDir, n: int) -> np.ndarray | None:
    """The paths of the assignments this routing replaces (for the churn in the report), if any."""
    try:
        old = Assignments.load(run.routing)
    except (FileNotFoundError, ValueError):
        return None
    return old.path if len(old.path) == n else None


def routing_summary(paths: np.ndarray, split: np.ndarray, topology: Topology, sources: list[str] | None) -> dict:
    """Documents per path (train split), and the most common source in each path when known."""
    rows = []
    for path in range(topology.n_paths):
        members = np.flatnonzero((paths == path) & (split == TRAIN))
        row = {"path": path, "choice": topology.path_label(path), "documents": int(len(members))}
        if sources is not None and len(members):
            source, count = Counter(sources[i] for i in members).most_common(1)[0]
            row.update(top_source=source, top_source_share=count / len(members))
        rows.append(row)
    sizes = [r["documents"] for r in rows]
    return {"paths": rows, "min": min(sizes), "max": max(sizes),
            "balance": (max(sizes) / min(sizes)) if min(sizes) else float("inf")}


def format_routing(stats: dict) -> str:
    headers = ["path", "choice", "train docs"] + (["top source", "share"] if "top_source" in stats["paths"][0] else [])
    rows = [[r["path"], r["choice"], r["documents"]]
            + ([r.get("top_source", "-"), f"{r.get('top_source_share', 0):.0%}"] if len(headers) > 3 else [])
            for r in stats["paths"]]
    text = format_table(headers, rows) + f"\nlargest / smallest path: {stats['balance']:.2f}"
    if "report" in stats:
        text += "\n\n" + format_report(stats["report"])
    return text


def command(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    print(format_routing(route(config, run)))
