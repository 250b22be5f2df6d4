"""The routed corpus going in: its arrays checked, then tokenized a batch at a time, training documents
(+ EOS) into their paths' staging files, test documents (no EOS, truncated to `seq_len`) into the test set.

    ids, paths, split = check_inputs(texts, doc_ids=ids, doc_paths=paths, doc_split=split, n_paths=4)
    counts = tokenize_routed(texts, doc_ids=ids, doc_paths=paths, ..., stage_writers=writers, test_writer=test)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from sharding.format import ShardError
from sharding.sharding_config import ShardingConfig
from sharding.tokenizer import encode_batch
from sharding.writer import BlockWriter, DocumentWriter

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TRAIN, TEST, ROUTER = 0, 1, 2  # ROUTER documents (held out for `dipaco reroute`) are not written


def check_inputs(
    texts: Iterable[str], *, doc_ids: np.ndarray, doc_paths: np.ndarray, doc_split: np.ndarray, n_paths: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if n_paths < 1:
        raise ValueError(f"n_paths must be >= 1, got {n_paths}")
    arrays = {
        "doc_ids": np.asarray(doc_ids),
        "doc_paths": np.asarray(doc_paths),
        "doc_split": np.asarray(doc_split),
    }
    if arrays["doc_paths"].ndim == 2:
        top = arrays["doc_paths"].astype(np.int64)
        dup = (top[:, :, None] == top[:, None, :]) & (top[:, :, None] >= 0)
        if (dup.sum(axis=(1, 2)) > (top >= 0).sum(axis=1)).any():
            raise ValueError("doc_paths (N, k) lists a path twice for some document")
        arrays["doc_paths"] = top[:, 0]
        extra = top[:, 1:]
    else:
        extra = np.full((len(arrays["doc_paths"]), 0), -1, dtype=np.int64)
    for name, a in arrays.items():
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"{name} must be a 1-D integer array, got shape {a.shape} dtype {a.dtype}")
    n = len(arrays["doc_ids"])
    lengths = {name: len(a) for name, a in arrays.items()}
    if hasattr(texts, "__len__"):
        lengths["texts"] = len(texts)  # type: ignore[arg-type]
    if len(set(lengths.values())) != 1:
        raise ValueError(f"inputs must have one entry per document, got lengths {lengths}")
    ids, paths, split = (a.astype(np.int64) for a in arrays.values())
    if len(np.unique(ids)) != n:
        raise ValueError(f"doc_ids must be unique; {n - len(np.unique(ids))} duplicates")
    bad_split = ~np.isin(split, [TRAIN, TEST, ROUTER])
    if bad_split.any():
        raise ValueError(
            f"doc_split must be 0 (train), 1 (test) or 2 (router); doc {ids[bad_split][0]} has {split[bad_split][0]}"
        )
    if ((extra >= n_paths) | (extra < -1)).any():
        raise ValueError(f"doc_paths (N, k) entries must be in [0, n_paths={n_paths}) or -1")
    paths = np.concatenate([paths[:, None], np.where(split[:, None] == TRAIN, extra, -1)], axis=1)
    low = np.where(split[:, None] == TRAIN, np.r_[0, np.full(extra.shape[1], -1)][None, :], -1)
    bad = ((paths < low) | (paths >= n_paths)).any(axis=1)
    if bad.any():
        raise ValueError(
            f"doc_paths must be in [0, n_paths={n_paths}) (-1 allowed for test docs); "
            f"doc {ids[bad][0]} has path {', '.join(map(str, paths[bad][0].tolist()))}"
        )
    return ids, paths, split


def tokenize_routed(
    texts: Iterable[str],
    *,
    doc_ids: np.ndarray,
    doc_paths: np.ndarray,
    doc_split: np.ndarray,
    tokenizer: PreTrainedTokenizerFast,
    stage_writers: list[BlockWriter],
    test_writer: DocumentWriter,
    config: ShardingConfig,
    min_test_tokens: int,
    batch_size: int,
    token_dtype: str,
) -> dict[str, Any]:
    """Tokenize in batches: train docs (+ EOS) go to the staging writers, test docs to the test writer."""
    eos = np.array([tokenizer.eos_token_id], dtype=np.int64)
    max_id = np.iinfo(token_dtype).max
    n = len(doc_ids)
    counts: dict[str, Any] = {
        "path_docs": np.zeros(len(stage_writers), np.int64),
        "path_tokens": np.zeros(len(stage_writers), np.int64),
        "too_short": 0,
        "truncated": 0,
    }
    it = iter(texts)
    with tqdm(total=n, desc="tokenize", unit="doc", disable=None) as bar:
        for start in range(0, n, batch_size):
            stop = min(start + batch_size, n)
            batch = list(itertools.islice(it, stop - start))
            if len(batch) != stop - start:
                raise ValueError(f"texts ended after {start + len(batch)} documents, but doc_ids has {n}")
            for i, t in enumerate(batch):
                if not isinstance(t, str):
                    raise ValueError(f"text of doc {doc_ids[start + i]} is {type(t).__name__}, not str")
            per_path: dict[int, list[np.ndarray]] = {}
            for i, tokens in enumerate(encode_batch(tokenizer, batch, max_chars=config.max_encode_chars), start=start):
                if len(tokens) and tokens.max() > max_id:
                    raise ShardError(f"doc {doc_ids[i]}: token id {tokens.max()} does not fit {token_dtype}")
                p = int(doc_paths[i, 0])
                if doc_split[i] == TRAIN:
                    for p in doc_paths[i][doc_paths[i] >= 0].tolist():  # k > 1: overlapping shards
                        per_path.setdefault(p, []).extend((tokens, eos))
                        counts["path_docs"][p] += 1
                        counts["path_tokens"][p] += len(tokens) + 1
                elif doc_split[i] == ROUTER:
                    continue
                elif len(tokens) < min_test_tokens:
                    counts["too_short"] += 1
                else:
                    counts["truncated"] += int(len(tokens) > config.seq_len)
                    test_writer.add(tokens[: config.seq_len], doc_id=int(doc_ids[i]), path=p)
            for p, pieces in per_path.items():
                stage_writers[p].append(np.concatenate(pieces))
            bar.update(stop - start)
    if next(it, None) is not None:
        raise ValueError(f"texts has more documents than doc_ids ({n})")
    return counts
