"""An elastic worker's wall time by kind (dipaco/islands/island/elastic_time.py): the line it logs, read back."""

import pytest


def test_a_workers_time_line_reads_back_by_kind():
    from dipaco.islands.island.elastic_time import KINDS, WorkerTime, parse_line

    spent = WorkerTime()
    spent.since -= 1.5
    spent.add("heal")
    text = f"earlier line\n12:00:00 x INFO: island e0 (e0-w1): {WorkerTime().line()}\n... {spent.line()}\nlast line\n"
    assert parse_line(text) == {kind: 1.5 if kind == "heal" else 0.0 for kind in KINDS}  # the last line, whole
    assert parse_line("no such line") is None
    with pytest.raises(ValueError, match="unknown kind of worker time 'napping'"):
        spent.add("napping")
    spent.since -= 0.5
    spent.add("sync", paced=0.2)  # an all-reduce of 0.5 s of which the pace covered 0.2 s: 0.3 s of waiting
    assert spent.seconds["sync"] == pytest.approx(0.3, abs=0.01) and spent.seconds["steps"] == pytest.approx(0.2)
