"""`dipaco simulate`: goodput by hand on known failure times, the same decisions as the real
coordinator on the same event trace, and sanity (no failures: goodput 1; fewer failures: more goodput)."""

import dataclasses
import math

import pytest
import torch

from dipaco.codec.compress import compress
from dipaco.codec.sparse import TopK
from dipaco.config import OuterConfig, ResilienceConfig, RoundsConfig, SimulateConfig
from dipaco.islands.coordinator.service import Coordinator, CoordinatorSettings
from dipaco.optim.weighting import PathSizes
from dipaco.simulate.data_parallel import simulate_data_parallel
from dipaco.simulate.diloco import RoundsSimulation, island_name, replica_topology
from dipaco.simulate.failures import FailureModel
from dipaco.simulate.scenario import STRATEGIES, run_strategy
from dipaco.simulate.settings import Settings
from dipaco.store.board import read_manifest, write_heartbeat, write_result
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import Heartbeat, ResultMeta, Task

INSTANT = 1e30  # Gbit/s: transfers take ~1e-29 s, which vanishes next to any time here


def hand_settings(**changes) -> Settings:
    """One learner of 10 chips, 2 s steps, a checkpoint every 5 steps, 30 s restarts, no stragglers."""
    inner_steps = changes.pop("inner_steps", 100)
    fields = dict(learners=1, chips_per_learner=10, step_seconds=2.0, checkpoint_interval=5, restart_seconds=30.0,
                  reconfigure_seconds=3.0, speed_sigma=0.0, link_gbit_per_s=INSTANT, model_parameters=1,
                  learner_failure="restart")
    sim = SimulateConfig(**{**fields, **changes})
    return Settings(sim=sim, inner_steps=inner_steps)


def trace(times: list[float]) -> FailureModel:
    return FailureModel(chip_mtbi_hours=1.0, speed_sigma=0.0, seed=0, trace={0: times})


def test_data_parallel_goodput_matches_the_hand_computed_case_exactly():
    # horizon 201 s, failures at 25, 40 (during the restart) and 150:
    #   0-25 trains 25 s; checkpoints at 10 and 20 s of training: 5 s rolled back (done 20)
    #   down until 40 + 30 = 70 (the failure at 40 restarts the restart); 70-150 trains 80 s (done 100,
    #   a checkpoint exactly there: nothing lost); down until 180; 180-201 trains 21 s (done 121)
    #   the horizon cuts the step 120-122: 1 s lost. Useful 120 s x 10 chips of 201 s x 10 chips.
    settings = hand_settings(horizon_hours=201 / 3600)
    ledger = simulate_data_parallel(settings, trace([25.0, 40.0, 150.0]), elastic=False)
    assert ledger.useful == pytest.approx(1200.0, abs=1e-9)
    assert ledger.lost == pytest.approx(60.0, abs=1e-9)  # 5 s + 1 s, x 10 chips
    assert ledger.goodput == pytest.approx(1200.0 / 2010.0, abs=1e-12)


def test_elastic_data_parallel_goodput_matches_the_hand_computed_case_exactly():
    # failure at 25.5: the step 24-26 is lost (1.5 s x 10 chips), 9 chips pause until 28.5; the chip is
    # back at 55.5 and everyone pauses until 58.5. Horizon 100: trained 24 + (55.5 - 28.5) on 9 chips
    # + (100 - 58.5) on 10 chips; done = 24 + 27 + 41.5 = 92.5 s: the step 92-94 is cut (0.5 s x 10).
    settings = hand_settings(horizon_hours=100 / 3600)
    ledger = simulate_data_parallel(settings, trace([25.5]), elastic=True)
    useful = 24 * 10 + 27 * 9 + 41.5 * 10 - 0.5 * 10
    assert ledger.useful == pytest.approx(useful, abs=1e-9)
    assert ledger.lost == pytest.approx(1.5 * 10 + 0.5 * 10, abs=1e-9)
    assert ledger.goodput == pytest.approx(useful / 1000, abs=1e-12)


def test_sync_rounds_goodput_of_one_learner_matches_the_hand_computed_case_exactly():
    # tasks of 10 steps (20 s); task 1: 0-20; task 2 from 20: the failure at 35 rolls it back from 15 s
    # to 10 s (5 s lost), down until 65, done at 75; task 3: 75-95, task 4: 95-115; task 5 is cut at
    # 120 after 5 s. Useful: 4 tasks x 20 s x 10 chips; lost: (5 + 5) s x 10 chips; of 120 x 10.
    settings = hand_settings(horizon_hours=120 / 3600, inner_steps=10)
    sim = RoundsSimulation(settings, trace([35.0]), mode="sync")
    ledger = sim.run()
    assert len(sim.rounds) == 4
    assert ledger.useful == pytest.approx(800.0, abs=1e-6)
    assert ledger.lost == pytest.approx(100.0, abs=1e-6)
    assert ledger.goodput == pytest.approx(800.0 / 1200.0, abs=1e-9)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_without_failures_goodput_is_one(strategy):
    settings = hand_settings(chip_mtbi_hours=1e12, horizon_hours=1.0, inner_steps=10, learners=4)
    summary = run_strategy(settings, strategy)  # 20 s tasks divide the hour: nothing is cut at the end
    assert summary["idle_chip_seconds"] == pytest.approx(0.0, abs=1e-6)  # nobody waited
    if strategy != "async rounds":
        assert summary["goodput"] == pytest.approx(1.0, abs=1e-9)
        return
    # async: results arriving at one instant are waited for (each is expected within the grace window),
    # and each learner trains on while the round closes: every result of the hour is applied
    assert summary["lost_chip_seconds"] == pytest.approx(0.0, abs=1e-6)
    assert summary["goodput"] == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_goodput_grows_with_the_chips_mean_time_between_interruptions(strategy):
    base = SimulateConfig(learners=4, chips_per_learner=20_000, horizon_hours=2.0, speed_sigma=0.05, seed=3)
    goodputs = [run_strategy(Settings(sim=dataclasses.replace(base, chip_mtbi_hours=mtbi)),
                             strategy)["goodput"] for mtbi in (200.0, 1000.0, 10_000.0)]
    assert goodputs[0] < goodputs[1] < goodputs[2] <= 1.0


# --- the same decisions as the real coordinator --------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def coordinator_replay(sim: RoundsSimulation, tmp_path, *, rounds: int = 100_000) -> tuple[list, list, list, list]:
    """Feed the simulation's event trace (results arriving, coordinator instants, learners stopping a
    cancelled task) to the real `Coordinator` over a real store; returns its (task hand-outs, round
    plans, cancellations, cuts) in the simulator's terms."""
    learners = len(sim.learners)
    topology = replica_topology(learners)
    store = ModuleStore(str(tmp_path / "store"))
    for name in topology.modules:
        store.write_module(0, name, {"w": torch.zeros(2)})
    store.commit(round=0, levels=list(topology.levels), modules=topology.modules)
    clock = Clock()
    settings = CoordinatorSettings(outer=OuterConfig(decay="keep"), rounds=sim.closing,
                                   resilience=ResilienceConfig(heartbeat_timeout=1e12), run_rounds=rounds,
                                   inner_steps=sim.settings.inner_steps, keep_versions=0)
    equal = PathSizes(shard_tokens=(1,) * topology.n_paths, step_tokens=1)  # the replay compares plans, not weights
    coordinator = Coordinator(store, topology, settings=settings, sizes=equal, clock=clock)
    seq = {i: 0 for i in range(learners)}
    status = {i: ("idle", None) for i in range(learners)}

    def beat(i: int) -> None:
        seq[i] += 1
        write_heartbeat(store, Heartbeat(island=island_name(i), incarnation="one", seq=seq[i], status=status[i][0],
                                         task=status[i][1], pinned=(i,), last_path=i, finished=(), time=clock.t,
                                         failures=0))

    for i in range(learners):
        beat(i)  # every island is up and idle at 0
    handed, closes, cancelled, cuts, assigned, stopped, cut = [], [], [], [], set(), set(), set()

    def ticks() -> None:
        for _ in range(6):  # the simulator's coordinator runs until nothing changes at one instant
            before = coordinator.committed
            coordinator.tick()
            for key, task in coordinator.tasks.items():
                if task.status == "assigned" and (key, task.attempt) not in assigned:
                    assigned.add((key, task.attempt))
                    handed.append((clock.t, task.path, task.base, task.island))
                    status[task.path] = ("training", key)
                    beat(task.path)
                if task.status == "cut" and key not in cut:
                    cut.add(key)
                    cuts.append((clock.t, task.path, task.base))
                if task.status == "cancelled" and key not in stopped:  # on the board until the next commit
                    stopped.add(key)
                    cancelled.append((clock.t, task.path, task.base, task.island))
            if coordinator.committed > before:
                manifest = read_manifest(store, coordinator.committed)
                decided = sorted([(e.path, e.base, e.factor) for e in manifest.applied]
                                 + [(e.path, e.base, None) for e in manifest.dropped], key=repr)
                closes.append((clock.t, coordinator.committed, decided))

    for event in sim.trace:
        clock.t = event[1]
        if event[0] == "result":  # an island uploads (also the result of a task cancelled meanwhile)
            _, _, sim_task, tokens, steps = event
            held = [t for t in coordinator.tasks.values() if t.path == sim_task.path and t.base == sim_task.base
                    and t.status in ("assigned", "cut", "cancelled")]
            task = held[0] if held else Task.open(path=sim_task.path, base=sim_task.base, step_offset=0, inner_from=None)
            meta = ResultMeta(path=task.path, round=task.round, base=task.base, attempt=task.attempt, tokens=tokens,
                              train_loss=1.0, losses=(1.0,) * steps, val_loss_start=1.0, seconds=1.0, bytes_down_modules=0,
                              bytes_down_inner=0, inner_state_local=True, data_parallel_ranks=1)
            write_result(store, task, {f"{m}/w": torch.zeros(2) for m in topology.modules}, meta,
                         compression="none", level=1)
            status[task.path] = ("idle", None)
            beat(task.path)
            continue
        if event[0] == "stopped":  # the island saw its task cancelled: it stops, heart-beats idle, asks again
            status[event[2].path] = ("idle", None)
            beat(event[2].path)
        ticks()
    assert coordinator.done == (rounds < 100_000)
    return handed, closes, cancelled, cuts


def straggler_trace_simulation(mode: str, rounds: int | None = None) -> RoundsSimulation:
    """4 stragglers (sigma 0.4) that lose chips often (elastic pauses), a quorum of 2 and a grace window
    shorter than the spread of task times: rounds close on quorum + grace, results go stale and some
    are dropped (max_staleness 1)."""
    sim_config = SimulateConfig(learners=4, chips_per_learner=1000, chip_mtbi_hours=50.0, restart_seconds=30.0,
                                reconfigure_seconds=3.0, step_seconds=2.0, speed_sigma=0.4,
                                model_parameters=1000, link_gbit_per_s=1.0, horizon_hours=0.1, seed=5)
    closing = RoundsConfig(quorum=0.5, grace_seconds=4.0, max_staleness=1, staleness_power=1.0)
    return RoundsSimulation(Settings(sim=sim_config, rounds=closing, inner_steps=10), FailureModel(
        chip_mtbi_hours=sim_config.chip_mtbi_hours, speed_sigma=sim_config.speed_sigma, seed=sim_config.seed),
        mode=mode, rounds=rounds)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_of_n_rounds_applies_n_results_per_path_and_discards_nothing_at_its_end(mode, tmp_path):
    # the run's length is applied work: async applies as many results as sync (rounds x paths), its
    # last commit waits for the last tasks in flight (no result is left undecided), and the real
    # coordinator, told run.rounds, makes the same decisions up to the same end
    sim = straggler_trace_simulation(mode, rounds=4)
    sim.run()
    applied = [v for log in sim.rounds for v in log.plan.applied]
    for path in range(4):  # every planned step of every path (async: results cut short count their own steps)
        assert sum(v.steps or 10 for v in applied if v.path == path) == 4 * 10
    if mode == "sync":
        assert sorted(v.path for v in applied) == sorted(list(range(4)) * 4)
    assert sim.syncer.policy.done and not sim.chip_seconds  # every result that arrived was decided
    # every task handed out arrived and was decided, or was cancelled (async only)
    assert sum(len(log.plan.verdicts) for log in sim.rounds) + len(sim.cancelled) == len(sim.handed)
    if mode == "sync":
        assert len(sim.rounds) == 4 and not sim.cancelled
    sim_closes = [(log.time, log.plan.round, sorted([(v.path, v.base, v.factor) for v in log.plan.verdicts], key=repr))
                  for log in sim.rounds]
    handed, closes, cancelled, cuts = coordinator_replay(sim, tmp_path, rounds=4)
    assert sorted(cuts) == sorted((e[1], e[2].path, e[2].base) for e in sim.trace if e[0] == "cut")
    assert sorted(handed) == sorted((t, task.path, task.base, island) for t, task, island in sim.handed)
    assert [(r, d) for _, r, d in closes] == [(r, d) for _, r, d in sim_closes]
    assert sorted(cancelled) == sorted((t, task.path, task.base, island) for t, task, island in sim.cancelled)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_simulator_and_the_real_coordinator_decide_the_same_on_the_same_trace(mode, tmp_path):
    # 4 stragglers (sigma 0.4) that lose chips often (elastic pauses), a quorum of 2 and a grace window
    # shorter than the spread of task times: rounds close on quorum + grace, results go stale and some
    # are dropped (max_staleness 1)
    sim_config = SimulateConfig(learners=4, chips_per_learner=1000, chip_mtbi_hours=50.0, restart_seconds=30.0,
                                reconfigure_seconds=3.0, step_seconds=2.0, speed_sigma=0.4,
                                model_parameters=1000, link_gbit_per_s=1.0, horizon_hours=0.1, seed=5)
    closing = RoundsConfig(quorum=0.5, grace_seconds=4.0, max_staleness=1, staleness_power=1.0)
    sim = RoundsSimulation(Settings(sim=sim_config, rounds=closing, inner_steps=10), FailureModel(
        chip_mtbi_hours=sim_config.chip_mtbi_hours, speed_sigma=sim_config.speed_sigma, seed=sim_config.seed),
        mode=mode)
    sim.run()
    sim_handed = [(t, task.path, task.base, island) for t, task, island in sim.handed]
    sim_closes = [(log.time, log.plan.round, sorted([(v.path, v.base, v.factor) for v in log.plan.verdicts], key=repr))
                  for log in sim.rounds]
    sim_cancelled = [(t, task.path, task.base, island) for t, task, island in sim.cancelled]
    handed, closes, cancelled, cuts = coordinator_replay(sim, tmp_path)
    assert sorted(cuts) == sorted((e[1], e[2].path, e[2].base) for e in sim.trace if e[0] == "cut")
    assert len(sim_closes) >= 8
    if mode == "async":
        stale = [d for _, _, decided in sim_closes for d in decided if d[2] is None or d[2] < 1]
        assert stale, "the trace should exercise staleness weighting or dropping"
        assert sim_cancelled, "the trace should cancel a running task whose result could no longer be applied"
        stopped = [e for e in sim.trace if e[0] == "stopped"]
        assert stopped and all(any(h[0] == e[1] and h[1] == e[2].path for h in sim_handed) for e in stopped)
    else:
        assert not sim_cancelled
    assert sorted(cancelled) == sorted(sim_cancelled)  # the same cancellations at the same instants
    assert sorted(handed) == sorted(sim_handed)  # the same hand-outs at the same instants (order within one is free)
    assert len(closes) == len(sim_closes)
    for (t, r, decided), (st, sr, sdecided) in zip(closes, sim_closes):
        assert (r, decided) == (sr, sdecided)
        assert math.isclose(t, st)


def test_a_task_cancelled_while_uploading_is_ignored_and_the_coordinator_agrees(tmp_path):
    """Two learners, max_staleness 0, quorum 1 of 2, no grace: learner 1 loses time to a chip failure, so
    learner 0's result closes round 1 while learner 1 is uploading its result from version 0. That task
    is cancelled (it could only be dropped): the upload finishes, its result is ignored (in no plan), and
    learner 1 then takes path 1's fresh task from version 1 — the same decisions as the real coordinator
    on the same trace."""
    settings = hand_settings(learners=2, inner_steps=10, link_gbit_per_s=1.0, model_parameters=625_000_000,
                             learner_failure="elastic", horizon_hours=60 / 3600)
    settings = Settings(sim=settings.sim, rounds=RoundsConfig(mode="async", quorum=0.5, grace_seconds=0.0, max_staleness=0),
                        codec="int8", inner_steps=settings.inner_steps)
    download, upload = (settings.transfer_seconds(b) for b in (settings.download_bytes, settings.upload_bytes))
    first_result = download + settings.task_seconds + upload
    failure = download + 3.0  # inside learner 1's second step: it loses a second and pauses to re-shard
    sim = RoundsSimulation(settings, FailureModel(chip_mtbi_hours=1.0, speed_sigma=0.0, seed=0, trace={1: [failure]}),
                           mode="async")
    sim.run()
    when, task, _ = next(c for c in sim.cancelled if c[2] == island_name(1))
    assert (when, task.path, task.base) == (pytest.approx(first_result), 1, 0)
    assert not [e for e in sim.trace if e[0] == "stopped"]  # it had finished training: nothing to stop
    (arrived,) = [e[1] for e in sim.trace if e[0] == "result" and e[2] == task]
    assert arrived > when  # its upload went on after the cancellation ...
    assert all(v.key != task.key for log in sim.rounds for v in log.plan.verdicts)  # ... and was ignored
    fresh = [(t, h.base) for t, h, i in sim.handed if i == island_name(1) and h.base > 0]
    assert fresh[0] == (arrived, 1)  # the fresh task, from version 1, as soon as the learner is free
    handed, closes, cancelled, cuts = coordinator_replay(sim, tmp_path)
    assert sorted(cuts) == sorted((e[1], e[2].path, e[2].base) for e in sim.trace if e[0] == "cut")
    assert sorted(handed) == sorted((t, h.path, h.base, i) for t, h, i in sim.handed)
    assert [(r, d) for _, r, d in closes] == [
        (log.plan.round, sorted([(v.path, v.base, v.factor) for v in log.plan.verdicts], key=repr)) for log in sim.rounds]
    assert sorted(cancelled) == sorted((t, c.path, c.base, i) for t, c, i in sim.cancelled)


# --- the command ---------------------------------------------------------------------------------------
def test_the_simulator_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, dipaco.stages.simulate, dipaco.simulate.scenario; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_dipaco_simulate_writes_the_table_json_and_plot(tmp_path, capsys):
    import json

    from dipaco.cli import main

    small = ["simulate.learners=2", "simulate.chips_per_learner=5000", "simulate.horizon_hours=0.5",
             "simulate.chip_mtbi_hours=100", "simulate.sweep_chips=[2000,8000]", "simulate.sweep_learners=[1,2]"]
    assert main(["simulate", "--run", str(tmp_path / "sim"), *small]) == 0
    printed = capsys.readouterr().out
    for strategy in STRATEGIES:
        assert strategy in printed
    results = json.loads((tmp_path / "sim" / "simulate" / "simulate.json").read_text())
    assert set(results["strategies"]) == set(STRATEGIES)
    assert len(results["sweep"]) == 2 * (2 + 2)  # per chip count: async at 1 and 2 learners, both data parallels
    assert (tmp_path / "sim" / "simulate" / "goodput-vs-chips.png").stat().st_size > 1000


@pytest.mark.parametrize("override, message", [
    ("simulate.learner_failure=crash", r"simulate.learner_failure must be one of \['elastic', 'restart'\]"),
    ("simulate.chip_mtbi_hours=0", "simulate.chip_mtbi_hours must be > 0"),
    ("simulate.sweep_learners=[]", "simulate.sweep_learners must be a non-empty list"),
])
def test_bad_simulate_settings_are_refused_naming_the_field(override, message):
    from dipaco.config import load_config

    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("codec, bits", [("none", 32), ("int8", 8), ("int4", 4), ("topk", 2), ("topk", 4), ("topk", 8)])
def test_an_upload_is_sized_as_the_real_codec_encodes_it(codec, bits):
    """The simulator's upload bytes against the bytes `compression.codec` writes for a pseudo-gradient of
    the same size (random normal): the dense codecs' bits per value, less the 1% the file's header adds, up
    to 20% over what zstd leaves of quantised values; top-k an upper estimate (a 16-bit offset per kept
    value, where the codec's zstd packs the real gaps tighter) within 2x."""
    parameters = 1 << 16
    delta = {"module/w": torch.randn(parameters // 256, 256, generator=torch.Generator().manual_seed(0))}
    spec = TopK(density=0.03, bits=bits, chunk=4096) if codec == "topk" else None
    encoded = len(compress(delta, method=codec, topk=spec)[0])
    simulated = Settings(sim=SimulateConfig(model_parameters=parameters), codec=codec, density=0.03,
                         bits=bits if codec == "topk" else 2).upload_bytes
    if codec == "topk":
        assert encoded <= simulated <= 2 * encoded, (encoded, simulated)
    else:
        assert 0.99 * encoded <= simulated <= 1.2 * encoded, (encoded, simulated)


# --- goodput by work --------------------------------------------------------------------------------------
class OneSlowLearner(FailureModel):
    """No failures; learner 0 `slowdown` times slower on every task (the rest as the seed draws)."""

    def __init__(self, slowdown: float, *, speed_sigma: float = 0.0) -> None:
        super().__init__(chip_mtbi_hours=1e12, speed_sigma=speed_sigma, seed=4)
        self.slowdown = slowdown

    def speed_factor(self, learner: int | None = None) -> float:
        return super().speed_factor(learner) * (self.slowdown if learner == 0 else 1.0)


def test_a_stragglers_slow_seconds_count_as_time_but_not_as_work():
    # 4 learners of 10 chips, tasks of 10 steps of 2 s (20 s); learner 0 takes 60 s. Sync: a round every
    # 60 s, closed at 60, ..., 600; the tasks started at 600 are unfinished at the horizon 610. Work: 10
    # rounds x 4 tasks x 20 s x 10 chips; time: 10 rounds x (3 x 20 + 60) s x 10 chips; of 4 x 10 x 610.
    settings = hand_settings(horizon_hours=610 / 3600, inner_steps=10, learners=4, chip_mtbi_hours=1e12)
    sim = RoundsSimulation(settings, OneSlowLearner(3.0), mode="sync")
    ledger = sim.run()
    assert len(sim.rounds) == 10
    assert ledger.goodput == pytest.approx(8000 / 24400, abs=1e-9)
    assert ledger.goodput_by_time == pytest.approx(12000 / 24400, abs=1e-9)
    assert ledger.summary()["goodput"] == ledger.goodput


def test_the_work_goodput_counts_is_the_applied_results_steps_at_nominal_speed():
    """Async, speeds drawn per task and a straggler: the ledger's work equals the steps of every result the
    rounds applied (their verdicts) x the nominal step x the chips, recomputed from the round log."""
    settings = hand_settings(horizon_hours=900 / 3600, inner_steps=10, learners=4, chip_mtbi_hours=1e12)
    sim = RoundsSimulation(settings, OneSlowLearner(2.5, speed_sigma=0.3), mode="async")
    ledger = sim.run()
    steps = sum(v.steps or settings.inner_steps for log in sim.rounds for v in log.plan.applied)
    assert steps > 0 and ledger.useful_work == pytest.approx(steps * 2.0 * 10, rel=1e-9)
    assert ledger.goodput == pytest.approx(steps * 2.0 * 10 / (4 * 10 * 900), rel=1e-9)
    assert ledger.useful != pytest.approx(ledger.useful_work)  # the speeds moved the time booked
