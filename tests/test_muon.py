"""Muon inside (`inner.optimizer: muon`, `dipaco.optim.muon`): Muon on exactly the blocks' matrices and AdamW
on the rest, a tiny path trains, its state survives a trip through the path's inner state and training
continues exactly, and a torch without torch.optim.Muon is refused by name when the config is checked."""

import numpy as np
import pytest
import torch
from tiny_runs import make_run

from dipaco.carried.state import MOMENTS_OF, CarriedState
from dipaco.config import InnerConfig, ModelConfig, load_config
from dipaco.islands.island.held import HeldState
from dipaco.islands.island.training import push_result, residual_shapes, train_task
from dipaco.model.path_model import build_path_model, path_parameters
from dipaco.optim.inner import load_optimizer_state, make_optimizer, optimizer_state, train_steps
from dipaco.stages.island import island_setup
from dipaco.store.records import Task

MODEL = ModelConfig(hidden_size=16, n_layers=2, n_heads=2)


def _batches(seed):
    rng = np.random.default_rng(seed)
    while True:
        yield rng.integers(0, 30, size=(2, 12))


def _kwargs(cfg: InnerConfig, total: int) -> dict:
    return dict(total_steps=total, config=cfg, device=torch.device("cpu"), precision="fp32")


def test_muon_takes_the_blocks_matrices_adamw_the_rest_and_a_tiny_path_learns():
    cfg = InnerConfig(optimizer="muon", lr=1e-2, warmup_steps=1, weight_decay=0.0)
    model = build_path_model(MODEL, vocab_size=30, seq_len=12, seed=0)
    optimizer = make_optimizer(model, cfg)
    by_id = {id(p): name for name, p in model.named_parameters()}
    muon = {by_id[id(p)] for group in optimizer.muon.param_groups for p in group["params"]}
    adamw = {by_id[id(p)] for group in optimizer.adamw.param_groups for p in group["params"]}
    matrices = {name for name, p in model.named_parameters() if p.dim() == 2 and name.startswith("model.layers.")}
    assert muon == matrices and len(muon) == 7 * MODEL.n_layers  # q k v o, gate up down
    assert adamw == set(by_id.values()) - muon and "model.embed_tokens.weight" in adamw
    batch = next(_batches(3))
    stats = train_steps(model, optimizer, iter([batch] * 30), start_step=0, steps=30, **_kwargs(cfg, 30))
    assert np.mean(stats["losses"][-5:]) < 0.7 * np.mean(stats["losses"][:5])  # memorising one batch


def test_a_restored_muon_state_continues_training_exactly():
    """Two steps, the state saved and loaded into another model's optimizer, two more steps: the same floats
    as four steps straight. The state holds a momentum buffer per Muon matrix and AdamW moments for the rest."""
    cfg = InnerConfig(optimizer="muon", steps=4, batch_size=2, warmup_steps=1)
    straight = build_path_model(MODEL, vocab_size=30, seq_len=12, seed=0)
    train_steps(straight, make_optimizer(straight, cfg), _batches(1), start_step=0, steps=4, **_kwargs(cfg, 4))

    first = build_path_model(MODEL, vocab_size=30, seq_len=12, seed=0)
    opt = make_optimizer(first, cfg)
    data = _batches(1)
    train_steps(first, opt, data, start_step=0, steps=2, **_kwargs(cfg, 4))
    tensors, meta = optimizer_state(opt, {p: n for n, p in path_parameters(first).items()})
    for name, param in path_parameters(first).items():
        in_muon = param.dim() == 2 and name.startswith("model.layers.")
        assert (f"{name}.momentum_buffer" in tensors) == in_muon and (f"{name}.exp_avg" in tensors) != in_muon
        assert (name in meta["step"]) != in_muon

    second = build_path_model(MODEL, vocab_size=30, seq_len=12, seed=5)
    second.load_state_dict(first.state_dict())
    opt2 = make_optimizer(second, cfg)
    load_optimizer_state(opt2, path_parameters(second), tensors, meta, strict=True)
    train_steps(second, opt2, data, start_step=2, steps=2, **_kwargs(cfg, 4))
    for name, param in path_parameters(second).items():
        torch.testing.assert_close(param, path_parameters(straight)[name], rtol=0, atol=0)
    third = build_path_model(MODEL, vocab_size=30, seq_len=12, seed=0)
    adamw_only = {k: v for k, v in tensors.items() if not k.endswith(".momentum_buffer")}
    with pytest.raises(ValueError, match=r"no Muon momentum for model\.layers\.0\..*\.weight"):
        load_optimizer_state(make_optimizer(third, cfg), path_parameters(third), adamw_only, meta, strict=True)


def test_muon_is_refused_by_name_on_a_torch_without_it(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")
    message = r"inner.optimizer 'muon' needs torch.optim.Muon, which torch .* does not have"
    with pytest.raises(ValueError, match=message):
        InnerConfig(optimizer="muon")
    with pytest.raises(ValueError, match=message):
        load_config(None, ["inner.optimizer=muon"])
    assert InnerConfig(optimizer="adamw").optimizer == "adamw"


def test_a_path_trained_with_muon_carries_its_momentum_in_its_carried_state(tiny_routed, tmp_path):
    """On the island: the first task's carried state holds Muon's buffers (every block matrix, and no AdamW
    moments for them); given back to its island the path's next task continues it from memory (nothing
    read); handed off through the store, a fresh island continues it bit for bit the same; a bf16
    checkpoint of it passes the carried state's checks and restores every buffer strictly."""
    run = make_run(tiny_routed, tmp_path / "run", ["inner.optimizer=muon"])
    first = Task.open(path=0, base=0, step_offset=0, inner_from=None)
    out = train_task(run.setup, first)
    model = run.setup.spec.new_model()
    params = path_parameters(model)
    matrices = {name for name, p in params.items() if p.dim() == 2 and name.startswith("model.layers.")}
    buffers = {k for k in out.carried.adam if k.endswith(".momentum_buffer")}
    assert buffers == {f"{name}.momentum_buffer" for name in matrices}
    assert not any(k.removesuffix(".exp_avg") in matrices for k in out.carried.adam) and out.carried.steps

    held = HeldState(run.store)
    meta, _, ref = push_result(run.setup, first, out, island="a")
    assert meta.inner_upload == "" and meta.bytes_up_inner == 0 and not (run.dir.store / ref).exists()
    held.keep(ref, 0, out.carried, uploaded=False)
    second = Task.open(path=0, base=0, step_offset=run.config.inner.steps, inner_from=ref)
    memory = train_task(run.setup, second, held=held)
    assert memory.meta.inner_state_local and memory.meta.bytes_down_inner == 0

    assert held.hand_off() == (run.dir.store / ref).stat().st_size
    moved = train_task(island_setup(run.config, run.dir), second)
    assert not moved.meta.inner_state_local and moved.meta.bytes_down_inner == (run.dir.store / ref).stat().st_size
    assert {k for k in moved.carried.adam if k.endswith(".momentum_buffer")} == buffers
    for name, delta in memory.pseudo_gradient.items():
        assert torch.equal(moved.pseudo_gradient[name], delta), name

    tensors, meta = out.carried.to_tensors(moments=MOMENTS_OF["checkpoint"])
    assert all(tensors[k].dtype == torch.bfloat16 for k in buffers)
    light = CarriedState.from_tensors(tensors, meta, where="c")
    light.check(residual_shapes(params, run.setup.topology, path=0), where="c", max_step=max(light.steps.values()),
                betas=(run.config.inner.beta1, run.config.inner.beta2))
    optimizer = make_optimizer(model, run.setup.inner)
    load_optimizer_state(optimizer, params, light.adam, {"step": light.steps}, strict=True)
    assert all(torch.equal(light.adam[f"{n}.momentum_buffer"], out.carried.adam[f"{n}.momentum_buffer"]
                           .to(torch.bfloat16).float()) for n in matrices)
