"""Top-k overlapping training shards and the router split: each training document lands in exactly k
paths, each evaluation document in one, router-split documents in none.

python -m pytest tests/test_routing_overlap.py -q
"""

import numpy as np
import pytest

from routing import Assignments
from routing.corpus import ROUTER, TEST, TRAIN, assign_splits
from sharding import ShardingConfig, ShardReader, build_shards
from sharding.tokenizer import encode_batch, train_tokenizer

WORDS = "the a river stone light north cold garden 42 1999 field winter sea".split()
N, PATHS, K, SEQ = 240, 4, 2, 16


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(8, 30)))) for _ in range(N)]
    tok = train_tokenizer(texts, vocab_size=300, out_dir=tmp_path_factory.mktemp("tok"))
    split = assign_splits(N, test_fraction=0.2, seed=0, router_fraction=0.1)
    topk = np.full((N, K), -1, dtype=np.int64)
    train = split == TRAIN
    topk[train] = np.stack([rng.permutation(PATHS)[:K] for _ in range(int(train.sum()))])
    path = np.where(train, topk[:, 0], rng.integers(0, PATHS, N))
    a = Assignments(path=path, split=split, levels=[2, 2], router_fingerprint="r", topk=topk)
    out = tmp_path_factory.mktemp("shards")
    index = build_shards(texts=texts, doc_ids=np.arange(N), doc_paths=np.where(split[:, None] == TRAIN, a.train_paths(), np.c_[path, np.full((N, K - 1), -1)]),
                         doc_split=split, n_paths=PATHS, tokenizer=tok,
                         config=ShardingConfig(seq_len=SEQ, tokens_per_shard=4 * SEQ, val_fraction=0.1),
                         out_dir=out, router_fingerprint="r", min_test_tokens=2)
    return texts, tok, split, topk, path, a, index, out


def test_router_split_is_disjoint_and_test_split_unchanged():
    plain = assign_splits(1000, test_fraction=0.1, seed=3)
    with_router = assign_splits(1000, test_fraction=0.1, seed=3, router_fraction=0.2)
    np.testing.assert_array_equal(plain == TEST, with_router == TEST)
    assert (with_router == ROUTER).sum() == 200


def test_each_training_doc_in_exactly_k_paths(built):
    texts, tok, split, topk, path, a, index, out = built
    train = np.flatnonzero(split == TRAIN)
    docs = [index["paths"][p]["train"]["documents"] for p in range(PATHS)]
    assert sum(docs) == K * len(train)
    for p in range(PATHS):
        assert docs[p] == int((topk[train] == p).any(axis=1).sum())
    # the tokens of each path are its documents' tokens (+ EOS), in document order
    eos = tok.eos_token_id
    ids = encode_batch(tok, texts)
    reader = ShardReader(out)
    for p in range(PATHS):
        members = [i for i in train if p in topk[i]]
        stream = np.concatenate([np.append(ids[i], eos) for i in members])
        got = np.concatenate([reader.blocks(p, "train").ravel(), reader.blocks(p, "val").ravel()])
        assert len(got) == len(stream) // SEQ * SEQ
        assert sorted(got.tolist()) == sorted(stream[: len(got)].tolist())


def test_eval_docs_once_router_docs_never(built):
    texts, tok, split, topk, path, a, index, out = built
    docs, doc_ids, paths = ShardReader(out).test_documents()
    assert sorted(doc_ids.tolist()) == np.flatnonzero(split == TEST).tolist()
    np.testing.assert_array_equal(paths, path[doc_ids])
    assert index["test"]["documents"] == (split == TEST).sum()


def test_assignments_round_trip_topk(built, tmp_path):
    a = built[5]
    a.save(tmp_path)
    b = Assignments.load(tmp_path)
    np.testing.assert_array_equal(b.topk, a.topk)
    np.testing.assert_array_equal(b.train_paths(), a.topk)
    with pytest.raises(ValueError, match="topk"):
        Assignments(path=a.path, split=a.split, levels=[2, 2], router_fingerprint="r", topk=a.topk[:, ::-1])
