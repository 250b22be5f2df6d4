"""Retention: every deletion in the store happens here (`store.keep_versions`).

    keep = keep_from(7, keep_rounds=2)                                  # 6: versions 6 and 7 stay
    kept = prune_versions(store, keep_from=keep, keep_modules={3: {"embeddings", "level0.module1"}})
    prune_inner_states(store, n_paths=4, keep_from=keep, referenced={task.inner_from, ...})

- Module versions older than `keep_from` are deleted, except the modules `keep_modules` names in
  them: the modules of the paths whose best version it is (`dipaco.eval.early_stopping.needed_modules`),
  a shared module once however many paths need it. `prune_versions` returns the bytes kept that way.
- Outer-optimiser states (with the download residuals), published module updates and island results older
  than `keep_from` are deleted (the round manifests, small, are kept: they are the record of what each round
  applied). An island holding a version older than `keep_from` − 1 then reads its modules whole (the counted
  fallback, `dipaco.islands.island.held_modules`).
- Inner AdamW states of rounds older than `keep_from` are deleted unless a task or a path state still
  names them (the next task of a path starts from its latest state, however old).
- Staged versions no commit points to (`prune_orphans`: a deposed coordinator's outer step, a crashed one's
  half-written round) are deleted, modules, outer states, updates and manifests, whatever `keep_from`.
"""

from __future__ import annotations

from dipaco.store.board import all_inner_states, remove_inner, remove_results, result_rounds
from dipaco.store.module_store import ModuleStore


def keep_from(round: int, *, keep_rounds: int, at_least: int = 0) -> int | None:
    """The oldest version kept after `round` when the last `max(keep_rounds, at_least)` versions stay;
    None when `keep_rounds` is 0 (keep everything)."""
    if not keep_rounds:
        return None
    return round - max(keep_rounds, at_least) + 1


def prune_versions(store: ModuleStore, *, keep_from: int, keep_modules: dict[int, set[str]]) -> int:
    """Delete module, outer-state, update and result versions older than `keep_from`, except the module files
    `keep_modules` (`{version: module names}`) names. Returns the bytes of the module files kept that way."""
    for kind in ("outer", "updates"):
        for round in store.versions(kind):
            if round < keep_from:
                store.prune_version(kind, round)
    for round in result_rounds(store):
        if round < keep_from:
            remove_results(store, round)
    return sum(store.prune_version("modules", round, keep=keep_modules.get(round, set()))
               for round in store.versions("modules") if round < keep_from)


def prune_orphans(store: ModuleStore) -> list[str]:
    """Delete the staged module, outer-state and manifest versions no commit points to (`ModuleStore.orphans`);
    returns their store names. Only the coordinator holding the lease calls it (after its commit)."""
    orphans = [name for kind in ("modules", "outer", "updates", "rounds") for name in store.orphans(kind)]
    for name in orphans:
        store.remove(name)
    return orphans


def prune_inner_states(store: ModuleStore, *, n_paths: int, keep_from: int, referenced: set[str | None]) -> None:
    """Delete the inner states of rounds older than `keep_from` that no task or path state names (of
    paths 0 … n_paths − 1; one recursive listing of the store, not one per path)."""
    states = all_inner_states(store)
    for path in range(n_paths):
        for round, ref in states.get(path, []):
            if round < keep_from and ref not in referenced:
                remove_inner(store, ref)
