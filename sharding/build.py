"""Build the token shards of a routed corpus: tokenize, pack per path into blocks, split, write.

Input: the documents' texts and, per document, its id, routed path and split (0 = train,
1 = test) — plain numpy arrays produced by ``routing``. Output: a shard directory (layout in
``sharding.format``) whose ``index.json`` is written last, so a half-built directory never looks
complete.

- train documents: tokenized, EOS appended, concatenated per path in document order, cut into
  blocks of exactly ``seq_len`` tokens (the tail of each path is dropped and counted); a seeded
  choice of ``max(1, round(val_fraction * n_blocks))`` blocks per path becomes that path's
  validation set. A path with fewer than 2 blocks is an error.
- test documents: tokenized (no EOS), truncated to ``seq_len`` tokens, stored whole in one
  document set with their ids and routed paths; documents shorter than ``min_test_tokens`` are
  left out and counted.

Tokens first go to per-path staging files (``.staging/``) because the number of blocks of a path,
which the validation choice needs, is only known at the end; so memory stays bounded by
``n_paths`` staging buffers of at most 2**20 tokens plus one shard.

The ``dipaco`` CLI calls :func:`build_shards`; inspect the result with ``python -m sharding info DIR``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import shutil
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from sharding.format import (
    FORMAT_VERSION,
    INDEX_NAME,
    TEST_DIR,
    TOKENIZER_DIR,
    ShardError,
    path_dir_name,
    read_array,
    token_dtype_for,
    write_json,
)
from sharding.sharding_config import ShardingConfig
from sharding.tokenizer import encode_batch, tokenizer_fingerprint, vocab_size_of
from sharding.writer import BlockWriter, DocumentWriter

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

STAGING_DIR = ".staging"
STAGING_TOKENS = 1 << 20  # largest staging file, in tokens
TRAIN, TEST, ROUTER = 0, 1, 2  # ROUTER documents (held out for `dipaco reroute`) are not written


def choose_val_blocks(n_blocks: int, *, val_fraction: float, seed: int, path: int) -> np.ndarray:
    """Boolean mask (n_blocks,) of the blocks held out for validation; needs ``n_blocks >= 2``.

    ``max(1, round(val_fraction * n_blocks))`` blocks (but at least one left for training), drawn
    without replacement by a generator seeded with ``(path, seed)``.
    """
    if n_blocks < 2:
        raise ValueError(f"path {path}: need >= 2 blocks to hold out validation, got {n_blocks}")
    n_val = min(n_blocks - 1, max(1, round(val_fraction * n_blocks)))
    mask = np.zeros(n_blocks, dtype=bool)
    mask[np.random.default_rng([path, seed]).choice(n_blocks, size=n_val, replace=False)] = True
    return mask


def build_shards(
    *,
    texts: Iterable[str],
    doc_ids: np.ndarray,
    doc_paths: np.ndarray,
    doc_split: np.ndarray,
    n_paths: int,
    tokenizer: PreTrainedTokenizerFast,
    config: ShardingConfig,
    out_dir: str | Path,
    router_fingerprint: str,
    min_test_tokens: int = 33,
    overwrite: bool = False,
    batch_size: int = 1000,
) -> dict[str, Any]:
    """Tokenize and shard a routed corpus into ``out_dir``; return the index written to index.json.

    ``texts`` is any iterable of N strings (a list, or a ``datasets`` column) aligned with the
    (N,) arrays ``doc_ids`` (int64, unique), ``doc_paths`` (int64 in ``[0, n_paths)``; a test
    document may have -1 = not routed) and ``doc_split`` (0 = train, 1 = test, 2 = router: skipped).
    ``doc_paths`` may also be (N, k): a training document is then written into each of its k paths
    (overlapping shards, ``routing.train_top_k``; -1 entries are unused slots); a test document
    uses column 0 only, so evaluation documents never overlap. An existing
    index.json in ``out_dir`` is refused unless ``overwrite``. On any error the files this call
    wrote are removed and no index.json is left behind.
    """
    doc_ids, doc_paths, doc_split = _check_inputs(
        texts, doc_ids=doc_ids, doc_paths=doc_paths, doc_split=doc_split, n_paths=n_paths
    )
    if not 1 <= min_test_tokens <= config.seq_len:
        raise ValueError(f"min_test_tokens must be in [1, seq_len={config.seq_len}], got {min_test_tokens}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos token; sharding needs one to separate documents")
    out_dir = Path(out_dir)
    _prepare_out_dir(out_dir, overwrite=overwrite)
    token_dtype = token_dtype_for(vocab_size_of(tokenizer))
    staging = out_dir / STAGING_DIR
    stage_tokens = min(config.tokens_per_shard, STAGING_TOKENS)
    stage_writers = [
        BlockWriter(
            staging / path_dir_name(p),
            prefix="stage",
            seq_len=config.seq_len,
            dtype=token_dtype,
            tokens_per_shard=stage_tokens,
            root=out_dir,
        )
        for p in range(n_paths)
    ]
    test_writer = DocumentWriter(
        out_dir / TEST_DIR,
        prefix="test",
        dtype=token_dtype,
        tokens_per_shard=config.tokens_per_shard,
        root=out_dir,
    )
    final_writers: list[BlockWriter] = []
    try:
        counts = _tokenize(
            texts,
            doc_ids=doc_ids,
            doc_paths=doc_paths,
            doc_split=doc_split,
            tokenizer=tokenizer,
            stage_writers=stage_writers,
            test_writer=test_writer,
            config=config,
            min_test_tokens=min_test_tokens,
            batch_size=batch_size,
            token_dtype=token_dtype,
        )
        dropped = [len(w.close()) for w in stage_writers]
        test_writer.close()
        _check_path_sizes(stage_writers, counts["path_tokens"], seq_len=config.seq_len)
        paths = []
        final = {"seq_len": config.seq_len, "dtype": token_dtype, "tokens_per_shard": config.tokens_per_shard}
        for p, staged in enumerate(tqdm(stage_writers, desc="write shards", unit="path", disable=None)):
            directory = out_dir / path_dir_name(p)
            train_w, val_w = (
                BlockWriter(directory, prefix=s, root=out_dir, **final) for s in ("train", "val")
            )
            final_writers += [train_w, val_w]  # before writing: a failure removes their files
            _split_path(
                staged, train_w, val_w, path=p, out_dir=out_dir, config=config, token_dtype=token_dtype
            )
            paths.append(
                {
                    "path": p,
                    "train": {**_split_entry(train_w), "documents": int(counts["path_docs"][p])},
                    "val": _split_entry(val_w),
                    "dropped_tokens": dropped[p],
                }
            )
        tokenizer.save_pretrained(str(out_dir / TOKENIZER_DIR))
        index = _make_index(
            tokenizer,
            config=config,
            n_paths=n_paths,
            paths=paths,
            test_writer=test_writer,
            counts=counts,
            router_fingerprint=router_fingerprint,
            min_test_tokens=min_test_tokens,
            token_dtype=token_dtype,
        )
        write_json(out_dir / INDEX_NAME, index)  # last: from now on the directory is complete
    except BaseException:
        _remove_files([f for w in [*stage_writers, test_writer, *final_writers] for f in w.files], out_dir)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _log_summary(index, out_dir)
    return index


def _check_inputs(
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


def _prepare_out_dir(out_dir: Path, *, overwrite: bool) -> None:
    index_path = out_dir / INDEX_NAME
    if index_path.exists():
        if not overwrite:
            raise FileExistsError(
                f"{index_path} exists: {out_dir} already holds shards (pass overwrite=True)"
            )
        old_files: list[Path] = []
        try:
            old = json.loads(index_path.read_text())
            for entry in old.get("paths", []):
                for split in ("train", "val"):
                    old_files += [out_dir / s["file"] for s in entry[split]["shards"]]
            for s in old.get("test", {}).get("shards", []):
                old_files += [out_dir / s[k] for k in ("file", "offsets_file", "doc_ids_file", "paths_file")]
        except (ValueError, KeyError, TypeError, AttributeError):
            logger.warning("could not parse the old %s; removing only the index", index_path)
        index_path.unlink()  # first: from here on the directory no longer looks complete
        _remove_files(old_files, out_dir)
        logger.info("overwriting shards in %s", out_dir)
    shutil.rmtree(out_dir / STAGING_DIR, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)


def _tokenize(
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


def _check_path_sizes(stage_writers: list[BlockWriter], path_tokens: np.ndarray, *, seq_len: int) -> None:
    small = {p: int(path_tokens[p]) for p, w in enumerate(stage_writers) if w.num_blocks < 2}
    if small:
        listing = ", ".join(f"path {p}: {t} tokens" for p, t in small.items())
        raise ValueError(
            f"{len(small)} path(s) have fewer than 2 blocks of seq_len={seq_len} tokens "
            f"(need >= {2 * seq_len} tokens for a train and a val block): {listing}"
        )


def _split_path(
    staged: BlockWriter,
    train_w: BlockWriter,
    val_w: BlockWriter,
    *,
    path: int,
    out_dir: Path,
    config: ShardingConfig,
    token_dtype: str,
) -> None:
    """Rewrite one path's staged blocks into its train and val writers, deleting the staged files."""
    is_val = choose_val_blocks(
        staged.num_blocks, val_fraction=config.val_fraction, seed=config.seed, path=path
    )
    pos = 0
    for shard in staged.shards:
        file = out_dir / shard["file"]
        blocks = read_array(file, dtype=token_dtype, sha256=shard["sha256"], length=shard["tokens"])
        blocks = blocks.reshape(-1, config.seq_len)  # (n, seq_len)
        mask = is_val[pos : pos + len(blocks)]
        train_w.append(blocks[~mask].ravel())
        val_w.append(blocks[mask].ravel())
        pos += len(blocks)
        file.unlink()
    assert not len(train_w.close()) and not len(val_w.close())


def _make_index(
    tokenizer: PreTrainedTokenizerFast,
    *,
    config: ShardingConfig,
    n_paths: int,
    paths: list[dict[str, Any]],
    test_writer: DocumentWriter,
    counts: dict[str, Any],
    router_fingerprint: str,
    min_test_tokens: int,
    token_dtype: str,
) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seq_len": config.seq_len,
        "token_dtype": token_dtype,
        "vocab_size": vocab_size_of(tokenizer),
        "eos_token_id": int(tokenizer.eos_token_id),
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "tokenizer_dir": TOKENIZER_DIR,
        "router_fingerprint": router_fingerprint,
        "n_paths": n_paths,
        "min_test_tokens": min_test_tokens,
        "config": dataclasses.asdict(config),
        "paths": paths,
        "test": {
            "documents": sum(s["documents"] for s in test_writer.shards),
            "tokens": sum(s["tokens"] for s in test_writer.shards),
            "too_short": counts["too_short"],
            "truncated": counts["truncated"],
            "shards": test_writer.shards,
        },
    }


def _split_entry(writer: BlockWriter) -> dict[str, Any]:
    return {
        "blocks": writer.num_blocks,
        "tokens": writer.num_blocks * writer.seq_len,
        "shards": writer.shards,
    }


def _remove_files(files: list[Path], out_dir: Path) -> None:
    """Delete the old index's files, only those inside `out_dir` (an edited index cannot name others)."""
    root = out_dir.resolve()
    outside = [f for f in files if root not in f.resolve().parents]
    if outside:
        logger.warning("the old index names %d file(s) outside %s (e.g. %s); left alone", len(outside), out_dir,
                       outside[0])
    files = [f for f in files if f not in outside]
    for f in files:
        f.unlink(missing_ok=True)
    for d in sorted({f.parent for f in files}, reverse=True):
        if d != out_dir and d.is_dir() and not any(d.iterdir()):
            d.rmdir()


def _log_summary(index: dict[str, Any], out_dir: Path) -> None:
    train = sum(p["train"]["tokens"] for p in index["paths"])
    val = sum(p["val"]["tokens"] for p in index["paths"])
    dropped = sum(p["dropped_tokens"] for p in index["paths"])
    test = index["test"]
    logger.info(
        "wrote %s: %d paths, %d train / %d val tokens (%d dropped tails), %d test docs (%d too short)",
        out_dir,
        index["n_paths"],
        train,
        val,
        dropped,
        test["documents"],
        test["too_short"],
    )
