"""How much each result weighs in a module's outer step (`outer.weighting`, `outer.normalize`).

For the results R(m) applied to module m this round, `combine_streamed` adds Δ_p with factor w_p / Z:

    w_p = |D_p| × min(1, tokens trained / tokens asked) × f_p     outer.weighting: shard (the paper's)
    w_p = tokens trained × f_p                                    outer.weighting: tokens
    w_p = f_p                                                     outer.weighting: uniform
    Z   = Σ_{q ∈ R(m)} w_q                                        outer.normalize: module
    Z   = Σ_{q ∈ all paths} w_q at full weight (f = 1, whole task) outer.normalize: all

|D_p| is the number of tokens in path p's training shard (`dipaco shard` writes it to
shards/index.json), f_p the async staleness factor (1 in sync mode). With DiLoCo replicas each
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
    """(w_p for each of `entries`, the results applied to one module, and the Z they are divided by)."""
    if needs_sizes(config):
        if sizes is None:
            raise ValueError(f"outer.weighting {config.weighting!r} with outer.normalize {config.normalize!r} "
                             f"needs each path's shard size: pass the run's PathSizes")
        if len(sizes.shard_tokens) != n_paths:
            raise ValueError(f"{len(sizes.shard_tokens)} shard sizes for a grid of {n_paths} paths")
    weights = [_weight(entry, sizes=sizes, weighting=config.weighting) * entry.factor for entry in entries]
    if config.normalize == "module":
        return weights, sum(weights)
    return weights, sum(_full_weight(path, sizes=sizes, weighting=config.weighting) for path in range(n_paths))


def _weight(entry: Weighed, *, sizes: PathSizes | None, weighting: str) -> float:
    if weighting == "uniform":
        return 1.0
    if weighting == "tokens":
        return float(entry.tokens)
    assert sizes is not None
    trained = min(1.0, entry.tokens / sizes.task_tokens)
    return float(sizes.shard_tokens[entry.path]) * trained


def _full_weight(path: int, *, sizes: PathSizes | None, weighting: str) -> float:
    if weighting == "uniform":
        return 1.0
    assert sizes is not None
    return float(sizes.task_tokens if weighting == "tokens" else sizes.shard_tokens[path])
