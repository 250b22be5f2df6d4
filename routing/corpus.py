"""Load a text corpus through Hugging Face `datasets` and split it into train / test documents.

`load_corpus` accepts a local file, directory or glob, or a hub dataset name, and returns a
`datasets.Dataset` with columns `text`, `doc_id` (0..N-1) and `source` when the input has one.
The builder is picked from the file extension:

- `.json` / `.jsonl`, optionally `.zst` / `.gz` / `.bz2` / `.xz` compressed -> "json" builder
  (datasets opens compressed files through fsspec; `.zst` needs the `zstandard` package);
- `.parquet` -> "parquet" builder;
- `.txt` (optionally compressed) -> "text" builder. A single .txt FILE holds one document per line;
  a DIRECTORY or GLOB of .txt files holds one document per file (`sample_by="document"`).

A directory is searched recursively and must hold files of one kind (files with other extensions
are skipped, and counted in the log). Any path that does not exist locally is loaded as a hub
dataset `load_dataset(name, split=split)` (needs network unless it is already cached). The name
"demo" is resolved to the bundled corpus by `dipaco`, not here.

`assign_splits` draws the held-out test documents (whole documents) with a seeded permutation.

    python -c "from routing import load_corpus; print(load_corpus(path='docs.jsonl.zst'))"
"""

from __future__ import annotations

import glob
import logging
from pathlib import Path

import datasets
import numpy as np

from routing.corpus_check import first_bad_line

logger = logging.getLogger(__name__)

TRAIN = 0
TEST = 1
ROUTER = 2  # held out for the discriminative router (`dipaco reroute`): never trained on, never evaluated
# Split codes stored in assignments.
SPLIT_NAMES: dict[int, str] = {TRAIN: "train", TEST: "test", ROUTER: "router"}

_COMPRESSION = (".zst", ".gz", ".bz2", ".xz")
_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def builder_for(file: str | Path) -> str | None:
    """The `datasets` builder name for a file by its extension ("text"/"json"/"parquet"), or None."""
    name = Path(file).name.lower()
    compressed = name.endswith(_COMPRESSION)
    if compressed:
        name = name[: name.rfind(".")]
    builder = _BUILDERS.get(Path(name).suffix)
    if builder == "parquet" and compressed:
        return None  # parquet compresses internally; an outer .gz/.zst is not readable by the builder
    return builder


def _local_files(path: str) -> tuple[str, list[str], bool] | None:
    """(builder, sorted files, one_doc_per_file) for a local path, or None if `path` is not local."""
    p = Path(path)
    if p.is_file():
        builder = builder_for(p)
        if builder is None:
            raise ValueError(
                f"unsupported corpus file {path!r}: expected .txt, .json, .jsonl (optionally "
                f".zst/.gz/.bz2/.xz) or .parquet"
            )
        return builder, [str(p)], False
    if p.is_dir():
        candidates = sorted(str(f) for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
    elif any(ch in path for ch in "*?["):
        candidates = sorted(f for f in glob.glob(path, recursive=True) if Path(f).is_file())
        if not candidates:
            raise FileNotFoundError(f"corpus glob {path!r} matches no files")
    else:
        return None
    by_builder: dict[str, list[str]] = {}
    skipped = 0
    for f in candidates:
        builder = builder_for(f)
        if builder is None:
            skipped += 1
        else:
            by_builder.setdefault(builder, []).append(f)
    if skipped:
        logger.info("corpus %s: skipped %d file(s) with an unsupported extension", path, skipped)
    if not by_builder:
        raise FileNotFoundError(f"corpus {path!r} holds no .txt/.json/.jsonl/.parquet files")
    if len(by_builder) > 1:
        kinds = {b: len(fs) for b, fs in by_builder.items()}
        raise ValueError(f"corpus {path!r} mixes file kinds {kinds}; point it at one kind of file")
    ((builder, files),) = by_builder.items()
    return builder, files, builder == "text"


def load_corpus(
    *,
    path: str,
    text_field: str = "text",
    split: str = "train",
    max_documents: int = 0,
    cache_dir: str | None = None,
) -> datasets.Dataset:
    """Load documents as a Dataset with columns `text`, `doc_id` (int64, 0..N-1) and `source` if present.

    Empty or whitespace-only texts are dropped (and the count logged) before `max_documents`
    (0 = all) keeps the first N documents. `split` applies to hub datasets; local files form one
    split. `cache_dir` is passed to `datasets.load_dataset` (None = the usual HF cache).
    """
    if max_documents < 0:
        raise ValueError(f"max_documents must be >= 0 (0 = all), got {max_documents}")
    if path == "demo":
        raise ValueError(
            "corpus path 'demo' is resolved by dipaco (the bundled corpus); pass a file path here"
        )
    local = _local_files(path)
    if local is not None:
        builder, files, one_doc_per_file = local
        kwargs = {"sample_by": "document"} if one_doc_per_file else {}
        logger.info("loading %d %s file(s) from %s", len(files), builder, path)
        where = files[0] if len(files) == 1 else f"{path} ({len(files)} files)"
        problem = first_bad_line(files, builder, text_field, max_lines=1)  # pyarrow crashes on some first lines
        if problem:
            raise ValueError(problem)
        try:
            ds = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=cache_dir, **kwargs)
            return _normalise(ds, text_field=text_field, where=where, max_documents=max_documents)
        except Exception as err:  # datasets wraps the cause (DatasetGenerationError, StopIteration, ...)
            problem = first_bad_line(files, builder, text_field)
            if problem:
                raise ValueError(problem) from None
            if type(err) is ValueError:
                raise  # already says what is wrong
            raise ValueError(f"corpus {where} could not be read as {builder}: {_root_cause(err)}") from err
    else:
        logger.info("%s is not a local path; loading it as a hub dataset (split %s)", path, split)
        try:
            ds = datasets.load_dataset(path, split=split, cache_dir=cache_dir)
        except Exception as e:  # datasets raises many kinds; keep the cause, name the path
            raise FileNotFoundError(
                f"corpus {path!r} is not a local file, directory or glob, and loading it as a hub "
                f"dataset (split {split!r}) failed: {type(e).__name__}: {e}"
            ) from e
        where = f"hub dataset {path} [{split}]"
    return _normalise(ds, text_field=text_field, where=where, max_documents=max_documents)


def _root_cause(err: BaseException) -> str:
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
    return f"{type(err).__name__}: {err}"


def _normalise(ds: datasets.Dataset, *, text_field: str, where: str, max_documents: int) -> datasets.Dataset:
    """Keep `text` (renamed from `text_field`) and `source`, drop empty texts, add `doc_id`."""
    columns = list(ds.column_names)
    if text_field not in columns:
        raise ValueError(f"text field {text_field!r} not in {where}; columns present: {columns}")
    feature = ds.features[text_field]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        raise ValueError(f"text field {text_field!r} in {where} is {feature}, not a string column")
    keep = [text_field] + (["source"] if "source" in columns and text_field != "source" else [])
    ds = ds.select_columns(keep)
    if text_field != "text":
        ds = ds.rename_column(text_field, "text")
    n_raw = len(ds)
    ds = ds.filter(
        lambda texts: [t is not None and t.strip() != "" for t in texts],
        input_columns="text",
        batched=True,
        desc="drop empty documents",
    )
    dropped = n_raw - len(ds)
    if dropped:
        logger.warning(
            "%s: dropped %d of %d documents with empty or whitespace-only text", where, dropped, n_raw
        )
    if max_documents and len(ds) > max_documents:
        logger.info("%s: keeping the first %d of %d documents", where, max_documents, len(ds))
        ds = ds.select(range(max_documents))
    if len(ds) == 0:
        raise ValueError(f"{where} holds no non-empty documents in field {text_field!r}")
    ds = ds.add_column("doc_id", np.arange(len(ds), dtype=np.int64))
    logger.info("%s: %d documents", where, len(ds))
    return ds


def assign_splits(n: int, *, test_fraction: float, seed: int, router_fraction: float = 0.0) -> np.ndarray:
    """Split codes (N,) int8: TRAIN (0), TEST (1) or ROUTER (2) per document, from a seeded permutation.

    Exactly round(n * test_fraction) documents are TEST, at least 1 when n >= 2 (and never all of
    them); the next round(n * router_fraction) of the permutation are ROUTER (the TEST documents
    do not depend on router_fraction). The same arguments always give the same array.
    """
    if n < 0:
        raise ValueError(f"number of documents must be >= 0, got {n}")
    if not 0.0 < test_fraction < 0.5:
        raise ValueError(f"test_fraction must be in (0, 0.5), got {test_fraction}")
    n_test = round(n * test_fraction)
    if n >= 2:
        n_test = min(max(n_test, 1), n - 1)
    split = np.full(n, TRAIN, dtype=np.int8)
    perm = np.random.default_rng(seed).permutation(n)
    split[perm[:n_test]] = TEST
    if router_fraction:
        if not 0.0 < router_fraction < 0.5:
            raise ValueError(f"router_fraction must be in [0, 0.5), got {router_fraction}")
        n_router = min(round(n * router_fraction), n - n_test - 1)
        split[perm[n_test : n_test + max(n_router, 0)]] = ROUTER
    return split
