"""`dipaco shard`: tokenize and pack each path's documents into checked zstd shards.

    dipaco shard --config configs/tiny.yaml --run runs/tiny

Reads the corpus, the run's tokenizer and the router's assignments (`dipaco route`), and writes
`shards/` (`sharding.format`: per path train / val token files, the test documents, `index.json`).
"""

from __future__ import annotations

import argparse
import logging

import numpy as np

from dipaco.config import Config, save_config
from dipaco.pipeline.context import PathFactory
from dipaco.pipeline.documents import corpus_location, load_run_corpus
from dipaco.pipeline.fingerprints import check, record, record_path
from dipaco.run_dir import RunDir
from dipaco.tables import format_table
from routing.assignments import Assignments
from routing.corpus import TRAIN
from sharding.build import build_shards
from sharding.tokenizer import load_tokenizer, tokenizer_fingerprint

log = logging.getLogger(__name__)


def shard(config: Config, run: RunDir) -> dict:
    """Write every path's train / val shards and the test documents; returns the shard index."""
    check(run, config, ("route",))
    record_path(run, "shard").unlink(missing_ok=True)  # until these shards are complete, no record claims them
    dataset = load_run_corpus(config.corpus)
    assignments = Assignments.load(run.require(run.routing / "assignments.json", "route").parent)
    if len(assignments.path) != len(dataset):
        raise ValueError(
            f"{run.routing / 'assignments.json'} routes {len(assignments.path)} documents, but the corpus "
            f"{corpus_location(config.corpus)} now has {len(dataset)}: run `dipaco route` again"
        )
    tokenizer = load_tokenizer(run.require(run.tokenizer, "route"))
    context = PathFactory(config, run)
    topology = context.topology
    if list(assignments.levels) != topology.data_levels:
        raise ValueError(f"{run.routing / 'assignments.json'} was routed for levels {assignments.levels}, "
                         f"the config asks for {topology.data_levels}: run `dipaco route` again")
    index = build_shards(
        texts=dataset["text"], doc_ids=np.asarray(dataset["doc_id"], dtype=np.int64),
        doc_paths=_shard_paths(assignments), doc_split=assignments.split, n_paths=topology.n_paths,
        tokenizer=tokenizer, config=config.sharding, out_dir=run.shards,
        router_fingerprint=assignments.router_fingerprint, min_test_tokens=context.prefix_tokens + 1,
        overwrite=True,
    )
    log.info("tokenizer %s", tokenizer_fingerprint(tokenizer)[:12])
    record(run, "shard", config, router=assignments.router_fingerprint)
    save_config(config, run.config)  # only now: config.yaml claims what was run
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


def command(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    print(format_shards(shard(config, run)))
