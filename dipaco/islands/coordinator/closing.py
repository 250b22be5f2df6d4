"""Closing a round: when the policy says it is due, apply the outer step it planned and commit.

Version t's modules and its manifest are staged first (under the lease token's names, `ModuleStore.fence`),
the board is settled in memory (used tasks leave, open tasks move to version t, running tasks whose results could no longer be
applied are cancelled, those one version from that are cut), then round, board and stats are committed in one write (`state.json`): a crash
before it leaves round t to be done again from the same inputs, a crash after it nothing but retention.
The lease's fencing token is checked before the outer step, between its module writes (a renewal when a
quarter of the lease timeout has passed, refused once another coordinator took over) and before the commit;
the commit itself is fenced: version t is staged under this coordinator's token and `state.json` is replaced
only if it is the version this coordinator wrote (`ModuleStore.fence`), so a coordinator that stalled past
its lease after the last check is refused (`LeaseLost`) and leaves nothing a reader opens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from dipaco.codec.codec import Codec
from dipaco.config import OuterConfig
from dipaco.islands.coordinator.intake import ResultIntake
from dipaco.islands.coordinator.outer_step import apply_round
from dipaco.islands.coordinator.task_board import RUNNING, TaskBoard
from dipaco.model.topology import Topology
from dipaco.optim.outer import round_outer_step
from dipaco.optim.weighting import PathSizes
from dipaco.rounds.fragments import FragmentSchedule
from dipaco.rounds.policy import RoundPolicy
from dipaco.store.board import ResultChanged, write_manifest
from dipaco.store.lease import Lease
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import ResultMeta, RoundManifest, RoundStats
from dipaco.store.run_state import commit_round

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClosedRound:
    manifest: RoundManifest  # what the round applied and dropped
    stats: RoundStats  # train.json's row
    norms: dict[str, tuple[float, float]]  # module -> (outer gradient norm, update norm), for the metrics
    metas: dict[str, ResultMeta]  # task key -> the metadata of the results it read
    at: float  # when it was committed (coordinator clock)


class RoundCloser:
    def __init__(self, store: ModuleStore, topology: Topology, *, outer: OuterConfig, inner_steps: int,
                 decay_from: int | None, max_staleness: int, sizes: PathSizes | None, lease: Lease,
                 fragments: FragmentSchedule | None = None, download: Codec | None = None, gather: bool = False):
        """`outer`: the configured outer step; `inner_steps`: per task; `decay_from`: the path step where the
        inner lr decays (`outer.decay`); `max_staleness`: rounds.max_staleness (logged on a cancellation);
        `fragments`: the schedule, which knows a path's last task (its bytes counted apart in the stats);
        `download`: the codec of the module updates each round publishes (None: none, `compression.download: full`);
        `gather`: a plain average publishes its results themselves (`compression.download: results`)."""
        self.download, self.gather = download, gather
        self.fragments = fragments or FragmentSchedule.every_round()
        self.store, self.topology, self.sizes, self.lease = store, topology, sizes, lease
        self.outer, self.inner_steps, self.decay_from, self.max_staleness = outer, inner_steps, decay_from, max_staleness

    def due(self, board: TaskBoard, policy: RoundPolicy, now: float) -> bool:
        """Does the policy close the round now?"""
        return policy.close_due(now, running=board.running(), open=board.open_tasks())

    def close(self, board: TaskBoard, policy: RoundPolicy, intake: ResultIntake, *, round_started: float,
              clock: Callable[[], float], cut: int = 0) -> ClosedRound | None:
        """Write version committed + 1 and its manifest, settle the board, commit; returns what it did (None:
        a result's bytes changed after its checks, so it was redone and nothing was committed)."""
        round = board.committed + 1
        pending = [t for t in board.tasks.values() if t.status == "received" and t.key not in board.used]
        plan = policy.plan()
        self.lease.check()
        norms: dict[str, tuple[float, float]] = {}
        metas = {t.key: intake.meta(t) for t in pending}  # read once: the outer step, the metrics
        configured = self.outer
        outer = round_outer_step(configured, step_ends=[t.step_offset + (t.steps or self.inner_steps) for t in pending],
                                 decay_from=self.decay_from)
        outer_step = "configured" if outer is configured else "average"
        if outer_step == "average":
            log.info("round %d: plain averaging (its results reach the inner lr's decay; outer.decay %s)", round,
                     configured.decay)
        finished = policy.finishes(plan)  # the run's last version: its updates flush the download residual
        try:
            manifest = apply_round(self.store, self.topology, round=round, pending=pending, config=outer, plan=plan,
                                   sizes=self.sizes, norms=norms, metas=metas,
                                   digests={t.key: intake.digests.get(t.key) for t in pending},
                                   check_lease=self.lease.renew, download=self.download, final=finished,
                                   gather=self.gather)
        except ResultChanged as changed:  # its bytes are not the ones checked: redone, the round closes later
            (task,) = [t for t in pending if (t.round, t.path, t.link, t.result_attempt) == changed.key]
            intake.redo(board, policy, task, str(changed))
            return None
        write_manifest(self.store, manifest)
        board.committed = round
        policy.commit(plan)
        intake.forget(board.settle(manifest.keys))
        board.rebase_open(policy)
        cancelled = board.cancel_doomed(policy, max_staleness=self.max_staleness)
        now = clock()
        cut += board.cut(policy, now)  # behind by rounds.max_staleness now: the next round is their last
        in_flight = sum(1 for t in board.tasks.values() if t.status in RUNNING)
        last = frozenset(t.key for t in pending if self.fragments.last(step_offset=t.step_offset, steps=t.steps))
        stats = replace(RoundStats.of(manifest, in_flight=in_flight, cancelled=cancelled, cut=cut, outer_step=outer_step,
                                      last=last), seconds=now - round_started)
        self.lease.check()  # a deposed coordinator stops here; one deposed after it is refused by the commit itself
        commit_round(self.store, self.topology, round, finished=finished, board=board.snapshot().to_json(),
                     stats=stats.to_json())
        return ClosedRound(manifest=manifest, stats=stats, norms=norms, metas=metas, at=now)
