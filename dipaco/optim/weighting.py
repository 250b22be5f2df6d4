"""How much each result weighs in a module's outer step (`outer.weighting`, `outer.normalize`).

For the results applied to module m this round, `combine_streamed` adds each result r of path p with
factor W_p × f_r / Z. A path carries one weight however many results it brought (async: the results of
one path in one round are consecutive pieces of its training, each the progress of its own steps):

    W_p = |D_p| × min(1, tokens p trained / tokens asked)    outer.weighting: shard (the paper's)
    W_p = tokens p trained                                   outer.weighting: tokens
    W_p = 1                                                  outer.weighting: uniform
    Z   = Σ_{paths q reporting to m} W_q                     outer.normalize: module
    Z   = Σ_{q ∈ all paths} W_q at full weight (whole task)  outer.normalize: all

|D_p| is the number of tokens in path p's training shard (`dipaco shard` writes it to
shards/index.json), f_r the result's async staleness factor (1 in sync mode); Z leaves the factors out,
so a stale result is discounted even when it is the only one a module gets. A result cut short weighs
by the tokens it trained. With DiLoCo replicas each
replica is a path of its own whose shard holds its random share of the routed path's documents
(`dipaco route`), so its |D_p| is that share. With `module`, the weights of the results a module got
sum to 1 (a weighted average); with `all` they sum to the share of the whole data those results
stand for: a level module shared by 2 of 4 equal paths gets Σ α = 0.5, a module of every path 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from dipaco.config import OuterConfig


class Weighed(Protocol):
    """What a result's weight depends on (a `RoundPlan` contribution or a `ManifestEntry`)."""

    path: int  # the path that trained it
    tokens: int  # the tokens it trained
    factor: float  # its staleness factor (1 in sync mode)


@dataclass(frozen=True)
class PathSizes:
    """What the weights are made of besides the results: each path's |D_p| and a whole task's tokens."""

    shard_tokens: tuple[int, ...]  # training tokens in each path's shard, indexed by path
    task_tokens: int  # tokens one task asks for: inner.steps × inner.batch_size × sharding.seq_len

    def __post_init__(self) -> None:
        if not self.shard_tokens or any(n <= 0 for n in self.shard_tokens):
            raise ValueError(f"every path's training shard must hold tokens, got {list(self.shard_tokens)}")
        if self.task_tokens <= 0:
            raise ValueError(f"a task must ask for tokens, got {self.task_tokens}")


def needs_sizes(config: OuterConfig) -> bool:
    """Whether `config` weights results by anything the results alone do not say."""
    return config.weighting == "shard" or (config.normalize == "all" and config.weighting == "tokens")


def result_weights(entries: Sequence[Weighed], *, n_paths: int, sizes: PathSizes | None,
                   config: OuterConfig) -> tuple[list[float], float]:
    """(W_p × f_r for each of `entries`, the results applied to one module, and the Z they are divided by)."""
    if needs_sizes(config):
        if sizes is None:
            raise ValueError(f"outer.weighting {config.weighting!r} with outer.normalize {config.normalize!r} "
                             f"needs each path's shard size: pass the run's PathSizes")
        if len(sizes.shard_tokens) != n_paths:
            raise ValueError(f"{len(sizes.shard_tokens)} shard sizes for a grid of {n_paths} paths")
    trained: dict[int, int] = {}  # path -> its tokens in these results, in the order the paths first appear
    for entry in entries:
        trained[entry.path] = trained.get(entry.path, 0) + entry.tokens
    path_weight = {p: _weight(p, tokens, sizes=sizes, weighting=config.weighting) for p, tokens in trained.items()}
    weights = [path_weight[entry.path] * entry.factor for entry in entries]
    if config.normalize == "module":
        return weights, sum(path_weight.values())
    return weights, sum(_full_weight(path, sizes=sizes, weighting=config.weighting) for path in range(n_paths))


def _weight(path: int, tokens: int, *, sizes: PathSizes | None, weighting: str) -> float:
    if weighting == "uniform":
        return 1.0
    if weighting == "tokens":
        return float(tokens)
    assert sizes is not None
    trained = min(1.0, tokens / sizes.task_tokens)
    return float(sizes.shard_tokens[path]) * trained


def _full_weight(path: int, *, sizes: PathSizes | None, weighting: str) -> float:
    if weighting == "uniform":
        return 1.0
    assert sizes is not None
    return float(sizes.task_tokens if weighting == "tokens" else sizes.shard_tokens[path])
