"""Rounds of the outer step through the real code, beside the numpy composition the docs write.

    rounds = OuterRounds(tmp_path, rounds=RoundsConfig(mode="async"), outer=OuterConfig())
    first = rounds.report(rounds.open(1))       # path 1 trains a task from the newest version and reports it
    second = rounds.report(rounds.open(1))      # its next task, chained on `first` (async: islands never wait)
    rounds.close()                              # the round policy plans, `apply_round` writes the version
    rounds.assert_matches()                     # every module against `expected`, written out in numpy

The grid is 2×2 with private embeddings: `pathP.embeddings` is path P's alone, each level module is
shared by two paths (path p = 2i + j takes level0.module{i} and level1.module{j}). A task is opened
as `TaskBoard.new_task` opens it: from the newest version, its path's next link there, chained on its
path's results received and not yet applied (store references, turned into task keys as the
coordinator's intake does). Its pseudo-gradient is random; what is checked is how results compose.

`expected` is the outer step as docs/outer-step.md and `dipaco.optim.weighting` write it, in float64
numpy, from the results' own records: per module, one weight W_p per path (|D_p|, the tokens per inner
step it trained, or 1), each result r of p added as W_p × f_r × Δ_r / Z, f_r = (1 + s)^−staleness_power
with s = t − 1 − base on a shared module and, on a private one, the path's own results applied in
rounds base+1 … t−1 that are not in the result's chain; then Nesterov SGD (buffer b ← μ b + g,
θ ← θ − lr (g + μ b)) or, with momentum 0, θ ← θ − lr g.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dipaco.config import OuterConfig, RoundsConfig
from dipaco.islands.coordinator.outer_step import apply_round
from dipaco.model.topology import Topology
from dipaco.optim.weighting import PathSizes
from dipaco.rounds.inputs import Grid, Result
from dipaco.rounds.policy import RoundPolicy
from dipaco.store.board import result_ref, result_ref_key, write_result
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import ResultMeta, RoundManifest, Task

SEQ, BATCH, STEPS = 256, 8, 25
STEP_TOKENS = BATCH * SEQ  # one inner step on one rank
SHARD_TOKENS = tuple(b * SEQ for b in (9001, 4627, 3100, 12000))  # unequal, as routing leaves them


@dataclass
class Reported:
    """A result as the test knows it: its records and its Δ per module (float64)."""

    task: Task
    tokens: int
    steps: int
    chain: frozenset[str]  # task keys
    delta: dict[str, np.ndarray]
    applied_in: int | None = None  # the round that applied it


@dataclass
class Expected:
    theta: dict[str, np.ndarray]
    buffer: dict[str, np.ndarray] = field(default_factory=dict)


class OuterRounds:
    def __init__(self, tmp_path, *, rounds: RoundsConfig, outer: OuterConfig, seed: int = 7):
        self.topology = Topology(levels=(2, 2), level_blocks=((0,), (1,)), private_blocks=frozenset(),
                                 private_embeddings=True)
        self.paths_of = {m: tuple(self.topology.paths_of_module(m)) for m in self.topology.modules}
        self.store, self.rounds, self.outer = ModuleStore(str(tmp_path / "store")), rounds, outer
        self.sizes = PathSizes(shard_tokens=SHARD_TOKENS, step_tokens=STEP_TOKENS)
        self.policy = RoundPolicy(Grid.of(self.topology), rounds)
        self.generator = torch.Generator().manual_seed(seed)
        theta = {m: torch.randn(3, 5, generator=self.generator, dtype=torch.float64) for m in self.topology.modules}
        for name, w in theta.items():
            self.store.write_module(0, name, {"w": w.float()})
        self.expected = Expected(theta={m: w.float().double().numpy() for m, w in theta.items()})
        self.results: dict[str, Reported] = {}
        self.dropped: set[str] = set()
        self.manifests: list[RoundManifest] = []

    @property
    def committed(self) -> int:
        return self.policy.committed

    def open(self, path: int) -> Task:
        """Path `path`'s next task, as the task board opens it (newest version, next link, chained)."""
        base = self.committed
        link = sum(1 for r in self.results.values() if r.task.path == path and r.task.base == base)
        unapplied = sorted((r.task for r in self.results.values() if r.task.path == path and r.applied_in is None),
                           key=lambda t: (t.base, t.link))
        chain = tuple(result_ref(round=t.round, path=path, attempt=0, link=t.link) for t in unapplied)
        return Task(path=path, base=base, attempt=0, status="received", island="test", incarnation="x",
                    step_offset=0, inner_from=None, result_attempt=0, link=link, chain=chain)

    def report(self, task: Task, *, steps: int = STEPS, ranks: int = 1) -> str:
        """`task`'s result arrives: `steps` inner steps on `ranks` data-parallel ranks; returns its key."""
        tokens = steps * STEP_TOKENS * ranks
        delta = {m: torch.randn(3, 5, generator=self.generator) * 0.01 for m in self.topology.modules_of_path(task.path)}
        meta = ResultMeta(path=task.path, round=task.round, base=task.base, attempt=0, tokens=tokens, train_loss=3.0,
                          losses=(3.0,) * steps, val_loss_start=3.5, seconds=1.0, bytes_down_modules=0,
                          bytes_down_inner=0, inner_state_local=False, data_parallel_ranks=ranks)
        write_result(self.store, task, {f"{m}/w": d for m, d in delta.items()}, meta, compression="none", level=1)
        chain = frozenset(map(result_ref_key, task.chain))
        self.results[task.key] = Reported(task=task, tokens=tokens, steps=steps, chain=chain,
                                          delta={m: d.double().numpy() for m, d in delta.items()})
        self.policy.received(Result(key=task.key, path=task.path, base=task.base, tokens=tokens, arrived=0.0,
                                    steps=steps, chain=chain))
        return task.key

    def close(self) -> RoundManifest:
        """The policy plans the next round, `apply_round` writes it, the policy commits it; `expected` follows."""
        plan = self.policy.plan()
        pending = [self.results[v.key].task for v in plan.verdicts]
        manifest = apply_round(self.store, self.topology, round=plan.round, pending=pending, config=self.outer,
                               plan=plan, sizes=self.sizes)
        self.policy.commit(plan)
        pending = [r for r in self.results.values() if r.applied_in is None and r.task.key not in self.dropped]
        applied = [r for r in pending if self.staleness(r, round=plan.round, private=False) <= self.rounds.max_staleness
                   and self.staleness(r, round=plan.round, private=True) <= self.rounds.max_staleness]
        assert sorted(e.key for e in manifest.applied) == sorted(r.task.key for r in applied), f"round {plan.round}"
        self.dropped |= {e.key for e in manifest.dropped}
        self._expect(plan.round, applied)
        for result in applied:
            result.applied_in = plan.round
        self.manifests.append(manifest)
        return manifest

    # --- the docs' composition, in numpy -------------------------------------------------------------
    def staleness(self, result: Reported, *, round: int, private: bool) -> int:
        """s (docs/islands.md "Staleness"): versions since its base; on a private module, its path's results
        applied in rounds base+1 … round−1 that its chain does not hold."""
        if not private:
            return round - 1 - result.task.base
        return sum(1 for r in self.results.values() if r.task.path == result.task.path and r.applied_in is not None
                   and r.applied_in > result.task.base and r.task.key not in result.chain)

    def factor(self, result: Reported, *, round: int, private: bool) -> float:
        """f_r = (1 + s)^−staleness_power."""
        return (1.0 + self.staleness(result, round=round, private=private)) ** -self.rounds.staleness_power

    def weight(self, path: int, results: list[Reported]) -> float:
        """W_p: one per path whatever the number of its results and the steps each trained."""
        if self.outer.weighting == "shard":
            return float(SHARD_TOKENS[path])
        if self.outer.weighting == "tokens":
            return sum(r.tokens for r in results) / sum(r.steps for r in results)
        return 1.0

    def full_weight(self, path: int) -> float:
        return {"shard": float(SHARD_TOKENS[path]), "tokens": float(STEP_TOKENS), "uniform": 1.0}[self.outer.weighting]

    def _expect(self, round: int, applied: list[Reported]) -> None:
        o = self.outer
        for m, paths in self.paths_of.items():
            mine = [r for r in applied if r.task.path in paths]
            if not mine:
                continue  # carried over, its momentum too
            by_path = {p: [r for r in mine if r.task.path == p] for p in sorted({r.task.path for r in mine})}
            w = {p: self.weight(p, rs) for p, rs in by_path.items()}
            z = sum(w.values()) if o.normalize == "module" else sum(self.full_weight(q) for q in range(4))
            g = sum(w[r.task.path] * self.factor(r, round=round, private=len(paths) == 1) * r.delta[m] for r in mine) / z
            g = g * (np.sqrt(len(paths)) if o.rescale_by_paths else 1.0)
            if o.momentum > 0:
                b = o.momentum * self.expected.buffer[m] + g if m in self.expected.buffer else g
                self.expected.buffer[m] = b
                step = g + o.momentum * b if o.nesterov else b
            else:
                step = g
            self.expected.theta[m] = self.expected.theta[m] - o.lr * step

    def assert_matches(self) -> None:
        for m, theta in self.expected.theta.items():
            got = self.store.read_module(self.committed, m)["w"].double().numpy()
            np.testing.assert_allclose(got, theta, rtol=0, atol=2e-6, err_msg=f"version {self.committed}, {m}")
