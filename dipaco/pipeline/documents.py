"""What route, shard, pretrain and reroute read alike: the corpus, its splits, the run's tokenizer, and
every document's prefix features and path.

    dataset = load_run_corpus(config.corpus); split = run_splits(config.corpus, len(dataset))
    tokenizer = run_tokenizer(config.sharding, run, train_texts)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np

from dipaco.atomic import replacing
from dipaco.run_dir import RunDir
from routing.corpus import TRAIN, assign_splits, load_corpus
from routing.router import Router
from routing.routing_config import CorpusConfig
from sharding.sharding_config import ShardingConfig
from sharding.tokenizer import load_tokenizer, train_tokenizer

log = logging.getLogger(__name__)


def corpus_location(corpus: CorpusConfig) -> str:
    """The corpus path, with `demo` meaning the corpus bundled with dipaco."""
    if corpus.path == "demo":
        from dipaco.data import demo_corpus_path

        return str(demo_corpus_path())
    return corpus.path


def load_run_corpus(corpus: CorpusConfig):
    """The run's documents (a `datasets.Dataset` with `text`, `doc_id` and maybe `source`)."""
    return load_corpus(path=corpus_location(corpus), text_field=corpus.text_field, split=corpus.split,
                       max_documents=corpus.max_documents)


def run_splits(corpus: CorpusConfig, n: int) -> np.ndarray:
    """The train / test / router split of each of `n` documents (seeded by `corpus.seed`)."""
    return assign_splits(n, test_fraction=corpus.test_fraction, seed=corpus.seed,
                         router_fraction=corpus.router_fraction)


def stream_features(featurizer, prefixes: list[str], out, *, batch_size: int = 8192) -> np.ndarray:
    """Featurize in batches with a fitted featurizer (a router's `.featurizer`) into a memory-mapped
    float32 .npy at `out` (atomically); returns the (read-only) map."""
    from tqdm.auto import tqdm

    with replacing(out) as tmp:
        features = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32,
                                             shape=(len(prefixes), featurizer.dim))
        for start in tqdm(range(0, len(prefixes), batch_size), desc=f"featurize ({featurizer.name})",
                          unit="batch", disable=None):
            features[start : start + batch_size] = featurizer.transform(prefixes[start : start + batch_size])
        features.flush()
        del features
    return np.load(out, mmap_mode="r")


def assign_all(router: Router, features: np.ndarray, split: np.ndarray, *, top_k: int,
               batch_size: int = 65536) -> tuple[np.ndarray, np.ndarray | None]:
    """Every document's path (batched), and the (N, k) training paths when k > 1 or balance is on."""
    paths = np.concatenate([router.assign(np.asarray(features[s : s + batch_size]))
                            for s in range(0, len(features), batch_size)]) if len(features) else np.zeros(0, np.int64)
    if top_k == 1 and not (router.config.balance and router.linear is None):
        return paths, None
    train = np.flatnonzero(split == TRAIN)
    topk = np.full((len(paths), top_k), -1, dtype=np.int64)
    topk[train] = router.assign_train(np.asarray(features[train]), k=top_k)
    paths[train] = topk[train, 0]
    return paths, (topk if top_k > 1 else None)


def run_tokenizer(sharding: ShardingConfig, run: RunDir, train_texts: Iterable[str]):
    """The configured tokenizer (copied into the run), the run's own, or a BPE trained on `train_texts`
    (a list, or an iterator that is read only when a BPE is trained)."""
    if sharding.tokenizer:
        tokenizer = load_tokenizer(sharding.tokenizer)
        tokenizer.save_pretrained(run.tokenizer)  # the run keeps its own copy
        return tokenizer
    if (run.tokenizer / "tokenizer.json").exists():
        log.info("reusing the tokenizer in %s", run.tokenizer)
        return load_tokenizer(run.tokenizer)
    log.info("training a %d-token byte-level BPE on the %s training documents", sharding.vocab_size,
             len(train_texts) if hasattr(train_texts, "__len__") else "streamed")
    return train_tokenizer(train_texts, vocab_size=sharding.vocab_size, out_dir=run.tokenizer,
                           max_chars=sharding.max_encode_chars)
