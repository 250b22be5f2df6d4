"""What the round policy is told: the grid, results that arrived, running and open tasks, idle islands."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class GridSource(Protocol):
    """What `Grid.of` reads (`dipaco.model.topology.Topology` is one)."""

    n_paths: int
    modules: list[str]

    def paths_of_module(self, name: str) -> list[int]: ...


@dataclass(frozen=True)
class Grid:
    """The topology as the policy needs it: which paths go through each module."""

    n_paths: int
    modules: dict[str, tuple[int, ...]]  # module -> the paths through it

    @classmethod
    def of(cls, topology: GridSource) -> Grid:
        return cls(n_paths=topology.n_paths,
                   modules={m: tuple(topology.paths_of_module(m)) for m in topology.modules})

    @property
    def shared(self) -> list[str]:
        return [m for m, paths in self.modules.items() if len(paths) > 1]


@dataclass(frozen=True)
class Result:
    """A task's result has arrived: path `path` trained from version `base`."""

    key: str  # the task's key (one result per key is used)
    path: int
    base: int
    tokens: int
    arrived: float  # policy clock
    started: float | None = None  # when the task was handed out (policy clock); None = unknown
    steps: int | None = None  # inner steps it trained (fewer when it was cut); None = a whole task
    modules: frozenset[str] | None = None  # the modules it carries (outer.fragments); None = every module of its path
    chain: frozenset[str] = frozenset()  # keys of its path's earlier results its start holds (`Task.chain`, async)


@dataclass(frozen=True)
class Running:
    """A task some island is training."""

    key: str
    path: int
    base: int
    started: float | None  # when it was handed out; None = unknown (e.g. before a coordinator restart)
    cut: bool = False  # already told to stop and report what it trained
    steps: int | None = None  # inner steps it was asked for; None = a whole task
    modules: frozenset[str] | None = None  # the modules its result will carry (outer.fragments); None = all of its path's
    capacity: float = 1.0  # the share of its island's workers training it now (an elastic island short of workers: < 1)


@dataclass(frozen=True)
class OpenTask:
    """A task no island has yet."""

    key: str
    path: int
    base: int
    steps_done: int = 0  # inner steps its path has trained so far: the path furthest behind goes first
    holder: str | None = None  # the island that trained its path last and holds its carried state in memory (None: in the store)


@dataclass(frozen=True)
class IdleIsland:
    """A live island waiting for work."""

    name: str
    pinned: tuple[int, ...] = ()  # the only paths it takes; () = any
    last_path: int | None = None  # the path it trained last
    was_cut: bool = False  # a task of it was cut (it fell behind): other idle islands go first

    def may_take(self, path: int) -> bool:
        return not self.pinned or path in self.pinned
