"""A round's outer step as the round policy planned it (`dipaco.rounds.plan.RoundPlan`), written to the store.

    manifest = apply_round(store, topology, round=t, pending=tasks, config=cfg.outer, plan=plan, sizes=sizes)

Per module: the weighted average of its contributions' pseudo-gradients (`dipaco.optim.weighting`), then
the outer update (`dipaco.optim.outer`); a module no result touches is carried over unchanged. With a
download codec (`compression.download: update`) each changed module's update is published and the committed
version is the one it defines (`downloads.UpdatePublisher`: before − d, as the islands rebuild it); with
`compression.download: results` a plain average publishes its results' bytes instead (v − Σ w_i Δ_i). It streams
module by module and result by result (one module's bytes of one result at a time, `ResultReader`), so
memory holds a few copies of one module whatever the grid (docs/islands.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from dipaco.codec.codec import Codec
from dipaco.codec.contributions import Contribution
from dipaco.config import OuterConfig, RoundsConfig
from dipaco.islands.coordinator.downloads import UpdatePublisher
from dipaco.model.topology import Topology
from dipaco.optim.outer import combine_streamed, outer_update
from dipaco.optim.weighting import PathSizes, result_weights
from dipaco.rounds.inputs import Grid, Result
from dipaco.rounds.plan import RoundPlan
from dipaco.rounds.policy import RoundPolicy
from dipaco.store.board import ResultReader, read_result_meta
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import ManifestEntry, OuterStep, ResultMeta, RoundManifest, Task


def apply_round(store: ModuleStore, topology: Topology, *, round: int, pending: list[Task],
                config: OuterConfig, plan: RoundPlan | None = None, sizes: PathSizes | None = None,
                norms: dict[str, tuple[float, float]] | None = None,
                metas: dict[str, ResultMeta] | None = None,
                digests: dict[str, dict[str, str] | None] | None = None,
                check_lease: Callable[[], None] | None = None, download: Codec | None = None,
                final: bool = False, gather: bool = False) -> RoundManifest:
    """Outer step for `round` from the received, not yet applied tasks `pending`; stages module (and
    momentum) version `round` (under the store's lease token: `ModuleStore.fence`) and returns the manifest
    (not written) of what it applied and dropped and of the step every module took (`outer`: `config`'s settings).
    `plan` is the round policy's (the coordinator's); without one, the plan of a policy that has seen
    only `pending` (sync). `sizes`: each path's training-shard tokens, for `outer.weighting: shard`. `metas`: the
    results' metadata by task key where the caller has read it already (the coordinator, when it validated
    them); the others are read here. Streams module by module (module docstring): memory holds a few copies of one module.
    `norms`, when given, receives each updated module's (outer gradient norm, parameter update norm).
    `digests`: by task key, the sha256 of the bytes its checks read; any other byte raises `ResultChanged`
    (nothing is committed; the caller redoes that result). A module that would not be finite after the
    outer step raises a RuntimeError naming it and its results (nothing is committed). `check_lease` is called
    before each module is written (the coordinator's `Lease.renew`: `LeaseLost` once another took over).
    `download`: the codec of the module updates it publishes (None: none, islands read whole modules); `final`:
    this version is the run's last, whose updates flush the download residual in full; `gather`: a module
    whose step is a plain average is published as its results' bytes (`compression.download: results`)."""
    tasks = {task.key: task for task in pending}
    metas = _read_metas(store, pending, metas or {})
    if plan is None:
        plan = _plan_alone(topology, round=round, tasks=tasks, metas=metas)
    if plan.round != round:
        raise ValueError(f"the plan is for round {plan.round}, not {round}")
    applied, dropped, readers = _entries(store, plan, tasks=tasks, metas=metas, digests=digests or {})
    publisher = UpdatePublisher(store, codec=download, final=final, gather=gather) if download is not None else None
    floats = {name: _step_module(store, name, round=round, plan=plan, readers=readers, config=config, sizes=sizes,
                                 n_paths=topology.n_paths, norms=norms, publisher=publisher, check_lease=check_lease)
              for name in topology.modules}  # module -> its parameters

    def counted(entry: ManifestEntry) -> ManifestEntry:
        return dataclasses.replace(entry, float32_bytes=4 * sum(floats[m] for m in topology.modules_of_path(entry.path)))

    return RoundManifest(round=round, applied=tuple(map(counted, applied)), dropped=tuple(map(counted, dropped)),
                         outer=OuterStep.of(config), downloads=publisher.summary() if publisher is not None else None)


def _read_metas(store: ModuleStore, pending: list[Task], known: dict[str, ResultMeta]) -> dict[str, ResultMeta]:
    """Each pending task's result metadata (`known`'s where given), in a fixed order (path, base, key)."""
    return {task.key: known.get(task.key) or read_result_meta(store, round=task.round, path=task.path,
                                                              attempt=task.result_attempt, link=task.link)
            for task in sorted(pending, key=lambda t: (t.path, t.base, t.key))}


def _plan_alone(topology: Topology, *, round: int, tasks: dict[str, Task], metas: dict[str, ResultMeta]) -> RoundPlan:
    """The plan of a round policy that has seen only these results (sync, no coordinator)."""
    policy = RoundPolicy(Grid.of(topology), RoundsConfig(), committed=round - 1)
    for key, meta in metas.items():
        policy.received(Result(key=key, path=tasks[key].path, base=tasks[key].base, tokens=meta.tokens, arrived=0.0,
                               steps=meta.steps))
    return policy.plan()


def _entries(store: ModuleStore, plan: RoundPlan, *, tasks: dict[str, Task], metas: dict[str, ResultMeta],
             digests: dict[str, dict[str, str] | None]) -> tuple[list, list, dict[str, ResultReader]]:
    """The manifest entries the plan applies and drops, and a reader of each applied result (its header read)."""
    applied, dropped, readers = [], [], {}
    for verdict in plan.verdicts:
        task, meta = tasks[verdict.key], metas[verdict.key]
        entry = ManifestEntry(key=task.key, path=task.path, base=task.base, attempt=task.result_attempt,
                              staleness=verdict.staleness, tokens=meta.tokens, seconds=meta.seconds, bytes=meta.bytes,
                              train_loss=meta.train_loss, val_loss_start=meta.val_loss_start, factor=verdict.factor,
                              link=task.link, steps=meta.steps, island=meta.island,
                              private_staleness=verdict.private_staleness, private_factor=verdict.private_factor,
                              module_fallbacks=meta.module_fallbacks)
        if verdict.factor is None:
            dropped.append(entry)
            continue
        readers[task.key] = ResultReader(store, meta, digests=digests.get(task.key))  # reads the header only
        spans = readers[task.key].index.spans
        applied.append(dataclasses.replace(entry, module_bytes={m: end - start for m, (start, end) in spans.items()}))
    return applied, dropped, readers


def _step_module(store: ModuleStore, name: str, *, round: int, plan: RoundPlan, readers: dict[str, ResultReader],
                 config: OuterConfig, sizes: PathSizes | None, n_paths: int,
                 norms: dict[str, tuple[float, float]] | None, publisher: UpdatePublisher | None,
                 check_lease: Callable[[], None] | None) -> int:
    """Module `name`'s outer step from its results (streamed one at a time), its update published, then staged
    with its momentum; returns its parameter count."""
    sharing = plan.modules[name]  # each result's tokens and this module's staleness factor
    before = params = store.read_module(round - 1, name)
    momentum = store.read_outer_state(round - 1, name)
    if sharing and publisher is not None and publisher.gathers(round, name, config):
        params, momentum = _gather_module(name, before, round=round, plan=plan, readers=readers, config=config,
                                          sizes=sizes, n_paths=n_paths, publisher=publisher), {}
        outer_grad = {k: before[k].float() - params[k] for k in params}
    else:
        outer_grad = None
        if sharing:
            weights, total = result_weights(sharing, n_paths=n_paths, sizes=sizes, config=config)
            deltas = (readers[e.key].module(name) for e in sharing)  # read one at a time, as the sum needs them
            outer_grad = combine_streamed(deltas, weights, total=total, rescale_by_paths=config.rescale_by_paths,
                                          paths=plan.paths_through[name])
            params, momentum = outer_update(params, momentum, outer_grad, config)
        if publisher is not None:  # the version the published update defines (a module untouched: unchanged)
            params = publisher.publish(round, name, before=before, after=params if outer_grad is not None else None)
    if outer_grad is not None and not all(bool(torch.isfinite(t).all()) for t in params.values()):
        raise RuntimeError(f"round {round}: module {name} would not be finite after the outer step of "
                           f"{[e.key for e in sharing]}; nothing was committed")
    if outer_grad is not None and norms is not None:
        norms[name] = (_norm(outer_grad.values()), _norm(params[k] - before[k] for k in params))
    if check_lease is not None:
        check_lease()
    store.write_module(round, name, params)
    if momentum:
        store.write_outer_state(round, name, momentum)
    return sum(t.numel() for t in before.values())


def _gather_module(name: str, before: dict[str, torch.Tensor], *, round: int, plan: RoundPlan,
                   readers: dict[str, ResultReader], config: OuterConfig, sizes: PathSizes | None, n_paths: int,
                   publisher: UpdatePublisher) -> dict[str, torch.Tensor]:
    """Module `name`'s version `round` as a plain weighted average of its results, published as those results'
    bytes (`UpdatePublisher.publish_results`): `before` − Σ w_i Δ_i."""
    sharing = plan.modules[name]
    weights, total = result_weights(sharing, n_paths=n_paths, sizes=sizes, config=config)
    contributions = []
    for entry, weight in zip(sharing, weights, strict=True):
        reader = readers[entry.key]
        chunk = reader.module_bytes(name)  # the bytes acceptance decoded and checked (`digests`), else ResultChanged
        contributions.append((Contribution.of(key=entry.key, file=reader.name, span=reader.index.spans[name],
                                              index=reader.index, module=name, weight=weight / total, chunk=chunk),
                              chunk))
    return publisher.publish_results(round, name, before=before, contributions=contributions)


def _norm(tensors) -> float:
    """The L2 norm of several tensors taken together."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))

