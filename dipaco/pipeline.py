"""The offline stages before training: route the corpus, then write path-specific shards.

    dipaco route --config configs/tiny.yaml --run runs/tiny
    dipaco shard --config configs/tiny.yaml --run runs/tiny

`route` loads the corpus (HF datasets), holds out test documents, trains the BPE tokenizer on the
training documents (or copies the configured one), cuts each document's first `prefix_tokens`
tokens, fits the router on the training prefixes and assigns every document to a path.
`shard` tokenizes and packs each path's documents into zstd shards with a checked index.

The router is fitted on the training prefixes (or a seeded sample of `routing.fit_sample` of them);
the prefix features of all documents are written in batches to `routing/features.npy` (a
memory-mapped array) and assigned in batches. With `routing.balance`, training documents are placed
by the exact capacity assignment; with `routing.train_top_k` > 1 each training document also goes to
its next-best paths (overlapping shards). A routing report (sizes, balance, churn, purity / NMI
against the corpus's `source`) is written to `routing/report-route.{json,md,png}`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter

import numpy as np

from dipaco.config import Config, save_config
from dipaco.report import format_table
from dipaco.run import RunDir
from dipaco.topology import Topology
from routing.corpus import TRAIN, assign_splits, load_corpus
from routing.report import format_report, routing_report, write_report
from routing.router import Assignments, Router
from sharding.build import build_shards
from sharding.tokenizer import load_tokenizer, prefix_texts, tokenizer_fingerprint, train_tokenizer

log = logging.getLogger(__name__)


def corpus_location(config: Config) -> str:
    """The corpus path, with `demo` meaning the corpus bundled with dipaco."""
    if config.corpus.path == "demo":
        from dipaco.data import demo_corpus_path

        return str(demo_corpus_path())
    return config.corpus.path


def load_run_corpus(config: Config):
    c = config.corpus
    return load_corpus(path=corpus_location(config), text_field=c.text_field, split=c.split,
                       max_documents=c.max_documents)


def run_splits(config: Config, n: int) -> np.ndarray:
    c = config.corpus
    return assign_splits(n, test_fraction=c.test_fraction, seed=c.seed, router_fraction=c.router_fraction)


def routing_config(config: Config, run: RunDir):
    """config.routing with the base-model featurizer pointed at the run's pretrained dense model."""
    r = config.routing
    if r.featurizer == "base-model" and not r.hf_model:
        hf = run.require(run.root / "pretrain" / "hf" / "config.json", "pretrain").parent
        return dataclasses.replace(r, hf_model=str(hf))
    return r


def stream_features(router: Router, prefixes: list[str], out, *, batch_size: int = 8192) -> np.ndarray:
    """Featurize in batches into a memory-mapped float32 .npy at `out`; returns the (read-only) map."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.npy")
    features = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(len(prefixes), router.featurizer.dim))
    from tqdm.auto import tqdm

    for start in tqdm(range(0, len(prefixes), batch_size), desc=f"featurize ({router.featurizer.name})",
                      unit="batch", disable=None):
        features[start : start + batch_size] = router.features(prefixes[start : start + batch_size])
    features.flush()
    del features
    os.replace(tmp, out)
    return np.load(out, mmap_mode="r")


def assign_all(router: Router, features: np.ndarray, split: np.ndarray, *, top_k: int,
               batch_size: int = 65536) -> tuple[np.ndarray, np.ndarray | None]:
    """Every document's path (batched), and the (N, k) training paths when k > 1 or balance is on."""
    paths = np.concatenate([router.assign(np.asarray(features[s : s + batch_size]))
                            for s in range(0, len(features), batch_size)]) if len(features) else np.zeros(0, np.int64)
    if top_k == 1 and not (router.config.balance and router.linear is None):
        return paths, None
    train = np.flatnonzero(split == TRAIN)
    topk = np.full((len(paths), top_k), -1, dtype=np.int64)
    topk[train] = router.assign_train(np.asarray(features[train]), k=top_k)
    paths[train] = topk[train, 0]
    return paths, (topk if top_k > 1 else None)


def route(config: Config, run: RunDir) -> dict:
    """Tokenizer, router and document → path assignments; returns routing statistics."""
    save_config(config, run.config)
    dataset = load_run_corpus(config)
    split = run_splits(config, len(dataset))
    texts = dataset["text"]
    train_texts = [t for t, s in zip(texts, split) if s == TRAIN]
    tokenizer = _tokenizer(config, run, train_texts)
    prefixes = prefix_texts(tokenizer, texts, n_tokens=config.routing.prefix_tokens)
    topology = Topology.from_config(config.topology, n_layers=config.model.n_layers)
    fit_docs = np.flatnonzero(split == TRAIN)
    if 0 < config.routing.fit_sample < len(fit_docs):  # a seeded sample; all documents are assigned below
        fit_docs = np.sort(np.random.default_rng(config.routing.seed).choice(fit_docs, config.routing.fit_sample,
                                                                              replace=False))
    router, fit_stats = Router.fit([prefixes[i] for i in fit_docs], levels=list(topology.levels),
                                   config=routing_config(config, run))
    features = stream_features(router, prefixes, run.routing / "features.npy")
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
    return stats


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


def _tokenizer(config: Config, run: RunDir, train_texts: list[str]):
    if config.sharding.tokenizer:
        tokenizer = load_tokenizer(config.sharding.tokenizer)
        tokenizer.save_pretrained(run.tokenizer)  # the run keeps its own copy
        return tokenizer
    if (run.tokenizer / "tokenizer.json").exists():
        log.info("reusing the tokenizer in %s", run.tokenizer)
        return load_tokenizer(run.tokenizer)
    log.info("training a %d-token byte-level BPE on %d documents", config.sharding.vocab_size, len(train_texts))
    return train_tokenizer(train_texts, vocab_size=config.sharding.vocab_size, out_dir=run.tokenizer)


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


def shard(config: Config, run: RunDir) -> dict:
    """Write every path's train / val shards and the test documents; returns the shard index."""
    save_config(config, run.config)
    dataset = load_run_corpus(config)
    assignments = Assignments.load(run.require(run.routing / "assignments.json", "route").parent)
    if len(assignments.path) != len(dataset):
        raise ValueError(
            f"{run.routing / 'assignments.json'} routes {len(assignments.path)} documents, but the corpus "
            f"{corpus_location(config)} now has {len(dataset)}: run `dipaco route` again"
        )
    tokenizer = load_tokenizer(run.require(run.tokenizer, "route"))
    topology = Topology.from_config(config.topology, n_layers=config.model.n_layers)
    if list(assignments.levels) != topology.data_levels:
        raise ValueError(f"{run.routing / 'assignments.json'} was routed for levels {assignments.levels}, "
                         f"the config asks for {topology.data_levels}: run `dipaco route` again")
    index = build_shards(
        texts=dataset["text"], doc_ids=np.asarray(dataset["doc_id"], dtype=np.int64),
        doc_paths=_shard_paths(assignments), doc_split=assignments.split, n_paths=topology.n_paths,
        tokenizer=tokenizer, config=config.sharding, out_dir=run.shards,
        router_fingerprint=assignments.router_fingerprint, min_test_tokens=config.routing.prefix_tokens + 1,
        overwrite=True,
    )
    log.info("tokenizer %s", tokenizer_fingerprint(tokenizer)[:12])
    return index


def _shard_paths(assignments: Assignments) -> np.ndarray:
    """(N,) paths, or (N, k) with overlap: training docs' top-k, test docs' path in column 0."""
    if assignments.topk is None:
        return assignments.path
    out = assignments.topk.copy()
    other = assignments.split != TRAIN
    out[other] = -1
    out[other, 0] = assignments.path[other]
    return out


def format_shards(index: dict) -> str:
    rows = [[p["path"], p["train"]["blocks"], f"{p['train']['tokens']:,}", p["val"]["blocks"]] for p in index["paths"]]
    test = index["test"]
    return (format_table(["path", "train blocks", "train tokens", "val blocks"], rows)
            + f"\ntest: {test['documents']} documents, {test['tokens']:,} tokens"
            + f" ({test.get('too_short', 0)} too short to score, left out)")
