"""The bundled demo corpus loads through HF datasets like a user corpus and is what CORPUS.md says.

Run: python -m pytest tests/test_demo_corpus.py -q
"""

import collections
import re
from pathlib import Path

import pytest

from dipaco.data import demo_corpus_path

MIN_CHARS, MAX_CHARS = 200, 3000  # the bounds scripts/build_corpus.py cuts documents to
MAX_BYTES = 10_000_000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory):
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    mp.setenv("HF_HUB_OFFLINE", "1")
    import datasets

    cache = tmp_path_factory.mktemp("hf_cache")
    ds = datasets.load_dataset(
        "json", data_files=str(demo_corpus_path()), split="train", cache_dir=str(cache)
    )
    yield ds
    mp.undo()


def sources_in_corpus_md() -> dict[str, int]:
    """{source: document count} from the table in CORPUS.md."""
    md = (demo_corpus_path().parent / "CORPUS.md").read_text()
    return {
        name: int(n.replace(",", ""))
        for name, n in re.findall(r"^\| `([\w-]+)` \| [^|]+ \| ([\d,]+) \|", md, re.M)
    }


def test_file_is_small_enough():
    assert demo_corpus_path().stat().st_size <= MAX_BYTES


def test_missing_corpus_names_the_path_and_make_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import dipaco.data

    monkeypatch.setattr(dipaco.data, "__file__", str(tmp_path / "__init__.py"))
    with pytest.raises(FileNotFoundError, match=r"demo_corpus\.jsonl\.zst.*make corpus"):
        dipaco.data.demo_corpus_path()


def test_columns_and_sources(corpus):
    assert corpus.column_names == ["text", "source"]
    counts = collections.Counter(corpus["source"])
    assert len(counts) >= 3, counts
    assert counts == sources_in_corpus_md()
    for name, n in counts.items():
        assert n >= 0.15 * len(corpus), f"source {name} has only {n} of {len(corpus)} documents"


def test_documents_are_non_empty_and_within_bounds(corpus):
    lengths = [len(t) for t in corpus["text"]]
    short = [n for n in lengths if n < MIN_CHARS]
    long = [n for n in lengths if n > MAX_CHARS]
    assert not short and not long, f"{len(short)} documents < {MIN_CHARS} chars, {len(long)} > {MAX_CHARS}"
    assert all(t.strip() for t in corpus["text"])
    assert all(isinstance(s, str) and s for s in corpus["source"])


def test_sources_are_interleaved(corpus):
    first = corpus[:300]["source"]
    assert len(set(first)) == len(set(corpus["source"])), "documents are not shuffled across sources"


def test_a_licence_file_for_each_source(corpus):
    licences = demo_corpus_path().parent / "LICENSES"
    for name in set(corpus["source"]):
        path = licences / f"{name}.txt"
        assert path.is_file(), f"no licence file {path}"
        assert path.stat().st_size > 500, f"{path} looks empty"
