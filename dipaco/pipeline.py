"""The offline stages before training: route the corpus, then write path-specific shards.

    dipaco route --config configs/tiny.yaml --run runs/tiny
    dipaco shard --config configs/tiny.yaml --run runs/tiny

`route` loads the corpus (HF datasets), holds out test documents, trains the BPE tokenizer on the
training documents (or copies the configured one), cuts each document's first `prefix_tokens`
tokens, fits the router on the training prefixes and assigns every document to a path.
`shard` tokenizes and packs each path's documents into zstd shards with a checked index.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np

from dipaco.config import Config, save_config
from dipaco.report import format_table
from dipaco.run import RunDir
from dipaco.topology import Topology
from routing.corpus import TRAIN, assign_splits, load_corpus
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


def route(config: Config, run: RunDir) -> dict:
    """Tokenizer, router and document → path assignments; returns routing statistics."""
    save_config(config, run.config)
    dataset = load_run_corpus(config)
    split = assign_splits(len(dataset), test_fraction=config.corpus.test_fraction, seed=config.corpus.seed)
    texts = dataset["text"]
    train_texts = [t for t, s in zip(texts, split) if s == TRAIN]
    tokenizer = _tokenizer(config, run, train_texts)
    prefixes = prefix_texts(tokenizer, texts, n_tokens=config.routing.prefix_tokens)
    topology = Topology.from_config(config.topology, n_layers=config.model.n_layers)
    router, fit_stats = Router.fit([p for p, s in zip(prefixes, split) if s == TRAIN],
                                   levels=list(topology.levels), config=config.routing)
    paths = assign_replicas(router.route(prefixes), replicas=topology.replicas, seed=config.corpus.seed)
    router.save(run.routing)
    Assignments(path=paths, split=split, levels=topology.data_levels,
                router_fingerprint=router.fingerprint()).save(run.routing)
    sources = dataset["source"] if "source" in dataset.column_names else None
    stats = routing_summary(paths, split, topology, sources)
    stats["fit"] = fit_stats
    return stats


def assign_replicas(routed: np.ndarray, *, replicas: int, seed: int) -> np.ndarray:
    """Routed path ids (N,) → data path ids: each document goes to a uniformly random replica of its
    path (`routed * replicas + r`), so DiLoCo replicas train on random shards of the data."""
    if replicas == 1:
        return routed
    return routed * replicas + np.random.default_rng([seed, 0xD1]).integers(0, replicas, size=len(routed))


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
    return format_table(headers, rows) + f"\nlargest / smallest path: {stats['balance']:.2f}"


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
        doc_paths=assignments.path, doc_split=assignments.split, n_paths=topology.n_paths,
        tokenizer=tokenizer, config=config.sharding, out_dir=run.shards,
        router_fingerprint=assignments.router_fingerprint, min_test_tokens=config.routing.prefix_tokens + 1,
        overwrite=True,
    )
    log.info("tokenizer %s", tokenizer_fingerprint(tokenizer)[:12])
    return index


def format_shards(index: dict) -> str:
    rows = [[p["path"], p["train"]["blocks"], f"{p['train']['tokens']:,}", p["val"]["blocks"]] for p in index["paths"]]
    test = index["test"]
    return (format_table(["path", "train blocks", "train tokens", "val blocks"], rows)
            + f"\ntest: {test['documents']} documents, {test['tokens']:,} tokens"
            + f" ({test.get('too_short', 0)} too short to score, left out)")
