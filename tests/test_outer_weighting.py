"""The outer step's weights (`outer.weighting`, `outer.normalize`) against an independent computation:
the expected modules are written out in numpy from the shard sizes and the results' records (here and in
`tests/outer_rounds.py`), not computed by `dipaco.optim.weighting`. One rule under every weighting: a
path carries one weight per round whatever the number of its results, and a result cut short weighs
once for its fraction (its Δ holds only the steps it trained).

A 2x2 grid: `embeddings` is in all four paths, each level module in two (path p = 2i + j takes
level0.module{i} and level1.module{j}). The shards are unequal, as routing leaves them.
"""

import json

import numpy as np
import pytest
import torch
from outer_rounds import SHARD_TOKENS as ROUNDS_SHARDS
from outer_rounds import STEP_TOKENS, OuterRounds

from dipaco.config import OuterConfig, RoundsConfig, load_config
from dipaco.islands.coordinator.outer_step import apply_round
from dipaco.islands.coordinator.service import Coordinator, CoordinatorSettings
from dipaco.model.topology import Topology
from dipaco.optim.weighting import PathSizes, result_weights
from dipaco.pipeline.context import PathFactory
from dipaco.store.board import write_result
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import ManifestEntry, ResultMeta, Task

SEQ, BATCH, STEPS = 256, 8, 25
TASK_TOKENS = STEPS * BATCH * SEQ  # 51,200: what the demo's task trains
SHARD_BLOCKS = (9001, 4627, 3100, 12000)  # training blocks per path; 9,001 and 4,627 are the demo's paths 0 and 1
SHARD_TOKENS = tuple(b * SEQ for b in SHARD_BLOCKS)
PATHS_OF = {"embeddings": (0, 1, 2, 3), "level0.module0": (0, 1), "level0.module1": (2, 3),
            "level1.module0": (0, 2), "level1.module1": (1, 3)}


def grid() -> Topology:
    return Topology(levels=(2, 2), level_blocks=((0,), (1,)), private_blocks=frozenset(), private_embeddings=False)


def write_round(store: ModuleStore, topology: Topology, trained: dict[int, int]) -> tuple[dict, dict]:
    """Module version 0 and one result per path (`trained[p]` tokens, one step); returns θ_0 and Δ_p per module, float64."""
    g = torch.Generator().manual_seed(7)
    theta = {name: torch.randn(3, 5, generator=g) for name in PATHS_OF}
    for name, w in theta.items():
        store.write_module(0, name, {"w": w})
    deltas: dict[str, dict[int, np.ndarray]] = {name: {} for name in PATHS_OF}
    for path, tokens in trained.items():
        delta = {name: torch.randn(3, 5, generator=g) * 0.01 for name in topology.modules_of_path(path)}
        task = Task(path=path, base=0, attempt=0, status="received", island="test", incarnation="x",
                    step_offset=0, inner_from=None, result_attempt=0)
        meta = ResultMeta(path=path, round=1, base=0, attempt=0, tokens=tokens, train_loss=3.0, losses=(3.0,),
                          val_loss_start=3.5, seconds=1.0, bytes_down_modules=0, bytes_down_inner=0,
                          inner_state_local=False, data_parallel_ranks=1)
        write_result(store, task, {f"{m}/w": d for m, d in delta.items()}, meta, compression="none", level=1)
        for name, d in delta.items():
            deltas[name][path] = d.double().numpy()
    return {n: w.double().numpy() for n, w in theta.items()}, deltas


def tasks(paths) -> list[Task]:
    return [Task(path=p, base=0, attempt=0, status="received", island="test", incarnation="x", step_offset=0,
                 inner_from=None, result_attempt=0) for p in paths]


@pytest.mark.parametrize("normalize", ["module", "all"])
@pytest.mark.parametrize("rescale", [False, True])
def test_unequal_shards_match_the_written_out_average(tmp_path, normalize, rescale):
    topology, store = grid(), ModuleStore(str(tmp_path / "store"))
    # path 3's island trained a third of what the others did: its Δ holds that, its weight is its shard's
    trained = {0: 3 * TASK_TOKENS, 1: 3 * TASK_TOKENS, 2: 3 * TASK_TOKENS, 3: TASK_TOKENS}
    theta, deltas = write_round(store, topology, trained)
    config = OuterConfig(lr=1.0, momentum=0.0, rescale_by_paths=rescale, weighting="shard", normalize=normalize)
    apply_round(store, topology, round=1, pending=tasks(range(4)), config=config,
                sizes=PathSizes(shard_tokens=SHARD_TOKENS, step_tokens=BATCH * SEQ))

    d = [9001 * 256, 4627 * 256, 3100 * 256, 12000 * 256]  # |D_p|
    everything = 9001 * 256 + 4627 * 256 + 3100 * 256 + 12000 * 256  # all paths' shards, whole tasks
    for name, paths in PATHS_OF.items():
        z = sum(d[p] for p in paths) if normalize == "module" else everything
        s = np.sqrt(len(paths)) if rescale else 1.0
        expected = theta[name] - s * sum(d[p] / z * deltas[name][p] for p in paths)
        got = store.read_module(1, name)["w"].double().numpy()
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("rescale", [False, True])
def test_all_paths_normalisation_gives_a_half_shared_module_half_the_step(tmp_path, rescale):
    """Equal shards: a level module in 2 of 4 paths moves by Σα = 0.5 of its average (× √2 ≈ 0.71 with the
    rescale), the embedding by 1 (× √4 = 2); per-module normalisation gives 1 and 1 (√2 and 2 with it).
    The weights, then the step the outer optimiser takes with them (lr 1, momentum 0)."""
    topology = grid()
    equal = PathSizes(shard_tokens=(1000,) * 4, step_tokens=BATCH * SEQ)
    for normalize, level_scale in (("all", 0.5), ("module", 1.0)):
        for name, paths in PATHS_OF.items():
            entries = [entry(p) for p in paths]
            weights, total = result_weights(entries, n_paths=topology.n_paths, sizes=equal,
                                            config=OuterConfig(normalize=normalize))
            assert sum(weights) / total == pytest.approx(1.0 if name == "embeddings" else level_scale)
        store = ModuleStore(str(tmp_path / normalize))
        theta, deltas = write_round(store, topology, {p: TASK_TOKENS for p in range(4)})
        config = OuterConfig(lr=1.0, momentum=0.0, rescale_by_paths=rescale, weighting="shard", normalize=normalize)
        apply_round(store, topology, round=1, pending=tasks(range(4)), config=config, sizes=equal)
        for name, paths in PATHS_OF.items():
            moved = (1.0 if name == "embeddings" else level_scale) * (np.sqrt(len(paths)) if rescale else 1.0)
            average = np.mean([deltas[name][p] for p in paths], axis=0)
            np.testing.assert_allclose(store.read_module(1, name)["w"].double().numpy(), theta[name] - moved * average,
                                       rtol=0, atol=1e-6, err_msg=f"{normalize} {name}")


def entry(path: int, *, tokens: int = TASK_TOKENS, steps: int | None = STEPS, factor: float = 1.0) -> ManifestEntry:
    return ManifestEntry(key=f"{path}", path=path, base=0, attempt=0, staleness=0, tokens=tokens, seconds=1.0,
                         bytes=0, train_loss=3.0, val_loss_start=3.0, factor=factor, steps=steps)


def test_weights_by_hand_for_every_setting():
    sizes = PathSizes(shard_tokens=SHARD_TOKENS, step_tokens=BATCH * SEQ)
    cut, stale = entry(1, tokens=10 * BATCH * SEQ, steps=10), entry(2, factor=0.5)  # cut at 10 of 25 steps; stale
    wide = entry(3, tokens=2 * TASK_TOKENS)  # a data-parallel island of 2 ranks: twice the batch per step
    entries = [entry(0), cut, stale, wide]

    def weights(weighting, normalize):
        return result_weights(entries, n_paths=4, sizes=sizes,
                              config=OuterConfig(weighting=weighting, normalize=normalize))

    # the cut result weighs its path's whole weight (its Δ holds only its 10 steps); Z leaves the staleness
    # factor out: the stale result is discounted, not just re-weighted
    shard = [2304256.0, 1184512.0, 793600.0 * 0.5, 3072000.0]
    assert weights("shard", "module") == (pytest.approx(shard), pytest.approx(sum(SHARD_TOKENS)))
    assert weights("shard", "all") == (pytest.approx(shard), pytest.approx(sum(SHARD_TOKENS)))
    tokens = [2048.0, 2048.0, 1024.0, 4096.0]  # tokens per inner step
    assert weights("tokens", "module") == (pytest.approx(tokens), pytest.approx(2048 * 5))
    assert weights("tokens", "all") == (pytest.approx(tokens), pytest.approx(4 * 2048))
    assert weights("uniform", "module") == (pytest.approx([1.0, 1.0, 0.5, 1.0]), pytest.approx(4.0))
    assert weights("uniform", "all") == (pytest.approx([1.0, 1.0, 0.5, 1.0]), pytest.approx(4.0))
    alone = result_weights([stale], n_paths=4, sizes=sizes, config=OuterConfig())
    assert alone == ([793600.0 * 0.5], 793600.0)  # a stale result alone in a module moves it by half its Δ
    with pytest.raises(ValueError, match="result 0 of path 0 does not say how many steps"):
        result_weights([entry(0, steps=None)], n_paths=4, sizes=sizes, config=OuterConfig(weighting="tokens"))


@pytest.mark.parametrize("weighting", ["shard", "tokens", "uniform"])
def test_a_path_with_two_results_in_a_round_weighs_once(tmp_path, weighting):
    """Async, the default outer step (Nesterov lr 0.7, momentum 0.9, per-module average). Round 1: path 1
    reports twice from version 0 (its second task chained on its first). Round 2: path 1's third result
    (chained on both, one version stale), path 3 twice, both cut (10 and 8 of 25 steps), and path 0 from a
    data-parallel island of 2 ranks. Every module of both versions equals the numpy composition: one weight
    per path whatever the number of its results, momentum carried across rounds."""
    rounds = OuterRounds(tmp_path, rounds=RoundsConfig(mode="async"), outer=OuterConfig(weighting=weighting))
    for path in (0, 2, 3):
        rounds.report(rounds.open(path))
    first, second = rounds.report(rounds.open(1)), rounds.report(rounds.open(1))
    third = rounds.open(1)  # opened at once, before round 1 closes: from version 0, chained on both
    manifest = rounds.close()
    assert sorted(e.key for e in manifest.applied if e.path == 1) == [first, second]
    rounds.assert_matches()
    rounds.report(third)
    rounds.report(rounds.open(3), steps=10)
    rounds.report(rounds.open(3), steps=8)
    rounds.report(rounds.open(0), ranks=2)
    manifest = rounds.close()
    assert len(manifest.applied) == 4 and not manifest.dropped
    rounds.assert_matches()


@pytest.mark.parametrize("weighting", ["shard", "tokens"])
@pytest.mark.parametrize("normalize", ["module", "all"])
def test_a_cut_result_weighs_once_for_its_fraction(tmp_path, weighting, normalize):
    """Async: path 3's task is cut after 15 of its 25 steps. Its Δ holds those 15 steps, and its weight is
    its path's whole one (|D_3|, or the tokens per step it trained), not 0.6 of it: a fraction f counts
    once, not f². Checked on every module against the numpy composition, and written out on level0.module1
    (paths 2 and 3) with plain averaging."""
    outer = OuterConfig(lr=1.0, momentum=0.0, weighting=weighting, normalize=normalize)
    rounds = OuterRounds(tmp_path, rounds=RoundsConfig(mode="async"), outer=outer)
    before = rounds.store.read_module(0, "level0.module1")["w"].double().numpy()
    keys = {path: rounds.report(rounds.open(path), steps=15 if path == 3 else 25) for path in range(4)}
    rounds.close()
    rounds.assert_matches()
    delta = {p: rounds.results[keys[p]].delta["level0.module1"] for p in (2, 3)}
    w = {p: ROUNDS_SHARDS[p] if weighting == "shard" else STEP_TOKENS for p in (2, 3)}
    z = w[2] + w[3] if normalize == "module" else (sum(ROUNDS_SHARDS) if weighting == "shard" else 4 * STEP_TOKENS)
    got = rounds.store.read_module(1, "level0.module1")["w"].double().numpy()
    np.testing.assert_allclose(got, before - (w[2] * delta[2] + w[3] * delta[3]) / z, rtol=0, atol=1e-6)


def test_diloco_replicas_weigh_by_their_share_of_the_documents():
    """Replicas of one path share every module; each one's |D| is its random share of the path's documents,
    so both normalisations give the same weighted average."""
    topology = Topology(levels=(1,), level_blocks=((0, 1),), private_blocks=frozenset(), private_embeddings=False,
                        replicas=4)
    shares = PathSizes(shard_tokens=(600, 500, 400, 500), step_tokens=BATCH * SEQ)
    for name in topology.modules:
        entries = [entry(p) for p in topology.paths_of_module(name)]
        for normalize in ("module", "all"):
            weights, total = result_weights(entries, n_paths=topology.n_paths, sizes=shares,
                                            config=OuterConfig(normalize=normalize))
            assert [w / total for w in weights] == pytest.approx([0.3, 0.25, 0.2, 0.25])


def test_shard_weighting_needs_the_shard_sizes(tmp_path):
    with pytest.raises(ValueError, match="shard size"):
        result_weights([entry(0)], n_paths=4, sizes=None, config=OuterConfig())
    with pytest.raises(ValueError, match="3 shard sizes for a grid of 4"):
        result_weights([entry(0)], n_paths=4, sizes=PathSizes(shard_tokens=(1, 2, 3), step_tokens=1),
                       config=OuterConfig())
    assert result_weights([entry(0)], n_paths=4, sizes=None, config=OuterConfig(weighting="uniform")) == ([1.0], 1.0)
    with pytest.raises(ValueError, match="must hold tokens"):
        PathSizes(shard_tokens=(10, 0), step_tokens=5)
    config = load_config(None, [])
    with pytest.raises(ValueError, match="needs the shard size of each of the 4 paths"):
        Coordinator(ModuleStore(str(tmp_path)), grid(), settings=CoordinatorSettings.from_config(config))
    with pytest.raises(ValueError, match="outer.normalize must be one of"):
        OuterConfig(normalize="paths")
    with pytest.raises(ValueError, match="outer.weighting must be one of"):
        OuterConfig(weighting="size")


def test_the_coordinator_reads_shard_sizes_from_the_index(tiny_routed):
    """What `dipaco train` gives the coordinator: the train tokens the shard index records per path."""
    config = load_config(tiny_routed.config, [])
    sizes = PathFactory(config, tiny_routed).path_sizes
    index = json.loads((tiny_routed.shards / "index.json").read_text())
    assert sizes.shard_tokens == tuple(p["train"]["blocks"] * index["seq_len"] for p in index["paths"])
    assert len(set(sizes.shard_tokens)) > 1  # routing left the tiny shards unequal
    assert sizes.step_tokens == config.inner.batch_size * index["seq_len"]
