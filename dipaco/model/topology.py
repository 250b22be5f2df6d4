"""The grid of modules: levels x alternatives, which paths share which module, and module names.

A path picks one module per level. Its flat id is `np.ravel_multi_index(choice, levels)` (level 0
most significant), the same convention as `routing.kmeans.product_kmeans`. Every parameter of a
path's model belongs to exactly one named module:

- `embeddings`          — token embedding, final norm and output head, shared by every path
                          (`path007.embeddings` when `private_embeddings`);
- `level1.module3`      — the shared blocks of level 1 in its module 3 (paths whose choice is 3);
- `path007.block05`     — a block listed in `private_blocks`, owned by path 7 alone.

    from dipaco.model.topology import Topology
    top = Topology.from_config(cfg.topology, n_layers=cfg.model.n_layers)
    top.modules_of_path(5), top.paths_of_module("level0.module1")
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from dipaco.config import TopologyConfig

EMBEDDINGS = "embeddings"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EMBEDDING_PARAMS = ("model.embed_tokens.", "model.norm.", "lm_head.")


@dataclass(frozen=True)
class Topology:
    levels: tuple[int, ...]  # alternative modules per level
    level_blocks: tuple[tuple[int, ...], ...]  # the block indices of each level
    private_blocks: frozenset[int]
    private_embeddings: bool
    replicas: int = 1  # DiLoCo replica islands per routed path; replicas share every module

    @classmethod
    def from_config(cls, config: TopologyConfig, *, n_layers: int) -> Topology:
        counts = config.blocks_per_level or _even_split(n_layers, len(config.levels))
        if sum(counts) != n_layers:
            raise ValueError(f"blocks per level {counts} sum to {sum(counts)}, but the model has {n_layers} blocks")
        starts = np.cumsum([0, *counts])
        level_blocks = tuple(tuple(range(starts[i], starts[i + 1])) for i in range(len(counts)))
        return cls(
            levels=tuple(config.levels),
            level_blocks=level_blocks,
            private_blocks=frozenset(config.private_blocks),
            private_embeddings=config.private_embeddings,
            replicas=config.replicas,
        )

    @property
    def n_paths(self) -> int:
        """Paths the islands train (and shards hold): routed paths x replicas."""
        return math.prod(self.levels) * self.replicas

    @property
    def n_routed(self) -> int:
        """Paths the router picks from: one per module choice."""
        return math.prod(self.levels)

    @property
    def data_levels(self) -> list[int]:
        """The levels the data assignments use: the grid, plus a replica level when replicas > 1."""
        return [*self.levels, self.replicas] if self.replicas > 1 else list(self.levels)

    def routed_path(self, path: int) -> int:
        """The router's id of a path (its replicas share it)."""
        return path // self.replicas

    def representative(self, routed: int) -> int:
        """The first replica of a routed path: the path that evaluation loads for it."""
        return routed * self.replicas

    @property
    def n_layers(self) -> int:
        return sum(len(b) for b in self.level_blocks)

    def choice(self, path: int) -> tuple[int, ...]:
        """The module picked at each level by a flat path id."""
        if not 0 <= path < self.n_paths:
            raise ValueError(f"path {path} is outside 0..{self.n_paths - 1} for levels {list(self.levels)}")
        return tuple(int(i) for i in np.unravel_index(path // self.replicas, self.levels))

    def path_label(self, path: int) -> str:
        """The module choice as text: `(1,1)` for path 3 of a 2x2 grid."""
        label = "(" + ",".join(map(str, self.choice(path))) + ")"
        return f"{label}r{path % self.replicas}" if self.replicas > 1 else label

    def level_of_block(self, block: int) -> int:
        for level, blocks in enumerate(self.level_blocks):
            if block in blocks:
                return level
        raise ValueError(f"block {block} is outside the model's blocks 0..{self.n_layers - 1}")

    def module_of_param(self, param_name: str, path: int) -> str:
        """The module that holds parameter `param_name` of path `path`."""
        match = _LAYER.match(param_name)
        if match:
            block = int(match.group(1))
            if block in self.private_blocks:
                return f"path{path // self.replicas:03d}.block{block:02d}"
            level = self.level_of_block(block)
            return f"level{level}.module{self.choice(path)[level]}"
        if param_name.startswith(_EMBEDDING_PARAMS):
            return f"path{path // self.replicas:03d}.{EMBEDDINGS}" if self.private_embeddings else EMBEDDINGS
        raise ValueError(f"parameter {param_name!r} belongs to no module of the topology")

    def modules_of_path(self, path: int) -> list[str]:
        """Every module name a path's parameters belong to, in model order."""
        owner = path // self.replicas  # replicas of a path share even its private modules
        names = [f"path{owner:03d}.{EMBEDDINGS}" if self.private_embeddings else EMBEDDINGS]
        for level, blocks in enumerate(self.level_blocks):
            shared = [b for b in blocks if b not in self.private_blocks]
            if shared:
                names.append(f"level{level}.module{self.choice(path)[level]}")
            names.extend(f"path{owner:03d}.block{b:02d}" for b in blocks if b in self.private_blocks)
        return names

    @cached_property
    def _paths_by_module(self) -> dict[str, list[int]]:
        table: dict[str, list[int]] = {}
        for path in range(self.n_paths):
            for name in self.modules_of_path(path):
                table.setdefault(name, []).append(path)
        return table

    def paths_of_module(self, module: str) -> list[int]:
        """The paths that contain a module (one for a private module, all for the shared embeddings)."""
        try:
            return self._paths_by_module[module]
        except KeyError:
            raise ValueError(f"unknown module {module!r}; modules are {self.modules[:6]}...") from None

    @property
    def modules(self) -> list[str]:
        return list(self._paths_by_module)


def _even_split(n_layers: int, n_levels: int) -> list[int]:
    base, extra = divmod(n_layers, n_levels)
    return [base + (1 if i < extra else 0) for i in range(n_levels)]
