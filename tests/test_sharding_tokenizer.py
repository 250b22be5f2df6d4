"""Tests of sharding.tokenizer and sharding.sharding_config: BPE training, save/load, fingerprints, prefixes.

Run: HF_HUB_OFFLINE=1 python -m pytest tests/test_sharding_tokenizer.py -q
"""

from __future__ import annotations

import numpy as np
import pytest

from sharding.sharding_config import ShardingConfig
from sharding.tokenizer import (
    EOS_TOKEN,
    PAD_TOKEN,
    decode_prefix,
    encode_batch,
    get_tokenizer,
    load_tokenizer,
    prefix_texts,
    text_pieces,
    tokenizer_fingerprint,
    train_tokenizer,
)

WORDS = "the a river stone light north cold garden 42 1999 héllo wörld naïve 日本語 🙂 —".split()


def make_texts(n: int, *, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 60)))) + ".\n" for _ in range(n)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    return train_tokenizer(make_texts(300), vocab_size=300, out_dir=out), out


def test_train_save_reload_offline(trained):
    from transformers import AutoTokenizer

    tok, out = trained
    assert len(tok) == 300
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN
    reloaded = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert tokenizer_fingerprint(reloaded) == tokenizer_fingerprint(tok)
    assert reloaded.eos_token_id == tok.eos_token_id
    texts = make_texts(20, seed=1)
    for a, b in zip(encode_batch(reloaded, texts), encode_batch(tok, texts), strict=True):
        np.testing.assert_array_equal(a, b)
    assert tokenizer_fingerprint(load_tokenizer(out)) == tokenizer_fingerprint(tok)


def test_decode_round_trip_is_exact(trained):
    tok, _ = trained
    texts = [
        "  leading and trailing spaces  ",
        "tabs\tand\nnew\r\nlines\n\n",
        "unicode: ünïcödé 日本語 Ελληνικά עברית 🙂🚀 e\u0301 (combining) \u200b zero width",
        "unseen bytes: \x00\x01 ~`|{}",
        f"a literal {EOS_TOKEN} inside",
        "",
    ]
    for text, ids in zip(texts, encode_batch(tok, texts), strict=True):
        assert ids.dtype == np.int64
        assert tok.backend_tokenizer.decode(ids.tolist(), skip_special_tokens=False) == text
        assert decode_prefix(tok, ids, len(ids)) == text


def test_encode_batch_adds_no_special_tokens(trained):
    tok, _ = trained
    (ids,) = encode_batch(tok, ["the river"])
    assert tok.eos_token_id not in ids.tolist()
    assert ids.tolist() == tok.backend_tokenizer.encode("the river", add_special_tokens=False).ids


def test_fingerprint_ignores_runtime_truncation(trained):
    tok, _ = trained
    before = tokenizer_fingerprint(tok)
    tok.backend_tokenizer.enable_truncation(max_length=7)
    try:
        assert tokenizer_fingerprint(tok) == before
    finally:
        tok.backend_tokenizer.no_truncation()


def test_prefix_texts_agrees_with_decode_prefix(trained):
    tok, _ = trained
    texts = make_texts(50, seed=2)
    texts += [
        "x" * 5000,  # one long pre-token: the cut changes the tokens near it, so L must grow
        "   " * 400 + "end",
        "short",
        "",
        "日本語" * 700,
    ]
    for n in (1, 5, 16, 40):
        expected = [decode_prefix(tok, ids, n) for ids in encode_batch(tok, texts)]
        assert prefix_texts(tok, texts, n_tokens=n) == expected
        assert prefix_texts(tok, texts, n_tokens=n, batch_size=7) == expected  # in batches, same order


def test_prefix_texts_encodes_a_short_character_prefix_of_long_documents(trained, monkeypatch):
    """Words of ~4 characters: one try (L = 4 * n_tokens and 2L characters) settles each document, so a
    2,000-character document costs ~12 * n_tokens encoded characters, not the whole text."""
    import sharding.tokenizer

    tok, _ = trained
    texts = [("river stone light north cold garden " * 60)[:2000] + f" {i}" for i in range(20)]
    texts.append("pre <|endoftext|> post " * 100)  # a special token's string near the first cut
    encoded: list[int] = []
    real = sharding.tokenizer._encode_ids

    def counting(tokenizer, batch):
        batch = list(batch)
        encoded.extend(len(t) for t in batch)
        return real(tokenizer, batch)

    monkeypatch.setattr(sharding.tokenizer, "_encode_ids", counting)
    n = 16
    got = prefix_texts(tok, texts, n_tokens=n)
    assert got == [decode_prefix(tok, ids, n) for ids in encode_batch(tok, texts)]
    assert sum(encoded) - sum(len(t) for t in texts) <= 3 * 4 * n * len(texts)  # encode_batch's own calls


def test_prefix_texts_retries_with_longer_prefixes(trained, monkeypatch):
    import sharding.tokenizer

    tok, _ = trained
    texts = make_texts(20, seed=3)
    expected = prefix_texts(tok, texts, n_tokens=12)
    monkeypatch.setattr(sharding.tokenizer, "_CHARS_PER_TOKEN", 1)  # first cut always too short
    assert prefix_texts(tok, texts, n_tokens=12) == expected


def test_load_tokenizer_errors_name_the_path(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(missing)
    no_eos = tmp_path / "no_eos"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE())).save_pretrained(str(no_eos))
    with pytest.raises(ValueError, match="no_eos.*no eos"):
        load_tokenizer(no_eos)


def test_train_tokenizer_rejects_tiny_vocab(tmp_path):
    with pytest.raises(ValueError, match="257"):
        train_tokenizer(["abc"], vocab_size=257, out_dir=tmp_path)


def test_get_tokenizer_trains_or_loads(tmp_path, trained):
    tok, out = trained
    loaded = get_tokenizer(ShardingConfig(tokenizer=str(out)), texts=[], out_dir=tmp_path / "unused")
    assert tokenizer_fingerprint(loaded) == tokenizer_fingerprint(tok)
    fresh = get_tokenizer(ShardingConfig(vocab_size=280), texts=make_texts(50), out_dir=tmp_path / "new")
    assert len(fresh) == 280 and (tmp_path / "new" / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    "kwargs, bad",
    [
        ({"vocab_size": 100}, "100"),
        ({"seq_len": 1}, "seq_len"),
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"val_fraction": 1.5}, "1.5"),
        ({"seq_len": 64, "tokens_per_shard": 10}, "tokens_per_shard"),
        ({"seed": -1}, "-1"),
        ({"tokenizer": None}, "tokenizer"),
    ],
)
def test_config_validation_names_the_value(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        ShardingConfig(**kwargs)


@pytest.mark.parametrize("max_chars", [24, 40, 333])
def test_long_texts_are_encoded_in_pieces_to_exactly_the_same_tokens(trained, max_chars):
    """`sharding.max_encode_chars` (issue 13, item 9): pieces cut at a space between two words."""
    tok, _ = trained
    texts = make_texts(20, seed=3) + ["  two  spaces\n\nand   more " * 30, "x" * 5]
    pieces = [list(text_pieces(t, max_chars)) for t in texts]
    assert all("".join(p) == t and all(len(x) <= max_chars for x in p) for p, t in zip(pieces, texts))
    assert any(len(p) > 1 for p in pieces)
    whole, cut = encode_batch(tok, texts), encode_batch(tok, texts, max_chars=max_chars)
    assert all(np.array_equal(a, b) for a, b in zip(whole, cut))


def test_a_window_without_a_space_is_cut_hard_and_loses_no_text():
    assert list(text_pieces("a" * 10, 4)) == ["aaaa", "aaaa", "aa"]
    assert list(text_pieces("abc def", 0)) == ["abc def"]


def test_a_tokenizer_trained_on_pieces_is_the_one_trained_on_whole_texts(tmp_path):
    texts = make_texts(200, seed=5)
    long = [" ".join(texts)]  # one long document
    whole = train_tokenizer(long, vocab_size=300, out_dir=tmp_path / "whole")
    pieces = train_tokenizer(long, vocab_size=300, out_dir=tmp_path / "pieces", max_chars=500)
    assert tokenizer_fingerprint(whole) == tokenizer_fingerprint(pieces)


def test_max_encode_chars_must_not_be_negative():
    with pytest.raises(ValueError, match="sharding.max_encode_chars"):
        ShardingConfig(max_encode_chars=-1)
