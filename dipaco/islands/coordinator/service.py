"""The coordinator service: the single writer of the task board, module versions and outer state.

    dipaco coordinator --config configs/tiny.yaml --run runs/tiny      # islands run elsewhere
    dipaco train       --config configs/tiny.yaml --run runs/tiny      # the same, plus local islands

In Python:

    coordinator = Coordinator(ModuleStore("runs/tiny/store"), topology,
                              settings=CoordinatorSettings.from_config(cfg), sizes=factory.path_sizes)
    while not coordinator.tick(): time.sleep(0.1)

It holds the store's lease and fences the store with its token (`ModuleStore.fence`): it stages versions under
the token's names and commits with a conditional write, so a coordinator deposed by a newer one cannot commit.
`tick` is one pass: renew the lease, read the heartbeats (`heartbeats`), pick up results (`intake`),
open tasks for paths without one, hand lost tasks out again (`task_board`), close the round when the
policy says so (`closing`, then `pruning`), assign open tasks to idle islands, and write the board. After
each commit it publishes its own byte counts and reads every process's (`dipaco.store.ledger`): `traffic`.
Every decision is the round policy's (`dipaco.rounds`). A restarted coordinator resumes from the store:
committed rounds are final, the applied results come from their manifests, and a half-written round is
written again from the same inputs (docs/islands.md#crash-safety). A finished run started again with a
larger `run.rounds` goes on: the store stops saying it is finished before any island reads it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from dipaco.codec.codec import Codec
from dipaco.config import Config, OuterConfig, ResilienceConfig, RoundsConfig
from dipaco.islands.coordinator.acceptance import ResultChecks
from dipaco.islands.coordinator.closing import RoundCloser
from dipaco.islands.coordinator.heartbeats import Liveness, Seen
from dipaco.islands.coordinator.intake import ResultIntake
from dipaco.islands.coordinator.pruning import retain
from dipaco.islands.coordinator.task_board import resume_board
from dipaco.islands.coordinator.update_bound import InnerRun
from dipaco.islands.update_codec import download_codec
from dipaco.model.topology import Topology
from dipaco.optim.outer import path_decay_from
from dipaco.optim.weighting import PathSizes, needs_sizes
from dipaco.rounds.fragments import FragmentSchedule
from dipaco.rounds.inputs import Grid
from dipaco.rounds.policy import RoundPolicy
from dipaco.store.board import read_manifest
from dipaco.store.lease import Lease
from dipaco.store.ledger import Ledger, publish_counts
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import ManifestEntry, PathState, ResultMeta, RoundStats, Task
from dipaco.store.run_state import commit_round, reopen_run, run_finished

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoordinatorSettings:
    """What a coordinator reads from the config, unpacked once (`from_config`)."""

    outer: OuterConfig  # the outer step
    rounds: RoundsConfig  # when a round closes (sync / async)
    resilience: ResilienceConfig  # heartbeat timeout, lease timeout, result checks
    run_rounds: int  # the run's length: results applied per path (run.rounds)
    inner_steps: int  # steps per task
    keep_versions: int = 2  # module versions retention keeps (store.keep_versions)
    decay_from: int | None = None  # the path step where the inner lr starts to decay (outer.decay); None = never
    inner: InnerRun | None = None  # the islands' AdamW and lr schedule: inner states checked, the poison bound per unit of lr
    expected_islands: int = 0  # islands the run's launcher starts (dipaco train): while fewer have joined, a path's
    # first task keeps its carried state on its island as if all had (0 = not known: the islands alive count)
    download: Codec | None = None  # the codec of the module updates each round publishes (None: compression.download full)
    gather: bool = False  # a plain average publishes its results themselves (compression.download: results)

    @classmethod
    def from_config(cls, config: Config) -> CoordinatorSettings:
        return cls(outer=config.outer_step, rounds=config.rounds, resilience=config.resilience,
                   run_rounds=config.run.rounds, inner_steps=config.inner.steps,
                   keep_versions=config.store.keep_versions,
                   decay_from=path_decay_from(config.inner, rounds=config.run.rounds,
                                              warm_start_steps=config.warm_start_steps),
                   inner=InnerRun.of(config), download=download_codec(config.compression),
                   gather=config.compression.download == "results")


class Coordinator:
    def __init__(self, store: ModuleStore, topology: Topology, *, settings: CoordinatorSettings,
                 sizes: PathSizes | None = None, clock: Callable[[], float] = time.monotonic,
                 checks: ResultChecks | None = None, lease: Lease | None = None, force: bool = False):
        """Resume from the store's committed round (version 0 must be there), holding the store's lease
        (`lease`, else taken here: `LeaseHeld` when another coordinator holds it, unless `force`). `sizes`
        (each path's training-shard tokens) is needed by `outer.weighting: shard`. Results are checked by
        `checks` (`acceptance.ResultChecks`) before they are received."""
        outer = settings.outer
        if needs_sizes(outer) and (sizes is None or len(sizes.shard_tokens) != topology.n_paths):
            raise ValueError(f"outer.weighting {outer.weighting!r} needs the shard size of each of the "
                             f"{topology.n_paths} paths, got {None if sizes is None else list(sizes.shard_tokens)}")
        if outer.decay != "keep" and settings.decay_from is None:
            raise ValueError(f"outer.decay {outer.decay!r} needs decay_from, the path step where the inner lr "
                             f"starts to decay (dipaco.optim.outer.path_decay_from)")
        self.fragments = FragmentSchedule.of(count=outer.fragments, sizes=lambda: store.module_sizes(topology.modules),
                                             paths=Grid.of(topology).modules, inner_steps=settings.inner_steps,
                                             rounds=settings.run_rounds, private_local=outer.private_modules == "local")
        self.lease = lease or Lease.acquire(store, timeout=settings.resilience.lease_timeout, force=force)
        store.fence(self.lease.token)  # before reading the committed state: an older token can no longer commit
        self.store, self.topology, self.settings, self.clock = store, topology, settings, clock
        self.checks = checks or ResultChecks(store, topology, resilience=settings.resilience,
                                             inner_steps=settings.inner_steps, inner=settings.inner, clock=clock)
        self.board, self.last_stats, applied = resume_board(store, n_paths=topology.n_paths,
                                                            inner_steps=settings.inner_steps)
        self.intake = ResultIntake(store, self.checks, inner_steps=settings.inner_steps, clock=clock,
                                   fragments=self.fragments)
        self.liveness = Liveness(store, timeout=settings.resilience.heartbeat_timeout)
        self.policy = RoundPolicy(Grid.of(topology), settings.rounds, rounds=settings.run_rounds,
                                  inner_steps=settings.inner_steps, committed=self.committed, applied=applied,
                                  fragments=outer.fragments, beat_seconds=settings.resilience.heartbeat_seconds)
        self.board.carried = self.intake.carried  # what each running task's result will carry
        self.board.capacity = self.liveness.capacity  # an elastic island short of workers is cut later
        self.board.expected_islands = settings.expected_islands  # joining islands keep their first paths' state
        if self.policy.done and not run_finished(store):  # finished by a coordinator that did not mark it
            state = store.state() or {}
            commit_round(store, topology, self.committed, finished=True,
                         **{k: state[k] for k in ("board", "stats") if k in state})
        elif not self.policy.done and run_finished(store):  # finished, but run.rounds grew: before any island looks
            self.lease.check()
            reopen_run(store)
        self.checks.seed(self.board.paths)  # the poison bound's reference, as committed
        self.intake.recheck(self.board, self.policy)  # received before a restart: checked again
        self.closer = RoundCloser(store, topology, outer=outer, inner_steps=settings.inner_steps,
                                  decay_from=settings.decay_from, max_staleness=settings.rounds.max_staleness,
                                  sizes=sizes, lease=self.lease, fragments=self.fragments, download=settings.download,
                                  gather=settings.gather)
        self.round_started = clock()
        self.cut = 0  # running tasks cut since the last commit
        self.last_norms: dict[str, tuple[float, float]] = {}  # of the last round this coordinator closed
        self.last_metas: dict[str, ResultMeta] = {}  # task key -> result metadata, of the last round closed
        if 0 < self.committed:  # what follows the last commit, again: a crash may have cut it short
            manifest = read_manifest(store, self.committed)
            self._retain(manifest.applied if manifest else ())
        self.ledger = Ledger()
        self.traffic: dict = {}  # the run's measured store traffic as of the last report (`ledger.Ledger.summary`)
        self.report_traffic()

    # --- the board, as the tests and the train stage read it ---------------------------------------------
    @property
    def committed(self) -> int:
        return self.board.committed

    @property
    def tasks(self) -> dict[str, Task]:
        return self.board.tasks

    @property
    def paths(self) -> dict[int, PathState]:
        return self.board.paths

    @property
    def seen(self) -> dict[str, Seen]:
        return self.liveness.seen

    @property
    def first_beat(self) -> float | None:
        return self.liveness.first_beat

    @property
    def done(self) -> bool:
        """The run is over: every path has had run.rounds results applied (the policy's count; in sync
        mode that is round run.rounds)."""
        return self.policy.done

    # --- one pass ----------------------------------------------------------------------------------
    def tick(self) -> bool:
        """One pass of the loop; returns True when the run's last round is committed (`done`)."""
        now = self.clock()
        self.lease.renew()
        self.liveness.read(now)
        self.intake.receive(self.board, self.policy)
        if not self.done:
            self.board.open_paths(self.policy)
            self.board.reassign_lost(self.policy, self.liveness, now)
            if not self.intake.held and self.closer.due(self.board, self.policy, now):  # held: the poison bound's wait
                self._close()
                if not self.done:
                    self.board.open_paths(self.policy)  # the paths that reported train on from the new version
            if not self.done:
                self.cut += self.board.cut(self.policy, now)  # stragglers report what they trained
                self.board.assign(self.policy, self.liveness, now)  # after any commit: from the newest version
        self.board.write(self.store, self.lease)
        return self.done

    def run_round(self, round: int, *, poll_seconds: float = 0.1, check: Callable[[], None] | None = None) -> RoundStats:
        """Tick until `round` is committed; returns its stats (the run must not be done before it)."""
        if self.done and self.committed < round:
            raise RuntimeError(f"the run ended with round {self.committed}; there is no round {round}")
        while self.committed < round:
            self.tick()
            if self.committed >= round:
                break
            if check:
                check()
            time.sleep(poll_seconds)
        if self.last_stats is None or self.last_stats.round != round:
            raise RuntimeError(f"round {round} was committed before this coordinator started")
        return self.last_stats

    def _close(self) -> None:
        closed = self.closer.close(self.board, self.policy, self.intake, round_started=self.round_started,
                                   clock=self.clock, cut=self.cut)
        if closed is None:
            return
        self.cut = 0
        self.last_stats, self.round_started = closed.stats, closed.at
        self.last_norms, self.last_metas = closed.norms, closed.metas
        self._retain(closed.manifest.applied)
        self.report_traffic()
        manifest = closed.manifest
        log.info("round %d committed: %d results applied (%d stale), %d dropped, %d running tasks cut, %d cancelled",
                 manifest.round, len(manifest.applied), closed.stats.stale, len(manifest.dropped), closed.stats.cut,
                 closed.stats.cancelled)

    def report_traffic(self) -> dict:
        """Publish this coordinator's byte counts, then read every process's (earlier sessions' included): the
        run's measured traffic, kept in `traffic` and returned."""
        publish_counts(self.store, owner="coordinator", role="coordinator")
        self.ledger.read(self.store)
        self.traffic = self.ledger.summary()
        return self.traffic

    def _retain(self, applied: tuple[ManifestEntry, ...]) -> None:
        retain(self.store, self.topology, board=self.board, policy=self.policy,
               keep_versions=self.settings.keep_versions, applied=applied)
