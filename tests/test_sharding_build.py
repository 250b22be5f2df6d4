"""Tests of sharding.build: exact round trip of the packed blocks, splits, test documents, failures.

Run: HF_HUB_OFFLINE=1 python -m pytest tests/test_sharding_build.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from sharding import FORMAT_VERSION, ShardingConfig, ShardReader, build_shards
from sharding.__main__ import main as cli_main
from sharding.build import choose_val_blocks
from sharding.format import ShardError, read_array, token_dtype_for, write_array
from sharding.tokenizer import encode_batch, tokenizer_fingerprint, train_tokenizer

WORDS = "the a river stone light north cold garden 42 1999 héllo wörld 日本語 🙂".split()
N_DOCS, N_PATHS, SEQ_LEN = 300, 3, 16


def make_texts(n: int, *, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 40)))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    texts = make_texts(N_DOCS)
    tok = train_tokenizer(texts, vocab_size=300, out_dir=tmp_path_factory.mktemp("tok"))
    rng = np.random.default_rng(1)
    return {
        "texts": texts,
        "doc_ids": np.arange(N_DOCS, dtype=np.int64) * 10 + 7,
        "doc_paths": rng.integers(0, N_PATHS, N_DOCS).astype(np.int64),
        "doc_split": (rng.random(N_DOCS) < 0.25).astype(np.int8),
        "tokenizer": tok,
    }


def build(corpus, out_dir, **overrides):
    config = ShardingConfig(seq_len=SEQ_LEN, tokens_per_shard=4 * SEQ_LEN, val_fraction=0.1)
    kwargs = dict(corpus, n_paths=N_PATHS, config=config, router_fingerprint="router-1", min_test_tokens=4)
    return build_shards(**{**kwargs, "out_dir": out_dir, **overrides})


@pytest.fixture(scope="module")
def built(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    return build(corpus, out), out


def test_train_and_val_blocks_round_trip_exactly(corpus, built):
    index, out = built
    reader = ShardReader(out)
    eos = corpus["tokenizer"].eos_token_id
    all_ids = encode_batch(corpus["tokenizer"], corpus["texts"])
    for p in range(N_PATHS):
        docs = np.flatnonzero((corpus["doc_paths"] == p) & (corpus["doc_split"] == 0))
        stream = np.concatenate([np.append(all_ids[i], eos) for i in docs])  # document order
        n_blocks = len(stream) // SEQ_LEN
        entry = index["paths"][p]
        assert entry["dropped_tokens"] == len(stream) - n_blocks * SEQ_LEN
        assert entry["train"]["documents"] == len(docs)
        is_val = choose_val_blocks(n_blocks, val_fraction=0.1, seed=0, path=p)
        assert is_val.sum() == max(1, round(0.1 * n_blocks)) == entry["val"]["blocks"]
        merged = np.empty((n_blocks, SEQ_LEN), dtype=np.int64)
        merged[~is_val] = reader.blocks(p, "train")
        merged[is_val] = reader.blocks(p, "val")
        np.testing.assert_array_equal(merged.ravel(), stream[: n_blocks * SEQ_LEN])


def test_shards_are_block_aligned_and_bounded(built):
    index, out = built
    for entry in index["paths"]:
        for split in ("train", "val"):
            shards = entry[split]["shards"]
            assert sum(s["blocks"] for s in shards) == entry[split]["blocks"]
            assert all(1 <= s["blocks"] <= 4 and s["tokens"] == s["blocks"] * SEQ_LEN for s in shards)
            assert all((out / s["file"]).stat().st_size == s["bytes"] for s in shards)
    assert len(index["paths"][0]["train"]["shards"]) > 1
    assert (out / "path-0000/train-00000.tok.zst").is_file()


def test_index_describes_the_build(corpus, built):
    index, out = built
    on_disk = json.loads((out / "index.json").read_text())
    assert on_disk == index
    assert index["format_version"] == FORMAT_VERSION
    assert index["token_dtype"] == "uint16" and index["vocab_size"] == 300
    assert index["eos_token_id"] == corpus["tokenizer"].eos_token_id
    assert index["tokenizer_fingerprint"] == tokenizer_fingerprint(corpus["tokenizer"])
    assert index["router_fingerprint"] == "router-1"
    assert not (out / ".staging").exists()
    reloaded = ShardReader(out).load_tokenizer()  # saved copy, fingerprint checked
    assert tokenizer_fingerprint(reloaded) == index["tokenizer_fingerprint"]


def test_test_documents_are_truncated_and_short_ones_counted(corpus, built):
    index, out = built
    docs, ids, paths = ShardReader(out).test_documents()
    test = np.flatnonzero(corpus["doc_split"] == 1)
    test_ids = encode_batch(corpus["tokenizer"], [corpus["texts"][i] for i in test])
    lengths = {i: len(a) for i, a in zip(test, test_ids, strict=True)}
    kept = [i for i in test if lengths[i] >= 4]
    assert index["test"]["too_short"] == len(test) - len(kept) > 0
    assert index["test"]["truncated"] == sum(lengths[i] > SEQ_LEN for i in kept) > 0
    np.testing.assert_array_equal(ids, corpus["doc_ids"][kept])
    np.testing.assert_array_equal(paths, corpus["doc_paths"][kept])
    expected = encode_batch(corpus["tokenizer"], [corpus["texts"][i] for i in kept])
    assert [d.tolist() for d in docs] == [e[:SEQ_LEN].tolist() for e in expected]
    assert index["test"]["documents"] == len(kept) and index["test"]["tokens"] == sum(len(d) for d in docs)


def test_failed_build_leaves_no_index_and_no_files(corpus, tmp_path):
    paths = corpus["doc_paths"].copy()
    paths[paths == 1] = 0  # path 1 gets no documents
    out = tmp_path / "shards"
    with pytest.raises(ValueError, match=r"path 1: 0 tokens"):
        build(corpus, out, doc_paths=paths)
    assert not (out / "index.json").exists()
    assert [p for p in out.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize("where", ["split", "index"])
def test_crash_late_in_the_build_removes_its_files(corpus, tmp_path, monkeypatch, where):
    import sharding.build

    def fail(*args, **kwargs):
        raise OSError("disk full")

    if where == "split":  # path 0 is written, path 1 fails
        real = sharding.build.choose_val_blocks
        monkeypatch.setattr(
            sharding.build, "choose_val_blocks", lambda n, **kw: fail() if kw["path"] == 1 else real(n, **kw)
        )
    else:
        monkeypatch.setattr(sharding.build, "write_json", fail)
    out = tmp_path / "shards"
    with pytest.raises(OSError, match="disk full"):
        build(corpus, out)
    assert not (out / "index.json").exists()
    assert [p for p in out.rglob("*.zst")] == []


def test_small_path_error_lists_every_small_path(corpus, tmp_path):
    lengths = np.array([len(t) for t in encode_batch(corpus["tokenizer"], corpus["texts"])])
    short_train = np.flatnonzero((lengths < SEQ_LEN) & (corpus["doc_split"] == 0))[0]
    paths = np.zeros(N_DOCS, np.int64)
    paths[short_train] = 1  # path 1: one short document, < 2 blocks; path 2: nothing
    with pytest.raises(ValueError, match=r"2 path\(s\).*path 1: \d+ tokens, path 2: 0 tokens"):
        build(corpus, tmp_path / "s", doc_paths=paths)


def test_existing_index_is_refused_unless_overwrite(corpus, tmp_path):
    out = tmp_path / "shards"
    build(corpus, out)
    with pytest.raises(FileExistsError, match="index.json"):
        build(corpus, out)
    config = ShardingConfig(seq_len=2 * SEQ_LEN, tokens_per_shard=1 << 12)
    index = build(corpus, out, overwrite=True, config=config)
    assert index["seq_len"] == 2 * SEQ_LEN
    files = {p.relative_to(out).as_posix() for p in out.rglob("*.zst")}
    listed = {s["file"] for e in index["paths"] for sp in ("train", "val") for s in e[sp]["shards"]}
    keys = ("file", "offsets_file", "doc_ids_file", "paths_file")
    listed |= {s[k] for s in index["test"]["shards"] for k in keys}
    assert files == listed  # the old build's shards are gone


def test_texts_may_be_an_iterator_or_a_datasets_column(corpus, built, tmp_path):
    datasets = pytest.importorskip("datasets")
    index, _ = built
    column = datasets.Dataset.from_dict({"text": corpus["texts"]})["text"]
    from_column = build(corpus, tmp_path / "a", texts=column)
    from_gen = build(corpus, tmp_path / "b", texts=(t for t in corpus["texts"]))
    for other in (from_column, from_gen):
        assert [e["train"] for e in other["paths"]] == [e["train"] for e in index["paths"]]
    with pytest.raises(ValueError, match="texts ended after 299"):
        build(corpus, tmp_path / "c", texts=iter(corpus["texts"][:-1]))


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("doc_split", np.full(N_DOCS, 3, np.int8), "doc_split"),
        ("doc_paths", np.full(N_DOCS, N_PATHS), "path 3"),
        ("doc_ids", np.zeros(N_DOCS, np.int64), "unique"),
        ("doc_ids", np.arange(5), "lengths"),
        ("texts", ["x"] * 3, "lengths"),
    ],
)
def test_bad_inputs_are_refused(corpus, tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        build(corpus, tmp_path / "s", **{field: value})
    assert not (tmp_path / "s" / "index.json").exists()


def test_format_helpers(tmp_path):
    assert token_dtype_for(65536) == "uint16" and token_dtype_for(65537) == "uint32"
    a = np.array([0, 1, 65535], dtype=np.uint16)
    rec = write_array(tmp_path / "a.zst", a)
    np.testing.assert_array_equal(read_array(tmp_path / "a.zst", dtype="uint16", sha256=rec["sha256"]), a)
    assert rec["bytes"] == (tmp_path / "a.zst").stat().st_size
    garbage = tmp_path / "g.zst"
    garbage.write_bytes(b"not zstd at all")
    import hashlib

    with pytest.raises(ShardError, match="g.zst.*zstd"):
        read_array(garbage, dtype="uint16", sha256=hashlib.sha256(b"not zstd at all").hexdigest())
    with pytest.raises(ShardError, match="a.zst.*3 items"):
        read_array(tmp_path / "a.zst", dtype="uint16", sha256=rec["sha256"], length=4)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_cli_info_prints_the_table(built, capsys):
    _, out = built
    assert cli_main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "train blocks" in text and "test:" in text
    assert len([line for line in text.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"])]) == N_PATHS
    assert cli_main(["verify", str(out)]) == 0
    assert cli_main(["info", str(out / "nope")]) == 1


def test_an_edited_old_index_cannot_make_overwrite_delete_files_outside_the_shards(corpus, tmp_path):
    """Issue 13 item 1: only files dipaco wrote, inside the shard directory, are removed on overwrite."""
    out = tmp_path / "shards"
    build(corpus, out)
    precious = tmp_path / "precious.txt"
    precious.write_text("mine")
    index = json.loads((out / "index.json").read_text())
    index["paths"][0]["train"]["shards"][0]["file"] = "../precious.txt"
    (out / "index.json").write_text(json.dumps(index))
    build(corpus, out, overwrite=True)
    assert precious.read_text() == "mine"


def test_an_overwrite_that_fails_leaves_the_old_shards_as_they_were(corpus, tmp_path):
    """A re-routing that leaves a path without 2 blocks is refused by the build, and the shards it would have
    replaced still read: the old index and every file it names are byte for byte as before, no sibling build
    directory is left; the same overwrite with a routing that fits replaces them."""
    out = tmp_path / "shards"
    build(corpus, out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    empty = corpus["doc_paths"].copy()
    empty[empty == 2] = 1  # path 2 gets no document
    with pytest.raises(ValueError, match="path 2: 0 tokens"):
        build(corpus, out, doc_paths=empty, overwrite=True)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]
    reader = ShardReader(out)
    assert reader.index["router_fingerprint"] == "router-1" and len(reader.test_documents()[0]) > 0
    index = build(corpus, out, overwrite=True, router_fingerprint="router-2")
    assert json.loads((out / "index.json").read_text()) == index and index["router_fingerprint"] == "router-2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]
