"""Tokenizers for the shards: train a byte-level BPE on the corpus, or load a local HF tokenizer.

A trained tokenizer is saved with ``save_pretrained`` and loads offline with
``transformers.AutoTokenizer.from_pretrained(dir)``; decoding round-trips any text exactly
(byte-level, no normalizer, no prefix space). All encoding here goes through the Rust backend
(``tokenizer.backend_tokenizer``) with ``add_special_tokens=False``: no BOS/EOS is added (the shard
builder appends EOS itself). Special-token strings that occur literally in a text (e.g.
``"<|endoftext|>"``) are matched as those special tokens, as the ``tokenizers`` library does.

CPU example::

    python -c "from sharding.tokenizer import train_tokenizer; \
t = train_tokenizer(['hello world'] * 100, vocab_size=300, out_dir='/tmp/tok'); print(len(t))"
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from sharding.sharding_config import ShardingConfig

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# Characters encoded per requested prefix token on the first try of prefix_texts: ~ a byte-level BPE's
# characters per token on English text, so most documents are settled by one try of L and 2L characters
# (32 encoded ~2,000 characters for a 32-token prefix of ~130 and made prefix_texts 2-3x slower).
_CHARS_PER_TOKEN = 4


def train_tokenizer(texts: Iterable[str], *, vocab_size: int, out_dir: str | Path,
                    max_chars: int = 0) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and save it to ``out_dir`` (``save_pretrained``).

    With ``max_chars`` > 0 a longer text is fed in pieces (``text_pieces``): the trainer's memory is
    bounded by the piece, and the counted words (hence the BPE) are the same wherever a cut falls at a space.

    The vocabulary holds the 256 byte symbols, the special tokens EOS and PAD, and merges up to
    ``vocab_size`` entries in all.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + 2:
        raise ValueError(
            f"vocab_size must be >= 258 for a byte-level BPE (256 bytes + EOS + PAD), got {vocab_size}"
        )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),
    )
    length = len(texts) if hasattr(texts, "__len__") else None
    pieces = (piece for text in texts for piece in text_pieces(text, max_chars))
    backend.train_from_iterator(pieces, trainer=trainer, length=length)
    if backend.get_vocab_size() < vocab_size:
        logger.warning(
            "BPE has %d tokens, fewer than the %d asked: small corpus", backend.get_vocab_size(), vocab_size
        )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    logger.info("trained byte-level BPE with %d tokens, saved to %s", len(tokenizer), out_dir)
    return tokenizer


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a local Hugging Face (fast) tokenizer directory; it must define an EOS token."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {path} does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {path}: {e}") from e
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"tokenizer in {path} is not a fast (Rust `tokenizers`) tokenizer; no tokenizer.json?"
        )
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer in {path} has no eos token; sharding needs one to separate documents")
    return tokenizer


def get_tokenizer(
    config: ShardingConfig, *, texts: Iterable[str], out_dir: str | Path
) -> PreTrainedTokenizerFast:
    """Load ``config.tokenizer``, or (if it is "") train a BPE on ``texts`` and save it to ``out_dir``.

    Pass the training documents only, so the test split stays unseen by the tokenizer too.
    """
    if config.tokenizer:
        return load_tokenizer(config.tokenizer)
    return train_tokenizer(texts, vocab_size=config.vocab_size, out_dir=out_dir, max_chars=config.max_encode_chars)


def vocab_size_of(tokenizer: PreTrainedTokenizerFast) -> int:
    """Number of token ids the tokenizer can produce (base vocabulary plus added tokens)."""
    return max(len(tokenizer), tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True))


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerFast) -> str:
    """sha256 of the tokenizer's JSON serialisation, stable across save/load.

    The runtime-only ``truncation`` and ``padding`` settings (which calling the HF tokenizer with
    ``truncation=True`` changes) are left out; keys are sorted.
    """
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec.pop("truncation", None)
    spec.pop("padding", None)
    blob = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _encode_ids(tokenizer: PreTrainedTokenizerFast, texts: Iterable[str]) -> list[list[int]]:
    backend = tokenizer.backend_tokenizer
    # encode_batch_fast (tokenizers >= 0.21) skips the character offsets we do not use: ~3x faster.
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [e.ids for e in encode(list(texts), add_special_tokens=False)]


def encode_batch(tokenizer: PreTrainedTokenizerFast, texts: Iterable[str], *, max_chars: int = 0) -> list[np.ndarray]:
    """Token ids (int64, no special tokens added) of each text, encoded in parallel by the backend.

    With ``max_chars`` > 0 a longer text is encoded one piece at a time (``text_pieces``) and the ids
    concatenated, so the backend never holds more than one piece's encoding of it."""
    texts = list(texts)
    out: list[np.ndarray | None] = [None] * len(texts)
    whole = [i for i, t in enumerate(texts) if not max_chars or len(t) <= max_chars]
    for i, ids in zip(whole, _encode_ids(tokenizer, [texts[i] for i in whole]), strict=True):
        out[i] = np.asarray(ids, dtype=np.int64)
    for i in (i for i, t in enumerate(texts) if max_chars and len(t) > max_chars):
        out[i] = np.concatenate([np.asarray(_encode_ids(tokenizer, [piece])[0], dtype=np.int64)
                                 for piece in text_pieces(texts[i], max_chars)])
    return out


def text_pieces(text: str, max_chars: int) -> Iterator[str]:
    """``text`` as consecutive pieces of at most ``max_chars`` characters (whole when ``max_chars`` is 0).

    Each cut is the last space in the window's second half that has a non-space character on both
    sides: the byte-level pre-tokenizer starts a pre-token at such a space and BPE merges never cross
    pre-tokens, so the pieces' tokens concatenated are exactly the text's. A window without such a
    space is cut at ``max_chars``, which changes only the tokens next to the cut.
    """
    if max_chars <= 0 or len(text) <= max_chars:
        yield text
        return
    start = 0
    while len(text) - start > max_chars:
        end = start + max_chars
        cut = text.rfind(" ", start + max_chars // 2, end)
        while cut > start and (text[cut - 1].isspace() or text[cut + 1].isspace()):
            cut = text.rfind(" ", start + max_chars // 2, cut)
        if cut <= start:
            cut = end
        yield text[start:cut]
        start = cut
    yield text[start:]


def decode_prefix(tokenizer: PreTrainedTokenizerFast, tokens: np.ndarray, n_tokens: int) -> str:
    """Text of the first ``n_tokens`` of an already tokenized document (special tokens kept)."""
    ids = [int(t) for t in np.asarray(tokens)[:n_tokens]]
    return tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=False)


def prefix_texts(tokenizer: PreTrainedTokenizerFast, texts: Iterable[str], *, n_tokens: int,
                 batch_size: int = 8192) -> list[str]:
    """Text of each document's first ``n_tokens`` tokens; equals ``decode_prefix(encode(text))``.

    Only a character prefix is encoded: ``L = 4 * n_tokens`` characters and ``2L`` characters;
    when both give the same first ``n_tokens`` tokens they are taken (cutting a text only changes
    the tokens next to the cut), otherwise ``L`` doubles until the whole text is encoded. The texts
    go to the backend ``batch_size`` at a time, so only one batch's encodings are held.
    """
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    texts = list(texts)  # a `datasets` column is slow to index one item at a time
    out: list[str] = []
    for start in range(0, len(texts), batch_size):
        out.extend(_prefix_batch(tokenizer, texts[start : start + batch_size], n_tokens=n_tokens))
    return out


def _prefix_batch(tokenizer: PreTrainedTokenizerFast, texts: list[str], *, n_tokens: int) -> list[str]:
    result: list[list[int]] = [[] for _ in texts]
    todo = list(range(len(texts)))
    n_chars = _CHARS_PER_TOKEN * n_tokens
    while todo:
        full = [i for i in todo if 2 * n_chars >= len(texts[i])]
        for i, ids in zip(full, _encode_ids(tokenizer, [texts[i] for i in full]), strict=True):
            result[i] = ids[:n_tokens]
        cut = [i for i in todo if 2 * n_chars < len(texts[i])]
        short = _encode_ids(tokenizer, [texts[i][:n_chars] for i in cut])
        longer = _encode_ids(tokenizer, [texts[i][: 2 * n_chars] for i in cut])
        todo = []
        for i, a, b in zip(cut, short, longer, strict=True):
            if len(a) > n_tokens and a[:n_tokens] == b[:n_tokens]:
                result[i] = a[:n_tokens]
            else:
                todo.append(i)
        n_chars *= 2
    return tokenizer.backend_tokenizer.decode_batch(result, skip_special_tokens=False)
