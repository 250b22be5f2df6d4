"""Checksummed modules (issue 13, item 4): every committed version lists the sha256 of its module files,
and every reader (islands, eval, export) refuses a file changed since, naming it; eval never replaces a
good eval.json with NaN results. On main an overwritten module trained and evaluated on unnoticed."""

import json

import pytest
import torch
from cli_helpers import copy_run, dipaco_in_process

from dipaco.config import load_config
from dipaco.islands.island.training import train_task
from dipaco.pipeline.context import PathFactory
from dipaco.pipeline.version_zero import start_or_resume_store
from dipaco.run_dir import RunDir
from dipaco.stages.island import island_setup
from dipaco.store.module_store import ModuleStore, StoreError
from dipaco.store.records import Task


def change_one_weight(store: ModuleStore, round: int, name: str) -> None:
    """Overwrite 4 bytes of a module file's tensor data in place (its size and header unchanged)."""
    file = f"{store.root}/modules/round-{round:06d}/{name}.safetensors"
    with open(file, "r+b") as f:
        header = int.from_bytes(f.read(8), "little")
        f.seek(8 + header + 4)
        f.write(b"\x00\x00\xc0\x7f")  # a float32 NaN


def test_a_commit_lists_each_module_files_sha256_and_a_changed_file_is_named(tmp_path):
    store = ModuleStore(str(tmp_path / "store"))
    store.write_module(0, "a", {"w": torch.ones(4, 4)})
    store.write_module(0, "b", {"w": torch.zeros(2)})
    store.commit(round=0)
    sums = json.loads((tmp_path / "store/modules/round-000000/checksums.json").read_text())
    assert sorted(sums) == ["a.safetensors", "b.safetensors"] and all(len(v) == 64 for v in sums.values())
    fresh = ModuleStore(str(tmp_path / "store"))  # another process: reads the committed checksums
    assert torch.equal(fresh.read_module(0, "a")["w"], torch.ones(4, 4))
    change_one_weight(fresh, 0, "a")
    with pytest.raises(StoreError, match=r"round-000000/a\.safetensors has sha256 .* changed after it was committed"):
        ModuleStore(str(tmp_path / "store")).read_module(0, "a")
    ModuleStore(str(tmp_path / "store")).read_module(0, "b")  # the others still read


def test_pruning_keeps_the_checksums_of_the_files_it_keeps(tmp_path):
    store = ModuleStore(str(tmp_path / "store"))
    store.write_module(1, "a", {"w": torch.ones(2)})
    store.write_module(1, "b", {"w": torch.ones(2)})
    store.commit(round=1)
    store.prune_version("modules", 1, keep={"a"})
    assert sorted(store.listdir("modules/round-000001")) == ["a.safetensors", "checksums.json"]
    change_one_weight(store, 1, "a")
    with pytest.raises(StoreError, match="sha256"):
        ModuleStore(str(tmp_path / "store")).read_module(1, "a")


@pytest.mark.parametrize("sums", [{}, {"b.safetensors": "0" * 64}])
def test_a_checksums_json_without_the_module_it_must_cover_is_an_error(tmp_path, sums):
    """Issue 29: a checksums.json replaced by {} turned verification off silently."""
    store = ModuleStore(str(tmp_path / "store"))
    store.write_module(1, "a", {"w": torch.ones(2)})
    store.commit(round=1)
    (tmp_path / "store/modules/round-000001/checksums.json").write_text(json.dumps(sums))
    with pytest.raises(StoreError, match=r"round-000001/a\.safetensors is not listed in version 1's .*checksums\.json"):
        ModuleStore(str(tmp_path / "store")).read_module(1, "a")
    (tmp_path / "store/modules/round-000001/checksums.json").unlink()  # a version committed before checksums
    assert torch.equal(ModuleStore(str(tmp_path / "store")).read_module(1, "a")["w"], torch.ones(2))


@pytest.fixture()
def run(tiny_routed, tmp_path) -> RunDir:
    run = copy_run(tiny_routed, tmp_path / "run")
    start_or_resume_store(PathFactory(load_config(run.config), run))
    return run


def test_an_island_refuses_a_changed_module(run):
    config = load_config(run.config, ["hardware.device=cpu"])
    setup = island_setup(config, run)
    module = setup.topology.modules_of_path(0)[-1]
    change_one_weight(setup.store, 0, module)
    with pytest.raises(StoreError, match=rf"{module}\.safetensors has sha256"):
        train_task(setup, Task.open(path=0, base=0, step_offset=0, inner_from=None))


def test_export_refuses_a_changed_module_naming_it(run, tmp_path):
    store = PathFactory(load_config(run.config), run).store
    change_one_weight(store, 0, PathFactory(load_config(run.config), run).topology.modules_of_path(0)[0])
    code, log = dipaco_in_process("export", tmp_path / "out", "--run", run.root, "--path", "0", "--round", "0")
    assert code == 1 and "has sha256" in log and "changed after it was committed" in log
    assert not (tmp_path / "out").exists()


def test_eval_keeps_a_good_eval_json_when_the_results_are_nan(run):
    """A round committed with NaN modules (e.g. `outer.lr=.nan` on main) evaluates to NaN: refused."""
    store = PathFactory(load_config(run.config), run).store
    for name in store.listdir("modules/round-000000"):
        if name.endswith(".safetensors"):
            tensors = store.read_module(0, name.removesuffix(".safetensors"))
            store.write_module(1, name.removesuffix(".safetensors"), {k: torch.full_like(v, float("nan"))
                                                                       for k, v in tensors.items()})
    store.commit(round=1, levels=[2, 2])
    good = {"round": 1, "models": [{"model": "a good earlier evaluation", "perplexity": 250.0}]}
    run.eval_results.write_text(json.dumps(good))
    code, log = dipaco_in_process("eval", "--run", run.root, "eval.modes=[prefix]", "eval.baselines=false")
    assert code == 1 and "non-finite" in log and "was not replaced" in log
    assert json.loads(run.eval_results.read_text()) == good
    assert (run.root / "eval-rejected.json").is_file()
