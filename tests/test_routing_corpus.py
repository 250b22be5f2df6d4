"""Tests of routing.corpus: load_corpus on each local file kind, and assign_splits.

HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python -m pytest tests/test_routing_corpus.py -q
"""

import gzip
import json
import logging

import datasets
import numpy as np
import pytest
import zstandard

from routing import CorpusConfig, assign_splits, load_corpus
from routing.corpus import TEST, TRAIN

DOCS = [
    {"text": "the first document about cats", "source": "a"},
    {"text": "   ", "source": "a"},
    {"text": "a second one, about dogs", "source": "b"},
    {"text": "", "source": "b"},
    {"text": "third: fish and chips", "source": "c"},
]
NON_EMPTY = [d["text"] for d in DOCS if d["text"].strip()]


def _jsonl(docs) -> bytes:
    return "".join(json.dumps(d) + "\n" for d in docs).encode()


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "hf-cache")


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".jsonl.zst", ".jsonl.gz"])
def test_json_files_load_and_drop_empty_docs(tmp_path, cache, caplog, suffix):
    data = _jsonl(DOCS)
    if suffix.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    elif suffix.endswith(".gz"):
        data = gzip.compress(data)
    f = tmp_path / f"docs{suffix}"
    f.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="routing.corpus"):
        ds = load_corpus(path=str(f), cache_dir=cache)
    assert ds["text"] == NON_EMPTY
    assert ds["source"] == ["a", "b", "c"]
    assert ds["doc_id"] == list(range(len(NON_EMPTY)))
    assert set(ds.column_names) == {"text", "source", "doc_id"}
    n_dropped = len(DOCS) - len(NON_EMPTY)
    assert f"dropped {n_dropped} of {len(DOCS)}" in caplog.text


def test_text_field_renamed_other_columns_dropped_max_documents(tmp_path, cache):
    f = tmp_path / "docs.jsonl"
    f.write_bytes(_jsonl([{"body": d["text"], "n": i} for i, d in enumerate(DOCS)]))
    ds = load_corpus(path=str(f), text_field="body", max_documents=2, cache_dir=cache)
    assert ds.column_names == ["text", "doc_id"]
    assert ds["text"] == NON_EMPTY[:2]


def test_missing_text_field_names_field_file_and_columns(tmp_path, cache):
    f = tmp_path / "docs.jsonl"
    f.write_bytes(_jsonl(DOCS))
    with pytest.raises(ValueError) as e:
        load_corpus(path=str(f), text_field="content", cache_dir=cache)
    msg = str(e.value)
    assert "'content'" in msg and "docs.jsonl" in msg and "'source'" in msg and "'text'" in msg


def test_txt_file_is_one_doc_per_line(tmp_path, cache):
    f = tmp_path / "docs.txt"
    f.write_text("\n".join(d["text"] for d in DOCS) + "\n")
    ds = load_corpus(path=str(f), cache_dir=cache)
    assert ds["text"] == NON_EMPTY
    assert ds.column_names == ["text", "doc_id"]


def test_txt_directory_and_glob_are_one_doc_per_file(tmp_path, cache):
    d = tmp_path / "txt"
    d.mkdir()
    bodies = ["line one\nline two\n", "another file\n", " \n"]
    for i, body in enumerate(bodies):
        (d / f"{i}.txt").write_text(body)
    (d / "README.md").write_text("skipped: unsupported extension")
    for path in (str(d), str(d / "*.txt")):
        ds = load_corpus(path=path, cache_dir=cache)
        assert len(ds) == 2
        assert ds[0]["text"].startswith("line one\nline two")
        assert ds[1]["text"].startswith("another file")


def test_parquet_file(tmp_path, cache):
    f = tmp_path / "docs.parquet"
    datasets.Dataset.from_list(DOCS).to_parquet(str(f))
    ds = load_corpus(path=str(f), cache_dir=cache)
    assert ds["text"] == NON_EMPTY and ds["source"] == ["a", "b", "c"]


def test_bad_paths(tmp_path, cache):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        load_corpus(path=str(tmp_path / "nothing-here" / "*.jsonl"), cache_dir=cache)
    bad = tmp_path / "docs.csv"
    bad.write_text("text\nhello\n")
    with pytest.raises(ValueError, match="docs.csv"):
        load_corpus(path=str(bad), cache_dir=cache)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text("x")
    (mixed / "b.jsonl").write_bytes(_jsonl(DOCS))
    with pytest.raises(ValueError, match="mixes file kinds"):
        load_corpus(path=str(mixed), cache_dir=cache)


@pytest.mark.parametrize("n", [0, 1, 2, 7, 100, 1001])
@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.3])
def test_assign_splits_fraction_and_determinism(n, fraction):
    split = assign_splits(n, test_fraction=fraction, seed=3)
    assert split.dtype == np.int8 and split.shape == (n,)
    assert set(np.unique(split).tolist()) <= {TRAIN, TEST}
    expected = round(n * fraction)
    if n >= 2:
        expected = max(expected, 1)
    assert int((split == TEST).sum()) == expected
    np.testing.assert_array_equal(split, assign_splits(n, test_fraction=fraction, seed=3))


def test_assign_splits_seed_matters_and_bad_fraction():
    a = assign_splits(1000, test_fraction=0.1, seed=0)
    b = assign_splits(1000, test_fraction=0.1, seed=1)
    assert not np.array_equal(a, b)
    with pytest.raises(ValueError, match="0.5"):
        assign_splits(10, test_fraction=0.5, seed=0)


def test_corpus_config_validates():
    with pytest.raises(ValueError, match="0.7"):
        CorpusConfig(test_fraction=0.7)
    with pytest.raises(ValueError, match="-1"):
        CorpusConfig(max_documents=-1)
