"""bench/bench_islands.py's pure parts: the settings reach the runs, the pacing hook's sleep, the data-parallel
job's accounting on a hand-made failure schedule, the core-busy sampler, goodput and tokens arithmetic, the checks."""

from __future__ import annotations

import pytest

from bench.bench_islands import Setting, rows_to_run, train_args
from bench.cpu_load import CoreSampler, busy_fraction, cpu_jiffies, process_cpu_seconds
from bench.data_parallel import Job, Ledger
from bench.islands_applied import applied_rate, applied_tasks, pace_from_logs, tasks_by_island
from bench.islands_report import capacity_left, evaluate_checks
from dipaco.cli import build_parser
from dipaco.config import SimulateConfig
from dipaco.islands.island.pacing import Pacer
from dipaco.model.topology import Topology
from dipaco.pipeline.invocation import config_and_run
from dipaco.simulate.diloco import RoundsSimulation
from dipaco.simulate.failures import FailureModel
from dipaco.simulate.settings import Settings
from dipaco.store.board import read_heartbeats


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


def test_each_rows_train_command_runs_the_settings_it_names(tmp_path):
    """The arguments an island row gives `dipaco train`, through the real command line, set the run's length,
    pace, islands, failures, straggler and mode (the figures worked out by hand: T = 7 x 1.5 s = 10.5 s)."""
    setting = Setting(rounds=3, inner_steps=7, step_seconds=1.5)
    rows = {row.name: row for row in rows_to_run(setting, (0.5,))}
    assert list(rows) == ["dp-mtbf0.5", "sync-mtbf0.5", "async-mtbf0.5", "sync-slow", "async-slow"]

    def config_of(name: str):
        args = build_parser().parse_args(["train", *train_args(setting, tmp_path / name, rows[name])])
        config, run = config_and_run("train", config_file=args.config, run=args.run, store=None,
                                     overrides=args.overrides, wait=0.0)
        assert run.root == tmp_path / name
        return config

    sync, failing, slow = config_of("sync-mtbf0.5"), config_of("async-mtbf0.5"), config_of("async-slow")
    for config in (sync, failing, slow):
        assert (config.run.rounds, config.inner.steps, config.faults.step_seconds) == (3, 7, 1.5)
        topology = Topology.from_config(config.topology, n_layers=config.model.n_layers)
        assert config.hardware.islands == topology.n_paths == 8  # one island per path
    assert (sync.rounds.mode, failing.rounds.mode, slow.rounds.mode) == ("sync", "async", "async")
    assert (sync.faults.mtbf, sync.faults.return_after, sync.faults.mode) == (5.25, pytest.approx(1.575), "die")
    assert failing.faults.mtbf == 5.25 and (slow.faults.mtbf, slow.faults.slowdown) == (0.0, 3.0)
    assert sync.faults.slowdown == failing.faults.slowdown == 1.0


# --- pacing -------------------------------------------------------------------------------------------------
def test_a_paced_step_sleeps_to_the_pace_and_a_straggler_to_slowdown_times_it():
    clock = FakeClock()
    pacer = Pacer(step_seconds=2.0, sleep=clock.sleep, clock=clock)
    assert pacer.pad(0.25) == pytest.approx(1.75) and clock.now == pytest.approx(1.75)
    assert pacer.pad(2.5) == 0.0  # compute over the pace: nothing to pad, counted
    straggler = Pacer(step_seconds=2.0, slowdown=3.0, sleep=clock.sleep, clock=clock)
    assert straggler.pad(0.5) == pytest.approx(3 * 2.0 - 0.5)
    unpaced = Pacer(slowdown=3.0, sleep=clock.sleep, clock=clock)  # the old straggler: (F - 1) x its compute
    assert unpaced.pad(0.5) == pytest.approx(1.0)
    assert not Pacer(sleep=clock.sleep, clock=clock).active
    assert (pacer.steps, pacer.compute, pacer.padding, pacer.slowest, pacer.over_pace) == (2, 2.75, 1.75, 2.5, 1)


def test_a_scaled_step_is_paced_to_its_share_of_the_work():
    """An elastic island's worker alone computes the whole batch: scale 2 (its rows over its share at two workers)
    pads to twice the pace; a member with no rows (healing) is not padded."""
    clock = FakeClock()
    pacer = Pacer(step_seconds=2.0, sleep=clock.sleep, clock=clock)
    assert pacer.pad(0.5, scale=2.0) == pytest.approx(3.5) and pacer.pad(0.0, scale=0.0) == 0.0
    assert pacer.pad(1.5, scale=0.5) == 0.0 and pacer.over_pace == 1  # over its (half) pace


def test_a_check_that_raises_cuts_the_padding_where_it_is():
    clock = FakeClock()
    pacer = Pacer(step_seconds=2.0, sleep=clock.sleep, clock=clock)

    def check() -> None:
        if clock.now >= 0.5:
            raise RuntimeError("failed")

    with pytest.raises(RuntimeError):
        pacer.pad(0.1, check=check)
    assert clock.now == pytest.approx(0.5, abs=0.06) and pacer.padding == pytest.approx(clock.now)


def test_a_stop_from_the_check_ends_only_the_padding():
    """A cut (`stop`) during the padding ends the padding and returns what was slept: the step was trained."""
    clock = FakeClock()
    pacer = Pacer(step_seconds=2.0, sleep=clock.sleep, clock=clock)

    class Cut(RuntimeError):
        pass

    def check() -> None:
        if clock.now >= 0.5:
            raise Cut("cut")

    slept = pacer.pad(0.1, check=check, stop=Cut)
    assert slept == pytest.approx(0.5, abs=0.06) and pacer.padding == pytest.approx(slept) and pacer.steps == 1
    with pytest.raises(RuntimeError, match="other"):  # anything else still ends the step
        pacer.pad(0.1, check=lambda: (_ for _ in ()).throw(RuntimeError("other")), stop=Cut)


def test_the_pace_summary_reads_back_from_island_logs(tmp_path):
    clock = FakeClock()
    pacer = Pacer(step_seconds=2.0, sleep=clock.sleep, clock=clock)
    for compute in (0.1, 0.3, 2.2):
        pacer.pad(compute)
    (tmp_path / "island-0.log").write_text(f"x INFO: path-0001: {pacer.summary()}\nother\n"
                                           f"x INFO: path-0002: {pacer.summary()}\n")
    total = pace_from_logs([tmp_path / "island-0.log"])
    assert total == {"tasks": 2, "steps": 6, "compute": pytest.approx(5.2), "padding": pytest.approx(7.2),
                     "slowest": pytest.approx(2.2), "over_pace": 2}


# --- data parallel ------------------------------------------------------------------------------------------
class ScheduledFaults:
    """A hand-made failure schedule (FaultClock's interface): fails at `times`, away `return_after`."""

    def __init__(self, times: list[float], *, return_after: float, clock: FakeClock) -> None:
        self.times, self.return_after, self.clock, self.failures = list(times), return_after, clock, 0

    def due(self) -> bool:
        return bool(self.times) and self.clock() >= self.times[0]

    def fail(self) -> float:
        self.times.pop(0)
        self.failures += 1
        return self.return_after


def one_worker_job(failures: list[float], *, compute: float = 0.5, pace: float = 2.0, return_after: float = 3.0,
                   checkpoint_steps: int = 1) -> tuple[Job, FakeClock, list[int]]:
    clock = FakeClock()
    saved = [0]

    def train_step() -> None:
        clock.now += compute

    job = Job(faults=ScheduledFaults(failures, return_after=return_after, clock=clock),
              pacer=Pacer(step_seconds=pace, sleep=clock.sleep, clock=clock), agree=lambda own: [own],
              train_step=train_step, save=saved.append, restore=lambda: saved[-1], checkpoint_steps=checkpoint_steps,
              clock=clock, sleep=clock.sleep)
    return job, clock, saved


def test_data_parallel_without_failures_is_all_useful():
    job, clock, saved = one_worker_job([])
    ledger = job.run(steps=5, horizon=100.0)
    assert (ledger.steps, ledger.failures, ledger.restarts) == (5, 0, 0)
    assert ledger.useful == pytest.approx(10.0) and ledger.wall == pytest.approx(10.0) and ledger.goodput == 1.0
    assert saved == [0, 1, 2, 3, 4]  # a checkpoint after every step but the last


def test_data_parallel_rolls_back_to_the_checkpoint_and_waits_for_the_failed_worker():
    # Steps of 2 s, a checkpoint every 2 steps. The failure at 5.0 s cuts step 3 one second in: steps 3
    # (its 1 s) is lost, step 2 was checkpointed; back at 5 + 3 = 8 s; a second failure during the wait (at
    # 7 s) extends it to 10 s; then steps 3 and 4 again (10-14 s), step 5 (14-16 s): the job ends.
    job, clock, saved = one_worker_job([5.0, 7.0], checkpoint_steps=2)
    ledger = job.run(steps=5, horizon=100.0)
    assert ledger.failures == 2 and ledger.restarts == 1 and ledger.steps == 5
    assert ledger.wall == pytest.approx(16.0, abs=0.1)
    assert ledger.useful == pytest.approx(10.0)  # five 2-s steps survive
    assert ledger.lost == pytest.approx(1.0, abs=0.06) and ledger.down == pytest.approx(5.0, abs=0.06)
    assert ledger.goodput == pytest.approx(10 / 16, abs=0.01)
    assert saved == [0, 2, 4]


def test_data_parallel_loses_the_steps_since_its_checkpoint():
    # A checkpoint every 3 steps; a failure at 9.5 s is in step 5: steps 4 and 5 (3.5 s) are lost.
    job, clock, saved = one_worker_job([9.5], checkpoint_steps=3)
    ledger = job.run(steps=6, horizon=100.0)
    assert ledger.lost == pytest.approx(3.5, abs=0.06) and ledger.useful == pytest.approx(12.0)
    assert ledger.wall == pytest.approx(9.5 + 3.0 + 3 * 2.0, abs=0.1)


def test_data_parallel_stops_at_its_horizon():
    job, clock, _ = one_worker_job([3.0], return_after=100.0)
    ledger = job.run(steps=50, horizon=20.0)
    assert ledger.steps == 1 and ledger.useful == pytest.approx(2.0)
    assert ledger.wall == pytest.approx(20.0, abs=0.06) and ledger.goodput == pytest.approx(0.1, abs=0.01)


def test_the_ledger_goodput_is_useful_over_wall():
    ledger = Ledger(wall=10.0)
    ledger.step(2.0)
    ledger.roll_back(1.0)
    ledger.step(2.0)
    ledger.checkpoint()
    assert (ledger.useful, ledger.lost, ledger.goodput) == (2.0, 3.0, 0.2)


# --- cores --------------------------------------------------------------------------------------------------
STAT = "cpu  {} 0 {} {} {} 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"


def test_the_busy_fraction_comes_from_proc_stat_idle_and_iowait():
    before = cpu_jiffies(STAT.format(100, 50, 800, 50))  # user, system, idle, iowait
    after = cpu_jiffies(STAT.format(160, 70, 900, 70))
    assert before == (150, 1000)
    assert busy_fraction(before, after) == pytest.approx(80 / 200)
    with pytest.raises(ValueError, match="cpu"):
        cpu_jiffies("intr 1 2 3\n")


def test_a_processes_cpu_seconds_come_from_its_stat_line_even_with_a_spaced_name():
    line = "42 (python -m dipaco) S 7 42 42 0 -1 4194304 100 0 0 0 250 50 0 0 20 0 3 0 1 2 3"
    assert process_cpu_seconds(line, ticks=100) == (7, 3.0)


def test_the_sampler_reports_each_window_for_the_machine_and_our_processes():
    clock = FakeClock()
    stats = iter([STAT.format(0, 0, 0, 0), STAT.format(50, 0, 150, 0), STAT.format(250, 0, 150, 0)])
    trees = iter([{1: 0.0, 2: 5.0}, {1: 0.5, 2: 5.5}, {1: 1.5, 3: 9.0}])  # pid 2 ended, pid 3 started
    sampler = CoreSampler(read_stat=lambda: next(stats), read_tree=lambda root: next(trees), clock=clock)
    sampler.cores = 2
    for _ in range(3):
        sampler.sample()
        clock.now += 1.0
    assert sampler.machine == [0.25, 1.0]
    assert sampler.ours == [pytest.approx(0.5), pytest.approx(0.5)]  # 1 CPU-s of 2 cores per 1-s window; then pid 1 only
    summary = sampler.summary()
    assert summary["machine_busy_max"] == 1.0 and summary["machine_windows_saturated"] == 1
    assert summary["ours_busy_mean"] == pytest.approx(0.5)


# --- goodput, tokens, checks --------------------------------------------------------------------------------
def test_the_applied_tasks_and_tokens_of_a_trained_run(tiny_straight):
    """Read back from a real run's store (conftest's `tiny_straight`, sync): every applied result is a whole task
    of inner.steps x batch x sequence tokens, one per path and round, trained by an island that heart-beat;
    tokens per second over given seconds."""
    config, store, n_paths = tiny_straight.config, tiny_straight.store, tiny_straight.topology.n_paths
    tasks = applied_tasks(store)
    whole = config.inner.steps * config.inner.batch_size * config.sharding.seq_len
    assert len(tasks) == config.run.rounds * n_paths and {t["tokens"] for t in tasks} == {whole}
    assert sorted((t["path"], t["base"]) for t in tasks) == sorted(
        (p, r) for p in range(n_paths) for r in range(config.run.rounds))
    assert {t["island"] for t in tasks} <= set(read_heartbeats(store)) and all(t["finished"] > 0 for t in tasks)
    assert sum(tasks_by_island(tasks).values()) == len(tasks)
    total = len(tasks) * whole
    assert applied_rate(tasks, seconds=8.0) == {"applied_tokens": total, "tokens_per_second": total / 8.0}


def test_a_straggler_leaves_the_capacity_the_checks_count_on():
    """The straggler check's 22/24 is what async rounds keep with one of 8 islands 3x slower: the simulator
    (no failures, instant transfers) applies that share of the islands' work, where by time the straggler's
    slow seconds would count as 100%; sync rounds wait for it every round (1/3)."""
    class OneSlow(FailureModel):
        def speed_factor(self, learner: int | None = None) -> float:
            return 3.0 if learner == 0 else 1.0

    sim = SimulateConfig(learners=8, chips_per_learner=1, step_seconds=1.0, speed_sigma=0.0, link_gbit_per_s=1e30,
                         model_parameters=1, chip_mtbi_hours=1e12, horizon_hours=300 / 3600)
    runs = {mode: RoundsSimulation(Settings(sim=sim, inner_steps=10),
                                   OneSlow(chip_mtbi_hours=1e12, speed_sigma=0.0, seed=0), mode=mode).run()
            for mode in ("async", "sync")}
    assert runs["async"].goodput == pytest.approx(capacity_left(8, 3.0)) and runs["async"].goodput_by_time == 1.0
    assert runs["sync"].goodput == pytest.approx(1 / 3)


def row(name: str, mode: str, goodput: float, *, mtbf=None, perplexity=100.0, tokens=1000.0, slowdown=1.0) -> dict:
    return {"name": name, "mode": mode, "goodput": goodput, "mtbf_tasks": mtbf, "perplexity": perplexity,
            "tokens_per_second": tokens, "slowdown": slowdown}


def test_the_checks_on_hand_made_rows():
    out = {"setting": {"islands": 8},
           "rows": [row("sync", "sync", 0.9), row("async", "async", 0.92, perplexity=50.0),
                    row("dp-mtbf2", "dp", 0.45, mtbf=2), row("sync-mtbf2", "sync", 0.7, mtbf=2),
                    row("async-mtbf2", "async", 0.85, mtbf=2, perplexity=50.5),
                    row("dp-mtbf1", "dp", 0.30, mtbf=1), row("sync-mtbf1", "sync", 0.61, mtbf=1),
                    row("async-mtbf1", "async", 0.78, mtbf=1, perplexity=52.0),
                    row("sync-slow", "sync", 0.3, tokens=330.0, slowdown=3.0),
                    row("async-slow", "async", 0.8, tokens=830.0, slowdown=3.0)],
           "prediction": {"runs": [{"run": "sync", "goodput": 0.9, "fitted": True},
                                   {"run": "async-mtbf1", "goodput": 0.74}, {"run": "dp-mtbf1", "goodput": 0.22}]}}
    verdicts = {c["check"].split(" ")[0] + str(i): c["verdict"] for i, c in enumerate(evaluate_checks(out))}
    assert list(verdicts.values()) == [
        "missed",  # async 78% < 80% where data parallel is 30% (the 45% rate does not count)
        "met",  # sync nearest 60% is MTBF 1: async 78 >= 61 + 10
        "missed",  # async perplexity +4% at MTBF 1
        "met",  # 830 >= 0.9 x 22/24 x 1000 = 825
        "met",  # issue 38: 830 >= 0.85 x 22/24 x 1000 = 779
        "missed",  # data parallel 30 vs 22 simulated: 8 points
    ]
    out["rows"] = out["rows"][:2]
    assert [c["verdict"] for c in evaluate_checks(out)][:4] == ["not measured"] * 4


# --- elastic rows (bench/islands_elastic.py) ------------------------------------------------------------------
def test_elastic_rows_train_islands_of_w_workers_failing_per_worker_and_data_parallel_splits_the_batch(tmp_path):
    """The elastic rows' `dipaco train` arguments, through the real command line: W workers per island, each with
    the row's per-worker MTBF (T = 10 x 2 s), seeds by run.seed; data parallel over islands x W workers, each
    with 1/W of an island's batch."""
    from bench.bench_islands import data_parallel_batch
    from bench.islands_elastic import elastic_rows

    setting = Setting()
    rows = {row.name: row for row in elastic_rows(setting, workers=2, mtbf=2.5, seeds=[0, 1])}
    assert list(rows) == ["async-elastic", "async-elastic-mtbf2.5", "async-elastic-s1", "async-elastic-mtbf2.5-s1",
                          "dp-w2-mtbf2.5"]

    def config_of(name: str):
        args = build_parser().parse_args(["train", *train_args(setting, tmp_path / name, rows[name])])
        return config_and_run("train", config_file=args.config, run=args.run, store=None, overrides=args.overrides,
                              wait=0.0)[0]

    free, failing, other = config_of("async-elastic"), config_of("async-elastic-mtbf2.5"), config_of("async-elastic-s1")
    assert free.hardware.workers_per_island == failing.hardware.workers_per_island == 2
    assert (free.faults.mtbf, failing.faults.mtbf, failing.faults.return_after) == (0.0, 50.0, pytest.approx(3.0))
    assert (free.run.seed, other.run.seed, failing.rounds.mode) == (0, 1, "async")
    assert data_parallel_batch(setting, rows["dp-w2-mtbf2.5"].workers) == [f"inner.batch_size={free.inner.batch_size // 2}"]


def test_elastic_checks_use_the_rows_own_failure_free_seed_and_the_ceiling():
    from bench.islands_elastic import ceiling, evaluate_checks

    def row(name, mode, goodput, *, mtbf=None, seed=0, perplexity=None):
        return {"name": name, "mode": mode, "goodput": goodput, "mtbf_tasks": mtbf, "seed": seed,
                "perplexity": perplexity}

    rows = [row("async-elastic", "async", 0.90, perplexity=60.0), row("async-elastic-s1", "async", 0.80, seed=1,
                                                                      perplexity=50.0),
            row("async-elastic-mtbf3", "async", 0.86, mtbf=3.0, perplexity=61.5),
            row("async-elastic-mtbf3-s1", "async", 0.84, mtbf=3.0, seed=1, perplexity=50.0),
            row("dp-w2-mtbf3", "dp", 0.29, mtbf=3.0)]
    out = {"setting": {"restart_tasks": 0.15}, "rows": rows}
    by = {r["name"]: r for r in rows}
    assert ceiling(out["setting"], by, by["async-elastic-mtbf3-s1"]) == pytest.approx(3.0 / 3.15 * 0.80)
    assert ceiling(out["setting"], by, by["dp-w2-mtbf3"]) is None
    checks = {c["check"].split(" ")[0] + c["check"].split(" ")[-1]: c for c in evaluate_checks(out)}
    goodput, perplexity = [c for c in checks.values() if "30%" in c["check"]][0], [c for c in checks.values()
                                                                                   if "perplexity" in c["check"]][0]
    assert goodput["verdict"] == "met" and "85.0%" in goodput["detail"]  # mean of the seeds: (86 + 84) / 2
    assert perplexity["verdict"] == "met" and "+1.25%" in perplexity["detail"]  # (+2.5% + 0%) / 2: mean of the seeds
    rows[2]["goodput"] = 0.83
    assert [c for c in evaluate_checks(out) if "30%" in c["check"]][0]["verdict"] == "missed"


def test_goodput_before_the_runs_end_cuts_at_the_first_island_out_of_work_and_credits_the_tasks_in_flight():
    from bench.islands_elastic import evaluate_checks
    from bench.islands_run_end import before_the_end, goodput_before_end

    def done(island, finished, tokens=100):
        return {"island": island, "finished": finished, "tokens": tokens}

    # the run: 1000 s to 1100 s; island a's last upload at 1080 s is the cut; island b's upload at 1100 s was in
    # flight from its previous one at 1060 s, half of that time done by the cut
    results = [done("a", 1040.0), done("b", 1030.0), done("a", 1080.0), done("b", 1060.0), done("b", 1100.0)]
    before = before_the_end(results, run_seconds=100.0)
    assert before == {"seconds": pytest.approx(80.0), "tokens": pytest.approx(450.0), "cut_share": pytest.approx(0.8)}
    assert goodput_before_end({"before_the_end": before}, capacity=10.0) == pytest.approx(450.0 / 800.0)
    assert before_the_end([done("a", 1010.0), done("b", 0.0)], run_seconds=10.0) is None  # a result with no clock
    assert goodput_before_end({}, capacity=10.0) is None
    # the elastic check names it beside the whole run's figure, on the mean of the seeds
    rows = [{"name": "async-elastic", "mode": "async", "goodput": 0.95, "mtbf_tasks": None},
            *({"name": f"async-elastic-mtbf3{tag}", "mode": "async", "goodput": 0.8, "mtbf_tasks": 3.0, "seed": seed,
               "before_the_end": {"seconds": 10.0, "tokens": tokens, "cut_share": 0.9}}
              for tag, seed, tokens in (("", 0, 86.0), ("-s1", 1, 88.0))),
            {"name": "dp-w2-mtbf3", "mode": "dp", "goodput": 0.29, "mtbf_tasks": 3.0}]
    out = {"setting": {"restart_tasks": 0.15, "capacity_tokens_per_second": 10.0}, "rows": rows}
    check = [c for c in evaluate_checks(out) if "30%" in c["check"]][0]
    assert check["verdict"] == "missed" and "elastic async 80.0%" in check["detail"]
    assert "before the run's end 87.0%" in check["detail"]


def test_the_elastic_rows_sum_each_workers_last_time_line_and_count_resumed_tasks(tmp_path):
    """`worker_time` sums the last `elastic worker time` line of every worker's log (each line is cumulative), and
    `resumed_tasks` counts the tasks resumed from an island's checkpoint, in the lines the workers write."""
    from bench.islands_applied import resumed_tasks, worker_time
    from dipaco.islands.island.elastic_island import RESUMED
    from dipaco.islands.island.elastic_time import KINDS, WorkerTime

    def line(**seconds) -> str:
        spent = WorkerTime()
        spent.seconds.update(seconds)
        return f"12:00:00 dipaco.islands.island.elastic_island INFO: island island-0 (island-0-w0): {spent.line()}\n"

    resumed = f"12:00:01 dipaco.islands.island.elastic_island INFO: island island-0 (island-0-w1): path-0001 {RESUMED} at step 4\n"
    (tmp_path / "island-0-w0.log").write_text(line(steps=10.0, heal=1.0) + line(steps=20.0, heal=1.5, down=3.0))
    (tmp_path / "island-0-w1.log").write_text(resumed + line(steps=18.0, quorum=0.25))
    (tmp_path / "island-0.log").write_text(line(steps=99.0) + resumed)  # the lighthouse's log: not a worker's
    assert worker_time(tmp_path) == {kind: {"steps": 38.0, "heal": 1.5, "down": 3.0, "quorum": 0.25}.get(kind, 0.0)
                                     for kind in KINDS}
    assert resumed_tasks(tmp_path) == 1
    assert worker_time(tmp_path / "none") is None


def test_the_simulators_tries_of_a_shrunk_island_are_the_elastic_islands_own():
    """`try_paces` against the island's own row split (`elastic.rows_left`, `completes_step`): each try lasts its
    busiest member's rows over its share at the full island, until the step's rows are covered."""
    import torch

    from bench.islands_elastic import try_paces
    from dipaco.islands.island.elastic import completes_step, rows_left

    for rows, workers in ((8, 2), (8, 4), (12, 4), (10, 3)):
        share = -(-rows // workers)
        for members in range(1, workers + 1):
            covered, tries = torch.zeros(rows), []
            while True:
                taken = [rows_left(covered, rank=r, world=members, share=share) for r in range(members)]
                tries.append(max(len(t) for t in taken) / share)
                done = completes_step(covered, world=members, share=share)
                for t in taken:
                    covered[t] = 1.0
                if done:
                    break
            assert try_paces(rows, workers, members) == pytest.approx(tries), (rows, workers, members)
