"""Prefix routing: the path a document (or a prompt) goes to, from the text of its first tokens.

    router = PrefixRouter(Router.load(run.routing), tokenizer, topology, prefix_tokens=32)
    paths = router(docs)                 # (D,) one path per tokenized document, from its first 32 tokens
    paths = router(docs, [32, 48, 64])   # each document routed from its own number of first tokens
    path = router.route_texts(["def fibonacci(n):"])[0]

The router reads text, so the tokens are decoded back (`sharding.tokenizer.decode_prefix`), as
`dipaco route` does for the training documents. The result is a path the islands trained and
evaluation loads: DiLoCo replicas of a routed path share every module, so a routed path `q` is
answered with its first replica, `topology.representative(q)` (the path itself when replicas = 1).
Evaluation, every eval mode and `dipaco generate` route through this one object.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from transformers import PreTrainedTokenizerBase

from dipaco.model.topology import Topology
from routing.router import Router
from sharding.tokenizer import decode_prefix, encode_batch

# `route(docs, n_tokens)`: a path per document from the text of its first `n_tokens[i]` tokens
RouteFn = Callable[[list[np.ndarray], Sequence[int]], np.ndarray]


class PrefixRouter:
    """Routes tokenized documents or texts by the decoded text of their first `prefix_tokens` tokens."""

    def __init__(self, router: Router, tokenizer: PreTrainedTokenizerBase, topology: Topology, *,
                 prefix_tokens: int):
        if prefix_tokens < 1:
            raise ValueError(f"prefix_tokens must be >= 1, got {prefix_tokens}")
        if math.prod(router.levels) != topology.n_routed:
            raise ValueError(f"the router picks among {math.prod(router.levels)} paths (levels {list(router.levels)}), "
                             f"but topology.levels {list(topology.levels)} give {topology.n_routed}")
        self.router = router
        self.tokenizer = tokenizer
        self.topology = topology
        self.prefix_tokens = prefix_tokens

    def __call__(self, docs: list[np.ndarray], n_tokens: Sequence[int] | None = None) -> np.ndarray:
        """The path of each document `(D,)`, from the text of its first `n_tokens[i]` tokens (default
        `prefix_tokens`; a shorter document is routed whole)."""
        if n_tokens is None:
            n_tokens = [self.prefix_tokens] * len(docs)
        if len(n_tokens) != len(docs):
            raise ValueError(f"{len(docs)} documents but {len(n_tokens)} prefix lengths")
        if not docs:
            return np.zeros(0, dtype=np.int64)
        texts = [decode_prefix(self.tokenizer, doc, n) for doc, n in zip(docs, n_tokens, strict=True)]
        return self.topology.representative(np.asarray(self.router.route(texts), dtype=np.int64))

    def shortlist(self, docs: list[np.ndarray], k: int) -> np.ndarray:
        """Each document's k best paths (D, k) by the router's cost for its first `prefix_tokens` tokens, best
        first (what `likelihood:K` chooses among; the first column is `__call__`'s path)."""
        k = min(k, self.router.n_paths)
        if not docs:
            return np.zeros((0, k), dtype=np.int64)
        return self.topology.representative(self.router.assign_topk(self.features(docs), k))

    def features(self, docs: list[np.ndarray]) -> np.ndarray:
        """The router's features (D, dim) of each document's first `prefix_tokens` tokens, decoded to text:
        what `__call__` routes by (`Router.route` = `assign(features(...))`)."""
        return self.router.features([decode_prefix(self.tokenizer, doc, self.prefix_tokens) for doc in docs])

    def route_texts(self, texts: list[str]) -> np.ndarray:
        """The path of each text `(N,)`: tokenized, then routed from its first `prefix_tokens` tokens."""
        return self(encode_batch(self.tokenizer, texts))
