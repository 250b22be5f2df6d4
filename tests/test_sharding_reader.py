"""Tests of sharding.reader: integrity checks, batch streams (determinism, coverage, resume), test docs.

Run: HF_HUB_OFFLINE=1 python -m pytest tests/test_sharding_reader.py -q
"""

from __future__ import annotations

import itertools
import json
import shutil

import numpy as np
import pytest

from sharding import ShardError, ShardingConfig, ShardReader, build_shards
from sharding.tokenizer import train_tokenizer

WORDS = "the a river stone light north cold garden 42 1999 héllo wörld 日本語 🙂".split()
N_DOCS, N_PATHS, SEQ_LEN = 400, 3, 8


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 30)))) for _ in range(N_DOCS)]
    tok = train_tokenizer(texts, vocab_size=300, out_dir=tmp_path_factory.mktemp("tok"))
    out = tmp_path_factory.mktemp("shards")
    build_shards(
        texts=texts,
        doc_ids=np.arange(N_DOCS),
        doc_paths=rng.integers(0, N_PATHS, N_DOCS),
        doc_split=(rng.random(N_DOCS) < 0.2).astype(np.int8),
        n_paths=N_PATHS,
        tokenizer=tok,
        config=ShardingConfig(seq_len=SEQ_LEN, tokens_per_shard=25 * SEQ_LEN),
        out_dir=out,
        router_fingerprint="router-abc",
        min_test_tokens=4,
    )
    return out


@pytest.fixture
def copy_dir(shard_dir, tmp_path):
    return shutil.copytree(shard_dir, tmp_path / "copy")


def rows(a: np.ndarray) -> list[bytes]:
    """The blocks of a (n, seq_len) array as a sorted multiset."""
    return sorted(r.tobytes() for r in np.ascontiguousarray(a, dtype=np.int64))


def take(it, n: int) -> np.ndarray:
    return np.stack(list(itertools.islice(it, n)))  # (n, B, seq_len)


def test_counts_and_blocks(shard_dir):
    r = ShardReader(shard_dir)
    assert (r.seq_len, r.n_paths, r.router_fingerprint) == (SEQ_LEN, N_PATHS, "router-abc")
    per_path = [r.num_blocks(p, "train") for p in range(N_PATHS)]
    assert r.num_blocks(None, "train") == sum(per_path) == r.num_tokens(None, "train") // SEQ_LEN
    assert r.num_blocks([0, 2], "val") == r.num_blocks(0, "val") + r.num_blocks(np.int64(2), "val")
    b = r.blocks([2, 0], "train")
    assert b.dtype == np.int64 and b.shape == (per_path[2] + per_path[0], SEQ_LEN)
    np.testing.assert_array_equal(b, np.concatenate([r.blocks(2, "train"), r.blocks(0, "train")]))
    assert (b < r.vocab_size).all() and (b == r.eos_token_id).any()


@pytest.mark.parametrize("path", [1, [0, 2], None])
def test_iter_batches_covers_each_block_once_per_epoch(shard_dir, path):
    r = ShardReader(shard_dir)
    total, bs = r.num_blocks(path, "train"), 7
    n_batches = -(-2 * total // bs)  # two epochs and a bit
    batches = take(r.iter_batches(path, "train", batch_size=bs, seed=3), n_batches)
    assert batches.shape == (n_batches, bs, SEQ_LEN) and batches.dtype == np.int64
    stream = batches.reshape(-1, SEQ_LEN)
    everything = rows(r.blocks(path, "train"))
    assert rows(stream[:total]) == everything
    assert rows(stream[total : 2 * total]) == everything
    assert not np.array_equal(stream[:total], stream[total : 2 * total])  # each epoch reshuffles


def test_iter_batches_is_deterministic_for_a_seed(shard_dir):
    r = ShardReader(shard_dir)
    a = take(r.iter_batches(None, "train", batch_size=5, seed=11), 40)
    b = take(ShardReader(shard_dir).iter_batches(None, "train", batch_size=5, seed=11), 40)
    c = take(r.iter_batches(None, "train", batch_size=5, seed=12), 40)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_iter_batches_mixes_paths(shard_dir):
    r = ShardReader(shard_dir)
    first = take(r.iter_batches([0, 1], "train", batch_size=16, seed=0), 1)[0]
    own = [set(map(bytes, r.blocks(p, "train").astype(np.int64))) for p in (0, 1)]
    from_path = [sum(row.tobytes() in s for row in first) for s in own]
    assert min(from_path) > 0  # one batch already holds blocks of both paths


def test_skip_batches_resumes_the_same_stream(shard_dir):
    r = ShardReader(shard_dir)
    full = take(r.iter_batches([0, 1], "train", batch_size=6, seed=5), 60)
    for skip in (0, 1, 17, 45):
        resumed = take(r.iter_batches([0, 1], "train", batch_size=6, seed=5, skip_batches=skip), 60 - skip)
        np.testing.assert_array_equal(resumed, full[skip:])


def test_unshuffled_stream_is_storage_order(shard_dir):
    r = ShardReader(shard_dir)
    total = r.num_blocks(None, "val")
    batches = take(r.iter_batches(None, "val", batch_size=1, seed=0, epoch_shuffle=False), 2 * total)
    np.testing.assert_array_equal(batches[:, 0], np.concatenate([r.blocks(None, "val")] * 2))


def test_stream_reads_one_shard_at_a_time(shard_dir, monkeypatch):
    r = ShardReader(shard_dir)
    assert len(r.index["paths"][0]["train"]["shards"]) > 2
    reads = []
    original = r.files.read_blocks
    monkeypatch.setattr(r.files, "read_blocks", lambda shard: reads.append(shard["file"]) or original(shard))
    next(r.iter_batches(0, "train", batch_size=2, seed=0))
    assert len(reads) == 1
    next(r.iter_batches(0, "train", batch_size=2, seed=0, skip_batches=30))
    assert len(reads) == 2  # skipped shards are not read


def test_test_documents(shard_dir):
    r = ShardReader(shard_dir)
    docs, ids, paths = r.test_documents()
    assert len(docs) == len(ids) == len(paths) == r.index["test"]["documents"] > 0
    assert all(4 <= len(d) <= SEQ_LEN and d.dtype == np.int64 for d in docs)
    assert ids.dtype == np.int64 and np.all(np.diff(ids) > 0) and set(paths) <= set(range(N_PATHS))


def test_flipped_byte_is_caught_naming_the_file(copy_dir):
    r = ShardReader(copy_dir)
    shard = r.index["paths"][1]["train"]["shards"][0]
    f = copy_dir / shard["file"]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=shard["file"]):
        r.blocks(1, "train")
    with pytest.raises(ShardError, match=shard["file"]):
        next(r.iter_batches(1, "train", batch_size=10_000, seed=0))
    with pytest.raises(ShardError, match=shard["file"]):
        r.verify()
    r.blocks(0, "train")  # other paths still read
    test_shard = r.index["test"]["shards"][0]
    (copy_dir / test_shard["offsets_file"]).write_bytes(b"\0")
    with pytest.raises(ShardError, match=test_shard["offsets_file"]):
        r.test_documents()


def edit_index(directory, change) -> None:
    path = directory / "index.json"
    index = json.loads(path.read_text())
    change(index)
    path.write_text(json.dumps(index))


def test_unknown_version_and_missing_fields_are_refused(copy_dir):
    edit_index(copy_dir, lambda ix: ix.update(format_version=2))
    with pytest.raises(ShardError, match=r"index.json.*format_version 2"):
        ShardReader(copy_dir)
    edit_index(copy_dir, lambda ix: ix.update(format_version=1) or ix["paths"][1]["val"].pop("shards"))
    with pytest.raises(ShardError, match=r"index.json.*paths\[1\].val.shards"):
        ShardReader(copy_dir)
    (copy_dir / "index.json").unlink()
    with pytest.raises(FileNotFoundError, match="index.json"):
        ShardReader(copy_dir)


def test_fingerprint_mismatch_is_refused(shard_dir):
    r = ShardReader(shard_dir)
    r.check_fingerprints(tokenizer=r.tokenizer_fingerprint, router="router-abc")
    r.check_fingerprints()
    with pytest.raises(ShardError, match=r"index.json.*router fingerprint router-abc.*other"):
        r.check_fingerprints(router="other")
    with pytest.raises(ShardError, match="index.json.*tokenizer"):
        r.check_fingerprints(tokenizer="0" * 64)


def test_bad_arguments(shard_dir):
    r = ShardReader(shard_dir)
    with pytest.raises(ValueError, match="path 3"):
        r.num_blocks(3, "train")
    with pytest.raises(ValueError, match="repeats"):
        r.blocks([0, 0], "train")
    with pytest.raises(ValueError, match="'test'"):
        r.blocks(0, "test")
    with pytest.raises(ValueError, match="batch_size"):
        r.iter_batches(0, "train", batch_size=0, seed=0)
