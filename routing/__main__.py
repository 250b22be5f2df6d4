"""Standalone routing CLI: load a corpus, fit a router on the train documents, save router + assignments.

    python -m routing --corpus docs.jsonl.zst --levels 2 2 --out runs/route [--prefix-chars 200]

Standalone mode has no tokenizer, so it routes on each document's first `--prefix-chars`
characters; dipaco's pipeline instead routes on the first `prefix_tokens` *tokens* of each
document, decoded back to text. The router is fitted on the train split only (the held-out test
documents are routed by it, never fitted on). Writes DIR/router.{json,safetensors} and
DIR/assignments.{json,safetensors} and prints the documents per path.
"""

from __future__ import annotations

import argparse
import logging

import numpy as np

from .assignments import Assignments
from .corpus import TEST, TRAIN, assign_splits, load_corpus
from .router import Router
from .routing_config import CorpusConfig, RoutingConfig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m routing", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, help="local file / dir / glob, or a HF dataset name")
    p.add_argument("--text-field", default="text")
    p.add_argument("--max-documents", type=int, default=0)
    p.add_argument("--levels", type=int, nargs="+", required=True, help="modules per level, e.g. 2 2")
    p.add_argument("--method", default="product", choices=["product", "flat"])
    p.add_argument("--svd-dim", type=int, default=64)
    p.add_argument("--prefix-chars", type=int, default=200)
    p.add_argument("--test-fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    corpus = CorpusConfig(
        path=args.corpus,
        text_field=args.text_field,
        max_documents=args.max_documents,
        test_fraction=args.test_fraction,
        seed=args.seed,
    )
    config = RoutingConfig(featurizer="tfidf", method=args.method, svd_dim=args.svd_dim, seed=args.seed)
    ds = load_corpus(path=corpus.path, text_field=corpus.text_field, max_documents=corpus.max_documents)
    prefixes = [t[: args.prefix_chars] for t in ds["text"]]
    split = assign_splits(len(prefixes), test_fraction=corpus.test_fraction, seed=corpus.seed)
    train = [t for t, s in zip(prefixes, split, strict=True) if s == TRAIN]
    router, _ = Router.fit(train, levels=args.levels, config=config)
    router.save(args.out)
    assignments = Assignments(
        path=router.route(prefixes),
        split=split,
        levels=router.levels,
        router_fingerprint=router.fingerprint(),
    )
    assignments.save(args.out)

    train_sizes, test_sizes = assignments.sizes(TRAIN), assignments.sizes(TEST)
    print(f"{'path':>10} {'modules':>14} {'train':>8} {'test':>8}")
    for pid in range(router.n_paths):
        modules = ",".join(str(int(m)) for m in np.unravel_index(pid, router.levels))
        print(f"{pid:>10} {modules:>14} {train_sizes[pid]:>8} {test_sizes[pid]:>8}")
    print(f"{'total':>10} {'':>14} {train_sizes.sum():>8} {test_sizes.sum():>8}   -> {args.out}")


if __name__ == "__main__":
    main()
