"""`dipaco eval`'s bookkeeping: the steps each path trained come from what the committed rounds applied."""

import torch

from dipaco.stages.evaluate import steps_per_path
from dipaco.store.board import write_manifest
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import ManifestEntry, RoundManifest

STEP_TOKENS = 8 * 64  # batch x sequence length


def entry(path: int, base: int, *, steps: int = 4) -> ManifestEntry:
    return ManifestEntry(key=f"path-{path}-{base}", path=path, base=base, attempt=0, staleness=0,
                         tokens=steps * STEP_TOKENS, seconds=1.0, bytes=10, train_loss=3.0, val_loss_start=3.0,
                         factor=1.0)


def commit(store: ModuleStore, round: int, applied: list[ManifestEntry]) -> None:
    store.write_module(round, "m", {"w": torch.zeros(2)})
    write_manifest(store, RoundManifest(round=round, applied=tuple(applied), dropped=()))
    store.commit(round=round, levels=[2], modules=["m"])


def test_an_async_run_counts_the_steps_each_path_had_applied_not_its_versions(tmp_path):
    """Async: 5 versions, each closed on a quorum of 1 of 2 paths, apply 3 results of path 0 and 2 of path 1
    (one cut short at 2 of 4 steps): (3 x 4 + 4 + 2) / 2 = 9 steps per path, where versions x H says 20."""
    store = ModuleStore(str(tmp_path / "store"))
    store.write_module(0, "m", {"w": torch.zeros(2)})
    store.commit(round=0, levels=[2], modules=["m"])
    for round, applied in enumerate([[entry(0, 0)], [entry(1, 0)], [entry(0, 2)], [entry(1, 2, steps=2)],
                                     [entry(0, 4)]], start=1):
        commit(store, round, applied)
    assert steps_per_path(store, 2, tokens_per_step=STEP_TOKENS, fallback=5 * 4) == 9


def test_a_store_without_manifests_falls_back_to_versions_times_steps(tmp_path):
    store = ModuleStore(str(tmp_path / "store"))
    store.write_module(1, "m", {"w": torch.zeros(2)})
    store.commit(round=1, levels=[2], modules=["m"])
    assert steps_per_path(store, 2, tokens_per_step=STEP_TOKENS, fallback=4) == 4
