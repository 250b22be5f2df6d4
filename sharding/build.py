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
``staging`` checks and tokenizes the inputs, ``shard_dir`` prepares the directory and writes its index.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from sharding.format import (
    INDEX_NAME,
    TEST_DIR,
    TOKENIZER_DIR,
    path_dir_name,
    read_array,
    token_dtype_for,
    write_json,
)
from sharding.shard_dir import (
    STAGING_DIR,
    build_dir_for,
    log_summary,
    make_index,
    remove_files,
    replace_with,
    split_entry,
)
from sharding.sharding_config import ShardingConfig
from sharding.staging import check_inputs, tokenize_routed
from sharding.tokenizer import vocab_size_of
from sharding.writer import BlockWriter, DocumentWriter

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

STAGING_TOKENS = 1 << 20  # largest staging file, in tokens


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
    index.json in ``out_dir`` is refused unless ``overwrite``; with it, the new build is made beside the old
    one and replaces it only once complete. On any error the files this call wrote are removed, no new
    index.json is left behind, and an old build is left as it was.
    """
    doc_ids, doc_paths, doc_split = check_inputs(
        texts, doc_ids=doc_ids, doc_paths=doc_paths, doc_split=doc_split, n_paths=n_paths
    )
    _check_arguments(tokenizer, config=config, min_test_tokens=min_test_tokens)
    final_dir = Path(out_dir)
    out_dir = build_dir_for(final_dir, overwrite=overwrite)  # a sibling while an old build stays in place
    token_dtype = token_dtype_for(vocab_size_of(tokenizer))
    writers = _Writers.open(out_dir, n_paths=n_paths, config=config, token_dtype=token_dtype)
    try:
        counts = tokenize_routed(
            texts, doc_ids=doc_ids, doc_paths=doc_paths, doc_split=doc_split, tokenizer=tokenizer,
            stage_writers=writers.stage, test_writer=writers.test, config=config,
            min_test_tokens=min_test_tokens, batch_size=batch_size, token_dtype=token_dtype,
        )
        paths = _write_paths(writers, counts, out_dir=out_dir, config=config, token_dtype=token_dtype)
        tokenizer.save_pretrained(str(out_dir / TOKENIZER_DIR))
        index = make_index(
            tokenizer, config=config, n_paths=n_paths, paths=paths, test_writer=writers.test, counts=counts,
            router_fingerprint=router_fingerprint, min_test_tokens=min_test_tokens, token_dtype=token_dtype,
        )
        write_json(out_dir / INDEX_NAME, index)  # last: from now on the directory is complete
        shutil.rmtree(out_dir / STAGING_DIR, ignore_errors=True)
        replace_with(final_dir, out_dir)
    except BaseException:
        remove_files(writers.files(), out_dir)
        if out_dir != final_dir:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(out_dir / STAGING_DIR, ignore_errors=True)
    log_summary(index, final_dir)
    return index


def _check_arguments(tokenizer: PreTrainedTokenizerFast, *, config: ShardingConfig, min_test_tokens: int) -> None:
    """Refuse a ``min_test_tokens`` outside ``[1, seq_len]`` and a tokenizer without an EOS token."""
    if not 1 <= min_test_tokens <= config.seq_len:
        raise ValueError(f"min_test_tokens must be in [1, seq_len={config.seq_len}], got {min_test_tokens}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; sharding needs one to separate documents")


@dataclass
class _Writers:
    """The writers of one build: a staging writer per path, the test documents' writer, and each path's train
    and val writers as they are made; on a failure every file they wrote is removed (``files``)."""

    stage: list[BlockWriter]
    test: DocumentWriter
    final: list[BlockWriter] = field(default_factory=list)

    @classmethod
    def open(cls, out_dir: Path, *, n_paths: int, config: ShardingConfig, token_dtype: str) -> _Writers:
        """Staging writers under ``out_dir/.staging/`` (files of at most ``STAGING_TOKENS`` tokens) and the
        test documents' writer."""
        stage_tokens = min(config.tokens_per_shard, STAGING_TOKENS)
        stage = [
            BlockWriter(
                out_dir / STAGING_DIR / path_dir_name(p),
                prefix="stage",
                seq_len=config.seq_len,
                dtype=token_dtype,
                tokens_per_shard=stage_tokens,
                root=out_dir,
            )
            for p in range(n_paths)
        ]
        test = DocumentWriter(
            out_dir / TEST_DIR, prefix="test", dtype=token_dtype, tokens_per_shard=config.tokens_per_shard, root=out_dir
        )
        return cls(stage=stage, test=test)

    def files(self) -> list[Path]:
        """Every file the writers wrote."""
        return [f for w in [*self.stage, self.test, *self.final] for f in w.files]


def _write_paths(
    writers: _Writers, counts: dict[str, Any], *, out_dir: Path, config: ShardingConfig, token_dtype: str
) -> list[dict[str, Any]]:
    """Close the staging and test writers, check every path has 2 blocks, then split each path's staged
    blocks into its train and val shards; return the paths' index entries."""
    dropped = [len(w.close()) for w in writers.stage]
    writers.test.close()
    _check_path_sizes(writers.stage, counts["path_tokens"], seq_len=config.seq_len)
    paths = []
    final = {"seq_len": config.seq_len, "dtype": token_dtype, "tokens_per_shard": config.tokens_per_shard}
    for p, staged in enumerate(tqdm(writers.stage, desc="write shards", unit="path", disable=None)):
        directory = out_dir / path_dir_name(p)
        train_w, val_w = (BlockWriter(directory, prefix=s, root=out_dir, **final) for s in ("train", "val"))
        writers.final += [train_w, val_w]  # before writing: a failure removes their files
        _split_path(staged, train_w, val_w, path=p, out_dir=out_dir, config=config, token_dtype=token_dtype)
        paths.append(
            {
                "path": p,
                "train": {**split_entry(train_w), "documents": int(counts["path_docs"][p])},
                "val": split_entry(val_w),
                "dropped_tokens": dropped[p],
            }
        )
    return paths


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


