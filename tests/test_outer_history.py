"""The outer step a round records is the one it applied, and train.json's spans say them (issue 27, item 3).

The round-by-round check drives the real coordinator (`closing` → `apply_round`) on the tiny config with a
wsd schedule whose decay starts in the last round, so rounds take Nesterov SGD and then a plain average,
and recomputes every module version in numpy from the previous one, the uploaded pseudo-gradients and the
recorded lr, momentum, Nesterov flag and rescale.
"""

import math

import numpy as np
from tiny_runs import Clock, drive, make_run

from dipaco.optim.outer import path_decay_from
from dipaco.optim.outer_history import describe_outer_steps, describe_rows, outer_spans
from dipaco.pipeline.context import PathFactory
from dipaco.store.board import read_manifest, read_result
from dipaco.store.records import OuterStep, RoundManifest, RoundStats

FILE = "train.json"


def row(round: int, name: str, step: OuterStep | None) -> RoundStats:
    manifest = RoundManifest(round=round, applied=(), dropped=(), outer=step)
    return RoundStats.of(manifest, in_flight=0, outer_step=name)


NESTEROV = OuterStep(lr=0.7, momentum=0.9, nesterov=True, rescale_by_paths=False)
AVERAGE = OuterStep(lr=1.0, momentum=0.0, nesterov=False, rescale_by_paths=False)


def test_spans_group_consecutive_rounds_that_took_the_same_step():
    rows = [row(1, "configured", NESTEROV), row(2, "configured", NESTEROV), row(3, "average", AVERAGE),
            row(4, "average", AVERAGE)]
    spans = outer_spans(reversed(rows))
    assert [(s.first, s.last, s.name, s.step) for s in spans] == [(1, 2, "configured", NESTEROV),
                                                                  (3, 4, "average", AVERAGE)]
    assert describe_outer_steps(spans) == ("rounds 1-2: Nesterov SGD lr 0.7, momentum 0.9; rounds 3-4: plain "
                                           "average (lr 1, momentum 0) in the inner lr's decay")
    assert spans[0].to_json() == {"rounds": [1, 2], "outer_step": "configured", **NESTEROV.to_json()}


def test_rows_written_before_the_settings_were_recorded_say_so():
    old = {k: v for k, v in row(1, "average", AVERAGE).to_json().items() if k != "outer"}
    assert describe_rows([old], file=FILE) == "round 1: plain average (settings not recorded) in the inner lr's decay"


def numpy_outer_step(theta: np.ndarray, grad: np.ndarray, buffer: np.ndarray | None,
                     step: OuterStep) -> tuple[np.ndarray, np.ndarray | None]:
    """SGD with (Nesterov) momentum as torch writes it, from a zero buffer when there is none; no buffer
    is kept without momentum."""
    if step.momentum == 0:
        return theta - step.lr * grad, None
    buffer = grad if buffer is None else step.momentum * buffer + grad
    direction = grad + step.momentum * buffer if step.nesterov else buffer
    return theta - step.lr * direction, buffer


def test_the_outer_step_recorded_per_round_is_the_one_applied(tiny_routed, tmp_path):
    clock = Clock()
    run = make_run(tiny_routed, tmp_path / "run", ["inner.schedule=wsd", "outer.decay=average", "run.rounds=3",
                                                   "store.keep_versions=0"])
    config, store, topology = run.config, run.store, run.topology
    coordinator = run.coordinator(clock)
    islands = [run.island(f"i{k}", clock) for k in range(2)]
    rows = []
    for r in range(1, config.run.rounds + 1):
        drive(coordinator, islands, clock, until_round=r)
        rows.append(coordinator.last_stats)  # train.json's row (dipaco.stages.train appends the same)
    H = config.inner.steps
    decay_from = path_decay_from(config.inner, rounds=config.run.rounds, warm_start_steps=config.warm_start_steps)
    expected = ["average" if r * H > decay_from else "configured" for r in range(1, config.run.rounds + 1)]
    assert [r.outer_step for r in rows] == expected and set(expected) == {"configured", "average"}
    assert all(r.outer == read_manifest(store, r.round).outer for r in rows)  # the manifest's record

    shard = PathFactory(config, run.dir).path_sizes.shard_tokens
    buffers: dict[str, np.ndarray | None] = {}
    for stats in rows:
        step, manifest = stats.outer, read_manifest(store, stats.round)
        deltas = {e.path: read_result(store, round=stats.round, path=e.path, attempt=e.attempt)[0]
                  for e in manifest.applied}
        for name in topology.modules:
            paths = topology.paths_of_module(name)
            total = sum(shard[p] for p in paths)
            scale = math.sqrt(len(paths)) if step.rescale_by_paths else 1.0
            before, after = store.read_module(stats.round - 1, name), store.read_module(stats.round, name)
            for key, theta in before.items():
                grad = scale * sum(shard[p] / total * deltas[p][f"{name}/{key}"].double().numpy() for p in paths)
                got = after[key].double().numpy()
                want, buffers[f"{name}/{key}"] = numpy_outer_step(theta.double().numpy(), grad,
                                                                  buffers.get(f"{name}/{key}"), step)
                np.testing.assert_allclose(got, want, rtol=0, atol=2e-6, err_msg=f"round {stats.round} {name}/{key}")
                if stats.outer_step == "average":  # the configured step would have moved it elsewhere
                    other, _ = numpy_outer_step(theta.double().numpy(), grad, None, OuterStep.of(config.outer))
                    assert not np.allclose(got, other, rtol=0, atol=2e-6)
