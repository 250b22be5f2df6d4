"""More labelled routing examples from the router split: each router document's later windows.

`dipaco reroute` scores each router document's first `sharding.seq_len` tokens under every path. A router
document is often longer: its window w (tokens [w L, (w + 1) L)) is another honest routing example (the router
split is never trained on): its first `routing.prefix_tokens` tokens are the prefix, featurized as the router
does, and every path's mean loss on the rest is its label. Writes runs/<name>/router-windows.npz with
"features" (N, dim), "nll" (N, paths), "document" (N,) and "window" (N,); window 0 is the documents' first
window (the examples `dipaco reroute` already scored, scored again here so the file stands alone).

    OMP_NUM_THREADS=2 python experiments/router_windows.py runs/learned-router-8x8-seed0 --windows 4
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dipaco.config import load_config  # noqa: E402
from dipaco.device import resolve_device  # noqa: E402
from dipaco.eval.modes import LossTable  # noqa: E402
from dipaco.eval.path_labels import candidate_losses  # noqa: E402
from dipaco.eval.scoring import token_losses  # noqa: E402
from dipaco.pipeline.context import PathFactory  # noqa: E402
from dipaco.pipeline.documents import load_run_corpus, run_splits  # noqa: E402
from dipaco.run_dir import RunDir  # noqa: E402
from dipaco.threads import use_threads  # noqa: E402
from routing.corpus import ROUTER  # noqa: E402
from routing.router import Router  # noqa: E402
from sharding.tokenizer import decode_prefix, encode_batch  # noqa: E402


def windows(tokens: list[np.ndarray], *, seq_len: int, prefix: int, most: int) -> list[tuple[int, int, np.ndarray]]:
    """(document index, window, token ids) of each document's first `most` windows of `seq_len` tokens that
    have a token after the prefix."""
    out = []
    for d, t in enumerate(tokens):
        for w in range(most):
            piece = t[w * seq_len:(w + 1) * seq_len]
            if len(piece) > prefix:
                out.append((d, w, piece))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--windows", type=int, default=4, help="most windows per router document")
    args = parser.parse_args()
    started = time.perf_counter()
    config = load_config(args.run / "config.yaml")
    use_threads(config.hardware.threads_per_island)
    run = RunDir(args.run)
    factory = PathFactory(config, run)
    texts = load_run_corpus(config.corpus)["text"]
    router_docs = np.flatnonzero(run_splits(config.corpus, len(texts)) == ROUTER)
    tokens = encode_batch(factory.tokenizer, [texts[int(i)] for i in router_docs])
    prefix, seq_len = factory.prefix_tokens, config.sharding.seq_len
    found = windows(tokens, seq_len=seq_len, prefix=prefix, most=args.windows)
    kmeans = Router.load(run.routing / "phase-0")
    features = kmeans.features([decode_prefix(factory.tokenizer, piece, prefix) for _, _, piece in found])
    device = resolve_device(config.hardware.device)
    table = LossTable(docs=[piece for _, _, piece in found],
                      load=lambda path, version: factory.load_path(path=path, round=version, device=device),
                      score=partial(token_losses, batch_size=config.eval.batch_size, device=device,
                                    precision=config.hardware.precision, pad_id=factory.tokenizer.pad_token_id or 0))
    n_paths = factory.topology.n_paths
    everyone = np.tile(np.arange(n_paths), (len(found), 1))
    nll = candidate_losses(table, everyone, round=factory.store.current_round(), n_paths=n_paths, skip=prefix)
    np.savez(args.run / "router-windows.npz", features=features, nll=nll,
             document=np.array([router_docs[d] for d, _, _ in found]), window=np.array([w for _, w, _ in found]))
    print(f"{len(found)} windows of {len(router_docs)} router documents scored under {n_paths} paths in "
          f"{time.perf_counter() - started:.0f} s -> {args.run / 'router-windows.npz'}")


if __name__ == "__main__":
    main()
