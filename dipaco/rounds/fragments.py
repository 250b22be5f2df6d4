"""Fragments (`outer.fragments`, Streaming DiLoCo, arXiv 2501.18512): each round syncs only some modules, on a
staggered schedule, so a round uploads about one fragment while every module is still synced every K rounds.

    schedule = FragmentSchedule.split({"embeddings": 16384, "level0.module0": 8448, ...}, count=2,
                                      paths=Grid.of(topology).modules, inner_steps=4, rounds=10)
    schedule.synced(topology.modules_of_path(3), round=5, step_offset=16)   # what that task sends

The grid's modules are split into K = `count` fragments of about equal upload: a module weighs its
parameters × the paths through it (each of them sends its Δ of the module when it is synced), so a round
uploads about 1/K of what syncing every module does. Heaviest module first (ties by name), each to the
lightest fragment so far (ties: the lowest), so no fragment exceeds the ideal share by more than the
heaviest module: the granularity is the module (a module of half the upload is half of every round's). A task of round r (`Task.round`) sends the
modules of fragment r mod K among its path's; over any K consecutive rounds every module is synced exactly
once. The path's last task, the one that reaches its `rounds` x `inner_steps` steps, sends every module, so
no training stays on the island at the end. K = 1 is every module every round.

With `outer.private_modules: local` the modules only one path trains (`local`: its private embeddings and
head, and any module of a 1-path level) are in no fragment: only the path's last task sends them, so they
stay on the island that trains the path, like its inner moments, and never cross the wire in between. The island keeps training
the modules it does not send (their drift travels with the path: `dipaco.optim.drift`); the coordinator
expects exactly `synced` in the result and averages a module only over the results that carry it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sized
from dataclasses import dataclass


@dataclass(frozen=True)
class FragmentSchedule:
    """Which modules each task sends: module -> fragment, and the run's end (its last tasks send all)."""

    count: int  # K = outer.fragments
    of_module: dict[str, int]  # module -> its fragment in 0..K-1 (K = 1: may be empty, every module is synced)
    inner_steps: int = 1  # steps of a whole task (`Task.steps` 0)
    rounds: int | None = None  # run.rounds: a task ending at the path's rounds x inner_steps steps sends all; None: no end
    local: frozenset[str] = frozenset()  # modules only the path's last task sends (outer.private_modules: local)

    @classmethod
    def every_round(cls) -> FragmentSchedule:
        """K = 1: every task sends every module of its path."""
        return cls(count=1, of_module={})

    @classmethod
    def of(cls, *, count: int, sizes: Callable[[], dict[str, int]], paths: Mapping[str, Sized], inner_steps: int,
           rounds: int | None, private_local: bool = False) -> FragmentSchedule:
        """The schedule `outer.fragments` (`count`) and `outer.private_modules` (`private_local`) ask for:
        `sizes` (module -> parameters) is called only when `count` > 1; `paths`: module -> the paths through it."""
        local = frozenset(m for m, through in paths.items() if len(through) == 1) if private_local else frozenset()
        if count == 1:
            return cls(count=1, of_module={}, inner_steps=inner_steps, rounds=rounds, local=local)
        shared = {m: n for m, n in sizes().items() if m not in local}
        return dataclasses.replace(cls.split(shared, count, paths=paths, inner_steps=inner_steps, rounds=rounds),
                                   local=local)

    @classmethod
    def split(cls, sizes: dict[str, int], count: int, *, paths: Mapping[str, Sized] | None = None,
              inner_steps: int = 1, rounds: int | None = None) -> FragmentSchedule:
        """Split the modules `sizes` (module -> parameters) into `count` fragments of about equal weight, a
        module's weight its size × its `paths` (module -> the paths through it; None: one each)."""
        if count < 1 or count > max(1, len(sizes)):
            raise ValueError(f"outer.fragments {count} must be between 1 and the grid's {len(sizes)} modules "
                             f"({sorted(sizes)[:6]}{'...' if len(sizes) > 6 else ''})")
        weight = {m: n * (1 if paths is None else len(paths[m])) for m, n in sizes.items()}
        load = [0] * count
        of_module = {}
        for name in sorted(weight, key=lambda m: (-weight[m], m)):
            fragment = min(range(count), key=lambda f: (load[f], f))
            of_module[name] = fragment
            load[fragment] += weight[name]
        return cls(count=count, of_module=of_module, inner_steps=inner_steps, rounds=rounds)

    def fragments(self) -> list[list[str]]:
        """The modules of each fragment, in the order `split` placed them."""
        out: list[list[str]] = [[] for _ in range(self.count)]
        for name, fragment in self.of_module.items():
            out[fragment].append(name)
        return out

    def last(self, *, step_offset: int, steps: int = 0) -> bool:
        """Is the task that starts at its path's step `step_offset` and trains `steps` (0: `inner_steps`) the
        path's last, the one that reaches the run's end?"""
        return self.rounds is not None and step_offset + (steps or self.inner_steps) >= self.rounds * self.inner_steps

    @property
    def sends_all(self) -> bool:
        """Does every task send every module of its path (K = 1, no local modules)?"""
        return self.count == 1 and not self.local

    def synced(self, modules: Iterable[str], *, round: int, step_offset: int = 0, steps: int = 0) -> list[str]:
        """Of `modules` (a path's, in its order), those its task of round `round` sends (all when the task is
        the path's last: `last`; else all but the `local` ones when K is 1)."""
        modules = list(modules)
        if self.last(step_offset=step_offset, steps=steps):
            return modules
        modules = [m for m in modules if m not in self.local]
        if self.count == 1:
            return modules
        unknown = [m for m in modules if m not in self.of_module]
        if unknown:
            raise ValueError(f"modules {unknown[:3]} are in no fragment (the schedule covers {len(self.of_module)} modules)")
        return [m for m in modules if self.of_module[m] == round % self.count]
