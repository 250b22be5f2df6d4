"""Shard-size weighting of the outer step (`outer.weighting: shard`, `outer.normalize`) against an
independent computation: the expected modules are written out below in numpy from the shard sizes,
not computed by `dipaco.optim.weighting`.

A 2x2 grid: `embeddings` is in all four paths, each level module in two (path p = 2i + j takes
level0.module{i} and level1.module{j}). The shards are unequal, as routing leaves them.
"""

import json

import numpy as np
import pytest
import torch

from dipaco.config import OuterConfig, load_config
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
    """Module version 0 and one result per path (`trained[p]` tokens); returns θ_0 and Δ_p per module, float64."""
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
def test_unequal_shards_with_a_partial_task_match_the_written_out_average(tmp_path, normalize, rescale):
    topology, store = grid(), ModuleStore(str(tmp_path / "store"))
    # path 3's island stopped after 15 of its 25 steps: 0.6 of the task
    trained = {0: TASK_TOKENS, 1: TASK_TOKENS, 2: TASK_TOKENS, 3: 15 * BATCH * SEQ}
    theta, deltas = write_round(store, topology, trained)
    config = OuterConfig(lr=1.0, momentum=0.0, rescale_by_paths=rescale, weighting="shard", normalize=normalize)
    apply_round(store, topology, round=1, pending=tasks(range(4)), config=config,
                sizes=PathSizes(shard_tokens=SHARD_TOKENS, task_tokens=TASK_TOKENS))

    d = [9001 * 256, 4627 * 256, 3100 * 256, 12000 * 256 * 0.6]  # |D_p| × the share of the task trained
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
    equal = PathSizes(shard_tokens=(1000,) * 4, task_tokens=TASK_TOKENS)
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


def entry(path: int, *, tokens: int = TASK_TOKENS, factor: float = 1.0) -> ManifestEntry:
    return ManifestEntry(key=f"{path}", path=path, base=0, attempt=0, staleness=0, tokens=tokens, seconds=1.0,
                         bytes=0, train_loss=3.0, val_loss_start=3.0, factor=factor)


def test_weights_by_hand_for_every_setting():
    sizes = PathSizes(shard_tokens=SHARD_TOKENS, task_tokens=TASK_TOKENS)
    half, stale = entry(1, tokens=TASK_TOKENS // 2), entry(2, factor=0.5)  # half a task; one version stale
    entries = [entry(0), half, stale]

    def weights(weighting, normalize):
        return result_weights(entries, n_paths=4, sizes=sizes,
                              config=OuterConfig(weighting=weighting, normalize=normalize))

    # Z leaves the staleness factor out: the stale result is discounted, not just re-weighted
    shard = [2304256.0, 1184512.0 * 0.5, 793600.0 * 0.5]
    assert weights("shard", "module") == (pytest.approx(shard), pytest.approx(2304256 + 1184512 * 0.5 + 793600))
    assert weights("shard", "all") == (pytest.approx(shard), pytest.approx(2304256 + 1184512 + 793600 + 3072000))
    tokens = [51200.0, 25600.0, 25600.0]
    assert weights("tokens", "module") == (pytest.approx(tokens), pytest.approx(51200 + 25600 + 51200))
    assert weights("tokens", "all") == (pytest.approx(tokens), pytest.approx(4 * 51200))
    assert weights("uniform", "module") == (pytest.approx([1.0, 1.0, 0.5]), pytest.approx(3.0))
    assert weights("uniform", "all") == (pytest.approx([1.0, 1.0, 0.5]), pytest.approx(4.0))
    over = result_weights([entry(0, tokens=2 * TASK_TOKENS)], n_paths=4, sizes=sizes, config=OuterConfig())
    assert over == ([2304256.0], 2304256.0)  # a task never counts for more than a whole one
    alone = result_weights([stale], n_paths=4, sizes=sizes, config=OuterConfig())
    assert alone == ([793600.0 * 0.5], 793600.0)  # a stale result alone in a module moves it by half its Δ


def test_a_path_with_two_results_in_a_round_weighs_once():
    """Async: path 1 brought two results (consecutive pieces of its training, each half a task) and path 0
    one. In a shared module path 1 weighs as one path with its tokens together (a whole task), each of
    its results by that weight: its Δs add up, and Z counts it once."""
    sizes = PathSizes(shard_tokens=SHARD_TOKENS, task_tokens=TASK_TOKENS)
    first, second = entry(1, tokens=TASK_TOKENS // 2), entry(1, tokens=TASK_TOKENS // 2)
    weights, total = result_weights([entry(0), first, second], n_paths=4, sizes=sizes, config=OuterConfig())
    assert weights == pytest.approx([2304256.0, 1184512.0, 1184512.0])
    assert total == pytest.approx(2304256.0 + 1184512.0)


def test_diloco_replicas_weigh_by_their_share_of_the_documents():
    """Replicas of one path share every module; each one's |D| is its random share of the path's documents,
    so both normalisations give the same weighted average."""
    topology = Topology(levels=(1,), level_blocks=((0, 1),), private_blocks=frozenset(), private_embeddings=False,
                        replicas=4)
    shares = PathSizes(shard_tokens=(600, 500, 400, 500), task_tokens=TASK_TOKENS)
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
        result_weights([entry(0)], n_paths=4, sizes=PathSizes(shard_tokens=(1, 2, 3), task_tokens=1),
                       config=OuterConfig())
    assert result_weights([entry(0)], n_paths=4, sizes=None, config=OuterConfig(weighting="uniform")) == ([1.0], 1.0)
    with pytest.raises(ValueError, match="must hold tokens"):
        PathSizes(shard_tokens=(10, 0), task_tokens=5)
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
    assert sizes.task_tokens == config.inner.steps * config.inner.batch_size * index["seq_len"]
