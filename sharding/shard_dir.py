"""The shard directory around a build: an old one refused, or kept until the new build is complete and then
cleared (its files, then its index) and replaced; the index a build writes last, and the files a failed build
leaves removed.

    building = build_dir_for(out_dir, overwrite=True); ...; replace_with(out_dir, building)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sharding.format import FORMAT_VERSION, INDEX_NAME, TOKENIZER_DIR
from sharding.sharding_config import ShardingConfig
from sharding.tokenizer import tokenizer_fingerprint, vocab_size_of
from sharding.writer import BlockWriter, DocumentWriter

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

STAGING_DIR = ".staging"


def build_dir_for(out_dir: Path, *, overwrite: bool) -> Path:
    """Where a build into `out_dir` writes: `out_dir` itself when it holds no complete build, else (overwrite)
    a fresh sibling directory that `replace_with` moves in once the new build is complete, so a build that
    fails leaves the old shards as they were. Refuses an existing index.json unless `overwrite`."""
    index_path = out_dir / INDEX_NAME
    if not index_path.exists():
        prepare_out_dir(out_dir, overwrite=False)
        return out_dir
    if not overwrite:
        raise FileExistsError(f"{index_path} exists: {out_dir} already holds shards (pass overwrite=True)")
    building = out_dir.with_name(f".{out_dir.name}.building")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    return building


def replace_with(out_dir: Path, building: Path) -> None:
    """The complete build in `building` moved into `out_dir`: the old build's files cleared (`prepare_out_dir`),
    then the new files moved in, its index.json last; `building` removed."""
    if building == out_dir:
        return
    prepare_out_dir(out_dir, overwrite=True)
    for item in sorted(building.rglob("*")):
        if item.is_file() and item.name != INDEX_NAME:
            target = out_dir / item.relative_to(building)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(item, target)
    os.replace(building / INDEX_NAME, out_dir / INDEX_NAME)  # last: from now on the directory is complete
    shutil.rmtree(building, ignore_errors=True)


def prepare_out_dir(out_dir: Path, *, overwrite: bool) -> None:
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
        remove_files(old_files, out_dir)
        logger.info("overwriting shards in %s", out_dir)
    shutil.rmtree(out_dir / STAGING_DIR, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)


def make_index(
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


def split_entry(writer: BlockWriter) -> dict[str, Any]:
    return {
        "blocks": writer.num_blocks,
        "tokens": writer.num_blocks * writer.seq_len,
        "shards": writer.shards,
    }


def remove_files(files: list[Path], out_dir: Path) -> None:
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


def log_summary(index: dict[str, Any], out_dir: Path) -> None:
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
