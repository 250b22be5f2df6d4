"""The protocol records: JSON round trips, and validation on read that names the file and the field."""

import dataclasses
import json
import math

import pytest

from dipaco.store.module_store import StoreError
from dipaco.store.records import (
    Board,
    Heartbeat,
    ManifestEntry,
    OuterStep,
    PathState,
    ResultMeta,
    RoundManifest,
    RoundStats,
    Task,
)

FILE = "/store/some-file.json"


def through_json(obj: dict) -> dict:
    return json.loads(json.dumps(obj))


def examples() -> list:
    task = Task.open(path=3, base=1, step_offset=8, inner_from="islands/path-0003/inner-round-000001.safetensors")
    entry = ManifestEntry(key=task.key, path=3, base=1, attempt=0, staleness=0, tokens=512, seconds=1.5, bytes=1000,
                          train_loss=4.0, val_loss_start=4.5, factor=1.0)
    manifest = RoundManifest(round=2, applied=(entry,), dropped=(),
                             outer=OuterStep(lr=0.7, momentum=0.9, nesterov=True, rescale_by_paths=False))
    return [
        task,
        Board(round=1, tasks={task.key: task}, paths={3: PathState(steps_done=8, inner=None)}),
        Heartbeat(island="island-0", incarnation="ab12", seq=7, status="training", task=task.key, pinned=(),
                  last_path=3, finished=(), time=1.5e9, failures=1),
        ResultMeta(path=3, round=2, base=1, attempt=0, tokens=512, train_loss=4.0, losses=(4.2, 4.0),
                   val_loss_start=4.5, seconds=1.5, bytes_down_modules=10, bytes_down_inner=0, inner_state_local=True,
                   data_parallel_ranks=1, island="island-0", finished=1.5e9, bytes_up_inner=5, bytes=1000,
                   compression="int8", file="path-0003.int8.safetensors"),
        manifest,
        RoundStats.of(manifest, in_flight=2),
    ]


@pytest.mark.parametrize("record", examples(), ids=lambda r: type(r).__name__)
def test_records_round_trip_through_json(record):
    obj = through_json(record.to_json())
    assert obj["schema"] == type(record).SCHEMA == (2 if isinstance(record, ResultMeta) else 1)
    assert type(record).from_json(obj, file=FILE) == record


@pytest.mark.parametrize("record", examples(), ids=lambda r: type(r).__name__)
def test_a_wrong_schema_version_or_a_missing_field_names_the_file(record):
    cls = type(record)
    obj = through_json(record.to_json())
    other = cls.SCHEMA + 1
    with pytest.raises(StoreError, match=f"{cls.__name__} in {FILE}: schema version {other}; this dipaco reads version {cls.SCHEMA}"):
        cls.from_json({**obj, "schema": other}, file=FILE)
    with pytest.raises(StoreError, match=f"{FILE}: missing field 'schema'"):
        cls.from_json({k: v for k, v in obj.items() if k != "schema"}, file=FILE)
    field = next(k for k in obj if k != "schema")
    with pytest.raises(StoreError, match=f"{cls.__name__} in {FILE}: missing field '{field}'"):
        cls.from_json({k: v for k, v in obj.items() if k != field}, file=FILE)
    with pytest.raises(StoreError, match=f"{FILE}: unexpected field 'extra'"):
        cls.from_json({**obj, "extra": 1}, file=FILE)


def test_a_wrong_type_names_the_field_even_inside_another_record():
    task, board = examples()[:2]
    obj = through_json(board.to_json())
    obj["tasks"][task.key]["step_offset"] = "8"
    with pytest.raises(StoreError, match=rf"{FILE}: field 'tasks\[{task.key}\]\.step_offset' should be an integer"):
        Board.from_json(obj, file=FILE)
    beat = through_json(examples()[2].to_json())
    with pytest.raises(StoreError, match=r"field 'status' is 'down', not one of \['idle', 'training', 'done'\]"):
        Heartbeat.from_json({**beat, "status": "down"}, file=FILE)
    with pytest.raises(StoreError, match="field 'seq' should be an integer, got True"):
        Heartbeat.from_json({**beat, "seq": True}, file=FILE)
    with pytest.raises(StoreError, match=r"field 'applied\[0\]\.tokens' should be an integer"):
        manifest = through_json(examples()[4].to_json())
        manifest["applied"][0]["tokens"] = 1.5
        RoundManifest.from_json(manifest, file=FILE)


def test_numbers_accept_ints_and_nan_and_tasks_derive_their_key():
    entry = through_json(examples()[4].to_json())["applied"][0]
    back = ManifestEntry.from_json({**entry, "seconds": 2, "val_loss_start": float("nan")}, file=FILE)
    assert back.seconds == 2.0 and isinstance(back.seconds, float) and math.isnan(back.val_loss_start)
    task = examples()[0]
    assert task.key == "path-0003-round-000002" and task.round == 2 and task.status == "open"


def test_a_round_stats_row_written_before_cancellation_existed_still_loads():
    """RoundStats.cancelled was added within schema 1 (`ADDED`): an old train.json row or state.json
    "stats" without it reads as 0 cancelled; a field that is not `ADDED` is still refused when missing."""
    manifest = examples()[4]
    stats = RoundStats.of(manifest, in_flight=2, cancelled=3)
    obj = through_json(stats.to_json())
    assert obj["cancelled"] == 3 and RoundStats.from_json(obj, file=FILE) == stats
    old = {k: v for k, v in obj.items() if k != "cancelled"}
    assert RoundStats.from_json(old, file=FILE) == RoundStats.of(manifest, in_flight=2)
    with pytest.raises(StoreError, match="missing field 'in_flight'"):
        RoundStats.from_json({k: v for k, v in old.items() if k != "in_flight"}, file=FILE)
    cancelled = dataclasses.replace(Task.open(path=0, base=0, step_offset=0, inner_from=None), status="cancelled",
                                    island="a", incarnation="x")
    board = Board(round=3, tasks={cancelled.key: cancelled}, paths={})
    assert Board.from_json(through_json(board.to_json()), file=FILE) == board


def test_round_stats_say_which_outer_step_the_round_took():
    """RoundStats.outer_step (added within schema 1): "average" for a plain average in the inner lr's decay,
    "configured" otherwise and for a row written before the field existed; another value is refused."""
    manifest = examples()[4]
    averaged = RoundStats.of(manifest, in_flight=0, outer_step="average")
    obj = through_json(averaged.to_json())
    assert obj["outer_step"] == "average" and RoundStats.from_json(obj, file=FILE) == averaged
    old = {k: v for k, v in obj.items() if k != "outer_step"}
    assert RoundStats.from_json(old, file=FILE).outer_step == "configured"
    with pytest.raises(StoreError, match="outer_step.*not one of"):
        RoundStats.from_json({**obj, "outer_step": "nesterov"}, file=FILE)


def test_manifests_and_rows_record_the_outer_step_s_settings():
    """RoundManifest.outer (apply_round's step) is copied into the round's row; both are None in files
    written before it was recorded, and read back as such."""
    manifest = examples()[4]
    stats = RoundStats.of(manifest, in_flight=0)
    assert stats.outer == manifest.outer == OuterStep(lr=0.7, momentum=0.9, nesterov=True, rescale_by_paths=False)
    for record in (manifest, stats):
        old = {k: v for k, v in through_json(record.to_json()).items() if k != "outer"}
        assert type(record).from_json(old, file=FILE).outer is None
    with pytest.raises(StoreError, match="outer.lr"):
        RoundManifest.from_json({**manifest.to_json(), "outer": {**manifest.outer.to_json(), "lr": "0.7"}}, file=FILE)
