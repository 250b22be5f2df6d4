"""A chained result's private progress is applied in full (async): a path's task continues from the
newest version plus its results not yet applied (`Task.chain`), so those results are the progress it
continues, not updates it missed, and do not make its private modules stale. Through the real round
policy and `apply_round` on a store, against the numpy composition of `tests/outer_rounds.py`.
"""

import pytest
from outer_rounds import OuterRounds

from dipaco.config import OuterConfig, RoundsConfig
from dipaco.store.board import result_ref, result_ref_key
from dipaco.store.module_store import StoreError
from dipaco.store.records import task_key


@pytest.mark.parametrize("power", [0.0, 1.0])
def test_a_chain_of_five_results_applies_the_sixths_private_progress_in_full(tmp_path, power):
    """Path 0 trains 5 tasks while round 1 cannot close, and its 6th from version 0, chained on all five.
    Round 1 applies the five, round 2 the sixth: one version stale for the shared modules (factor 2^−power),
    not stale at all for its private embedding, which moves by its whole Δ (before, with the default
    rounds.max_staleness 4, it did not move while the manifest said "applied, factor 1.0")."""
    rounds = OuterRounds(tmp_path, rounds=RoundsConfig(mode="async", staleness_power=power), outer=OuterConfig())
    chain = [rounds.report(rounds.open(0)) for _ in range(5)]
    sixth = rounds.open(0)
    assert sixth.base == 0 and set(map(result_ref_key, sixth.chain)) == set(chain)
    for path in (1, 2, 3):
        rounds.report(rounds.open(path))
    manifest = rounds.close()
    assert sorted(e.key for e in manifest.applied if e.path == 0) == sorted(chain)
    rounds.assert_matches()
    rounds.report(sixth)
    for path in (1, 2, 3):
        rounds.report(rounds.open(path))
    manifest = rounds.close()
    rounds.assert_matches()
    (entry,) = [e for e in manifest.applied if e.path == 0]
    assert (entry.staleness, entry.factor) == (1, pytest.approx(2.0 ** -power))
    assert (entry.private_staleness, entry.private_factor) == (0, 1.0)
    moved = rounds.store.read_module(2, "path000.embeddings")["w"] - rounds.store.read_module(1, "path000.embeddings")["w"]
    assert float(moved.abs().max()) > 1e-3  # the private module moved


def test_a_result_ref_names_its_task():
    """The island rebases on `Task.chain`'s references; the policy knows results by task key."""
    for path, base, link, attempt in [(0, 0, 0, 0), (3, 7, 2, 1), (12, 40, 0, 3)]:
        assert result_ref_key(result_ref(round=base + 1, path=path, attempt=attempt, link=link)) == task_key(path, base, link)
    with pytest.raises(StoreError, match="'results/x' is not a result reference"):
        result_ref_key("results/x")
