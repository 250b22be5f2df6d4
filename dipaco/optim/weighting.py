"""How much each result weighs in a module's outer step (`outer.weighting`, `outer.normalize`).

One rule under every weighting: a path carries one weight W_p in a round, whatever the number of its
results and however many steps each trained. For module m, `combine_streamed` adds each result r of
path p with factor W_p × f_r / Z:

    W_p = |D_p|                                               outer.weighting: shard (the paper's)
    W_p = tokens per inner step p trained (Σ_r tokens_r / Σ_r steps_r)   outer.weighting: tokens
    W_p = 1                                                   outer.weighting: uniform
    Z   = Σ_{paths q reporting to m} W_q                      outer.normalize: module
    Z   = Σ_{q ∈ all paths} W_q as a one-rank island trains   outer.normalize: all

|D_p| is the number of tokens in path p's training shard (`dipaco shard` writes it to
shards/index.json), f_r the result's staleness factor (1 in sync mode; `dipaco.rounds.plan`); Z leaves
the factors out, so a stale result is discounted even when it is the only one a module gets.

- A path's results in one round (async) are consecutive pieces of its training: their Δs add up to
  its progress, each enters with the same W_p, and Z counts the path once.
- A result cut short (or a task that asked for fewer steps) weighs once for its fraction: its Δ holds
  the progress of the steps it trained, so its weight does not shrink with them as well (that counted
  a fraction f of a task as f²).
- `tokens` weighs by the batch a path trained with (data-parallel ranks included), not by how long it
  trained: with every island training inner.batch_size sequences per step it is uniform.

With DiLoCo replicas each replica is a path of its own whose shard holds its random share of the
routed path's documents (`dipaco route`), so its |D_p| is that share. With `module`, the weights of
the paths a module got sum to 1 (a weighted average); with `all` they sum to the share of the whole
data those paths stand for: a level module shared by 2 of 4 equal paths gets Σ α = 0.5, a module of
every path 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from dipaco.config import OuterConfig


class Weighed(Protocol):
    """What a result's weight depends on (a `RoundPlan` contribution or a `ManifestEntry`)."""

    key: str  # the task whose result it is
    path: int  # the path that trained it
    tokens: int  # the tokens it trained (all data-parallel ranks)
    steps: int | None  # the inner steps it trained (None: not recorded)
    factor: float  # its staleness factor (1 in sync mode)


@dataclass(frozen=True)
class PathSizes:
    """What the weights are made of besides the results: each path's |D_p| and one inner step's tokens."""

    shard_tokens: tuple[int, ...]  # training tokens in each path's shard, indexed by path
    step_tokens: int  # tokens one inner step trains on one rank: inner.batch_size × sharding.seq_len

    def __post_init__(self) -> None:
        if not self.shard_tokens or any(n <= 0 for n in self.shard_tokens):
            raise ValueError(f"every path's training shard must hold tokens, got {list(self.shard_tokens)}")
        if self.step_tokens <= 0:
            raise ValueError(f"an inner step must train tokens, got {self.step_tokens}")


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
    by_path: dict[int, list[Weighed]] = {}  # in the order the paths first appear
    for entry in entries:
        by_path.setdefault(entry.path, []).append(entry)
    path_weight = {p: _weight(p, results, sizes=sizes, weighting=config.weighting) for p, results in by_path.items()}
    weights = [path_weight[entry.path] * entry.factor for entry in entries]
    if config.normalize == "module":
        return weights, sum(path_weight.values())
    return weights, sum(_full_weight(path, sizes=sizes, weighting=config.weighting) for path in range(n_paths))


def _weight(path: int, results: list[Weighed], *, sizes: PathSizes | None, weighting: str) -> float:
    """W_p of `path` from its `results` this round (module docstring)."""
    if weighting == "uniform":
        return 1.0
    if weighting == "shard":
        assert sizes is not None
        return float(sizes.shard_tokens[path])
    unknown = [r.key for r in results if not r.steps]
    if unknown:
        raise ValueError(f"outer.weighting 'tokens' weighs a path by the tokens per inner step it trained, but "
                         f"result {unknown[0]} of path {path} does not say how many steps it trained")
    return sum(r.tokens for r in results) / sum(r.steps or 0 for r in results)


def _full_weight(path: int, *, sizes: PathSizes | None, weighting: str) -> float:
    if weighting == "uniform":
        return 1.0
    assert sizes is not None
    return float(sizes.step_tokens if weighting == "tokens" else sizes.shard_tokens[path])
