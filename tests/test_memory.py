"""The coordinator's outer step streams module by module: the same modules as decoding every result
first, bit for bit, and a peak memory bounded by one module × the paths that share it.

Synthetic rounds are written straight into a temporary store (no training) by the memory benchmark's
helpers (`bench/bench_memory.py`), which also keep the earlier all-in-memory outer step as the
reference. Peak memory is the growth of a fresh process's resident memory (VmHWM after resetting it,
Linux): torch allocates outside Python, so tracemalloc would not see the tensors. The two outer steps
of a test run in two such processes at once (a process's peak is its own).
"""

import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_memory import (  # noqa: E402
    MIB,
    apply_round_in_memory,
    coordinator_peak,
    synthetic_pending,
    synthetic_topology,
    write_synthetic_round,
)
from dipaco.config import OuterConfig  # noqa: E402
from dipaco.islands.coordinator.outer_step import apply_round  # noqa: E402
from dipaco.store.module_store import ModuleStore  # noqa: E402


@pytest.mark.parametrize("compression", ["none", "int8", "int4"])
def test_the_streamed_outer_step_gives_the_same_modules_bit_for_bit(tmp_path, compression):
    topology = synthetic_topology([3, 2])
    config = OuterConfig(weighting="tokens", rescale_by_paths=True)  # Nesterov, √paths rescale, token weights
    streamed, reference = ModuleStore(str(tmp_path / "streamed")), ModuleStore(str(tmp_path / "reference"))
    for round in (1, 2):  # round 2 starts from round 1's momentum
        write_synthetic_round(streamed, topology, round=round, module_floats=3000, compression=compression, seed=1)
        shutil.copytree(tmp_path / "streamed" / "results", tmp_path / "reference" / "results", dirs_exist_ok=True)
        if round == 1:
            shutil.copytree(tmp_path / "streamed" / "modules", tmp_path / "reference" / "modules")
        pending = synthetic_pending(topology, round=round)
        manifest = apply_round(streamed, topology, round=round, pending=pending, config=config)
        apply_round_in_memory(reference, topology, round=round, pending=pending, config=config)
        assert [e.path for e in manifest.applied] == list(range(topology.n_paths)) and not manifest.dropped
    for name in topology.modules:
        for read in ("read_module", "read_outer_state"):
            got, want = getattr(streamed, read)(2, name), getattr(reference, read)(2, name)
            assert got.keys() == want.keys()
            for key in want:
                assert torch.equal(got[key], want[key]), (name, read, key)
        assert not torch.equal(streamed.read_module(2, name)["w"], streamed.read_module(0, name)["w"])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("compression", ["none", pytest.param("int8", marks=pytest.mark.slow)])  # int8: make test-slow
def test_a_4x4_outer_step_peaks_below_one_module_times_its_paths(tmp_path, compression):
    topology = synthetic_topology([4, 4])  # 16 paths; the embeddings are shared by all 16
    store_dir = tmp_path / "store"
    sizes = write_synthetic_round(ModuleStore(str(store_dir)), topology, round=1, module_floats=MIB // 4,
                                  compression=compression)
    bound = sizes["module_bytes"] * sizes["max_paths_per_module"] + 8 * MIB  # one module × its paths + slack
    assert sizes["decoded_result_bytes"] > bound  # the whole round (16 paths × 3 modules, 48 MiB) is above it
    shutil.copytree(store_dir, tmp_path / "copy")  # both measured at once, each process on its own copy
    with ThreadPoolExecutor(2) as pool:
        streamed, in_memory = pool.map(lambda args: coordinator_peak(*args)["peak_bytes"],
                                       [(store_dir, [4, 4], "streamed"), (tmp_path / "copy", [4, 4], "in-memory")])
    assert streamed < bound, f"streamed outer step peaked at {streamed / MIB:.1f} MiB, bound {bound / MIB:.1f} MiB"
    # the measurement does see a round held in memory: the earlier implementation breaks the bound
    assert in_memory > bound, f"decoding every result peaked at only {in_memory / MIB:.1f} MiB"
