"""The inner loop: the schedule, AdamW state that survives a trip through the store, and dense training
(the warm start and the baselines) saved and loaded back."""

import numpy as np
import pytest
import torch

from dipaco.config import InnerConfig, ModelConfig
from dipaco.device import resolve_device
from dipaco.model.path_model import PathSpec, build_path_model, path_parameters
from dipaco.optim.dense import load_dense, train_dense
from dipaco.optim.inner import (
    CHECK_EVERY,
    load_optimizer_state,
    lr_at,
    make_optimizer,
    optimizer_state,
    phase_steps,
    train_steps,
    warm_start_total,
)


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = InnerConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    lrs = [lr_at(s, config=cfg, total_steps=100) for s in range(100)]
    assert lrs[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lr_at(100, config=cfg, total_steps=100) == pytest.approx(0.1)


def test_wsd_schedule_warms_up_holds_then_decays_linearly_over_the_last_fraction():
    cfg = InnerConfig(lr=2.0, warmup_steps=4, min_lr_ratio=0.1, schedule="wsd", decay_fraction=0.25)
    lrs = [lr_at(s, config=cfg, total_steps=40) for s in range(40)]
    assert lrs[:4] == pytest.approx([2.0 * (s + 1) / 4 for s in range(4)])
    assert lrs[4:30] == pytest.approx([2.0] * 26)  # the decay window is the last 25% = 10 steps
    floor = 2.0 * 0.1
    assert lrs[30:] == pytest.approx([2.0 + (floor - 2.0) * (i + 1) / 10 for i in range(10)])
    assert lrs[-1] == pytest.approx(floor)
    # a run without an end (the warm start) stays at the peak after its warmup
    assert [lr_at(s, config=cfg, total_steps=None) for s in (3, 4, 10_000)] == pytest.approx([2.0, 2.0, 2.0])
    with pytest.raises(ValueError, match="total_steps"):
        lr_at(5, config=InnerConfig(schedule="cosine"), total_steps=None)


def test_a_phase_continuing_a_wsd_warm_start_follows_one_uninterrupted_schedule():
    """Under wsd the warm start (no end) then a phase counted on from it (`phase_steps`) give the very
    learning rates of one schedule over both, when the decay window lies within the phase; under cosine
    each phase starts its own schedule, warmup included."""
    wsd = InnerConfig(lr=1.0, warmup_steps=3, schedule="wsd", decay_fraction=0.3)
    warm, steps = 14, 6  # decay window round(0.3 * 20) = 6 steps: the whole phase
    assert warm_start_total(wsd, warm) is None
    first, total = phase_steps(wsd, steps=steps, after=warm)
    assert (first, total) == (warm, warm + steps)
    pieces = ([lr_at(s, config=wsd, total_steps=warm_start_total(wsd, warm)) for s in range(warm)]
              + [lr_at(first + s, config=wsd, total_steps=total) for s in range(steps)])
    assert pieces == pytest.approx([lr_at(s, config=wsd, total_steps=warm + steps) for s in range(warm + steps)])
    cosine = InnerConfig(lr=1.0, warmup_steps=3, schedule="cosine")
    assert phase_steps(cosine, steps=steps, after=warm) == (0, steps) and warm_start_total(cosine, warm) == warm


def test_schedule_settings_are_checked():
    with pytest.raises(ValueError, match="inner.schedule"):
        InnerConfig(schedule="linear")
    with pytest.raises(ValueError, match="inner.decay_fraction"):
        InnerConfig(schedule="wsd", decay_fraction=0.0)


def _batches(seed):
    rng = np.random.default_rng(seed)
    while True:
        yield rng.integers(0, 30, size=(2, 12))


def test_optimizer_state_round_trip_continues_training_exactly():
    cfg = InnerConfig(steps=4, batch_size=2, warmup_steps=1)
    kwargs = dict(total_steps=4, config=cfg, device=torch.device("cpu"), precision="fp32")
    mcfg = ModelConfig(hidden_size=16, n_layers=1, n_heads=2)

    straight = build_path_model(mcfg, vocab_size=30, seq_len=12, seed=0)
    train_steps(straight, make_optimizer(straight, cfg), _batches(1), start_step=0, steps=4, **kwargs)

    first = build_path_model(mcfg, vocab_size=30, seq_len=12, seed=0)
    opt = make_optimizer(first, cfg)
    data = _batches(1)
    train_steps(first, opt, data, start_step=0, steps=2, **kwargs)
    names = {p: n for n, p in path_parameters(first).items()}
    tensors, meta = optimizer_state(opt, names)

    second = build_path_model(mcfg, vocab_size=30, seq_len=12, seed=5)
    second.load_state_dict(first.state_dict())
    opt2 = make_optimizer(second, cfg)
    load_optimizer_state(opt2, path_parameters(second), tensors, meta)
    stats = train_steps(second, opt2, data, start_step=2, steps=2, **kwargs)
    assert stats["tokens"] == 2 * 2 * 12
    for name, param in path_parameters(second).items():
        torch.testing.assert_close(param, path_parameters(straight)[name])


def test_device_resolution():
    assert resolve_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        assert resolve_device("auto").type == "cpu"
        with pytest.raises(ValueError, match="cuda"):
            resolve_device("cuda")


def test_dense_training_is_the_inner_recipe_over_its_own_steps_and_loads_back(tmp_path):
    cfg = InnerConfig(batch_size=2, warmup_steps=1)
    spec = PathSpec(model=ModelConfig(hidden_size=16, n_layers=1, n_heads=2), vocab_size=30, seq_len=12)
    cpu = torch.device("cpu")
    model, summary = train_dense(spec, _batches(1), steps=3, inner=cfg, seed=4, device=cpu, precision="fp32",
                                 out=tmp_path / "dense", info={"name": "x"})
    reference = build_path_model(spec.model, vocab_size=30, seq_len=12, seed=4)  # written out by hand
    stats = train_steps(reference, make_optimizer(reference, cfg), _batches(1), start_step=0, steps=3, total_steps=3,
                        config=cfg, device=cpu, precision="fp32")
    assert summary["name"] == "x" and summary["steps"] == 3 and summary["tokens"] == 3 * 2 * 12
    assert summary["losses"] == stats["losses"]
    loaded, saved = load_dense(tmp_path / "dense", spec)
    assert saved == {**summary, "seconds": saved["seconds"]}
    for name, param in path_parameters(loaded).items():
        torch.testing.assert_close(param, path_parameters(reference)[name], rtol=0, atol=0)
        torch.testing.assert_close(param, path_parameters(model)[name], rtol=0, atol=0)
    assert sorted(p.name for p in (tmp_path / "dense").iterdir()) == ["model.safetensors", "summary.json"]


def test_dense_training_continues_from_an_init_file(tmp_path):
    """`init` (a baseline continuing from the warm start): the model starts from the file's parameters, not
    from its seed, with a fresh AdamW and the schedule over its own steps — bit for bit a loop started by hand."""
    from dipaco.model.path_model import save_parameters

    cfg = InnerConfig(batch_size=2, warmup_steps=1)
    spec = PathSpec(model=ModelConfig(hidden_size=16, n_layers=1, n_heads=2), vocab_size=30, seq_len=12)
    cpu = torch.device("cpu")
    start = build_path_model(spec.model, vocab_size=30, seq_len=12, seed=9)
    save_parameters(start, tmp_path / "start.safetensors")
    model, summary = train_dense(spec, _batches(2), steps=2, inner=cfg, seed=4, device=cpu, precision="fp32",
                                 out=tmp_path / "dense", init=tmp_path / "start.safetensors")
    train_steps(start, make_optimizer(start, cfg), _batches(2), start_step=0, steps=2, total_steps=2, config=cfg,
                device=cpu, precision="fp32")
    for name, param in path_parameters(model).items():
        torch.testing.assert_close(param, path_parameters(start)[name], rtol=0, atol=0)
    assert summary["steps"] == 2 and summary["cpu_seconds"] > 0


def test_train_steps_matches_a_plain_loop_bit_for_bit():
    """Losses kept on the device and checked every CHECK_EVERY steps change nothing: the same losses and
    parameters as a loop that syncs `loss.item()` each step (the loop train_steps ran before)."""
    cfg = InnerConfig(steps=6, batch_size=2, warmup_steps=2)
    mcfg = ModelConfig(hidden_size=16, n_layers=1, n_heads=2)
    cpu = torch.device("cpu")
    model = build_path_model(mcfg, vocab_size=30, seq_len=12, seed=0)
    stats = train_steps(model, make_optimizer(model, cfg), _batches(1), start_step=3, steps=6, total_steps=12,
                        config=cfg, device=cpu, precision="fp32")

    reference = build_path_model(mcfg, vocab_size=30, seq_len=12, seed=0)
    optimizer, data, losses = make_optimizer(reference, cfg), _batches(1), []
    for step in range(3, 9):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config=cfg, total_steps=12)
        input_ids = torch.as_tensor(next(data), dtype=torch.long)
        loss = reference(input_ids=input_ids, labels=input_ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.grad_clip)
        optimizer.step()
        losses.append(loss.item())
    assert stats["losses"] == losses
    for name, param in path_parameters(model).items():
        torch.testing.assert_close(param, path_parameters(reference)[name], rtol=0, atol=0)


@pytest.mark.parametrize("bad_step", [2, CHECK_EVERY + 1])
def test_a_non_finite_loss_raises_naming_its_step(bad_step):
    cfg = InnerConfig(steps=CHECK_EVERY + 3, batch_size=2, warmup_steps=1)
    model = build_path_model(ModelConfig(hidden_size=16, n_layers=1, n_heads=2), vocab_size=30, seq_len=12, seed=0)

    def poisoned():
        for i, batch in enumerate(_batches(1)):
            if i == bad_step:
                with torch.no_grad():
                    model.model.norm.weight.fill_(float("nan"))
            yield batch

    with pytest.raises(FloatingPointError, match=f"inner step {10 + bad_step}: loss is nan"):
        train_steps(model, make_optimizer(model, cfg), poisoned(), start_step=10, steps=cfg.steps,
                    total_steps=100, config=cfg, device=torch.device("cpu"), precision="fp32")


def test_fused_adamw_state_round_trip_continues_training_exactly():
    cfg = InnerConfig(steps=4, batch_size=2, warmup_steps=1)
    kwargs = dict(total_steps=4, config=cfg, device=torch.device("cpu"), precision="fp32")
    mcfg = ModelConfig(hidden_size=16, n_layers=1, n_heads=2)
    straight = build_path_model(mcfg, vocab_size=30, seq_len=12, seed=0)
    train_steps(straight, make_optimizer(straight, cfg, fused=True), _batches(1), start_step=0, steps=4, **kwargs)

    first = build_path_model(mcfg, vocab_size=30, seq_len=12, seed=0)
    opt = make_optimizer(first, cfg, fused=True)
    data = _batches(1)
    train_steps(first, opt, data, start_step=0, steps=2, **kwargs)
    tensors, meta = optimizer_state(opt, {p: n for n, p in path_parameters(first).items()})
    second = build_path_model(mcfg, vocab_size=30, seq_len=12, seed=5)
    second.load_state_dict(first.state_dict())
    opt2 = make_optimizer(second, cfg, fused=True)
    load_optimizer_state(opt2, path_parameters(second), tensors, meta)
    train_steps(second, opt2, data, start_step=2, steps=2, **kwargs)
    for name, param in path_parameters(second).items():
        torch.testing.assert_close(param, path_parameters(straight)[name], rtol=0, atol=0)


def test_dense_training_with_a_schedule_continues_it_bit_for_bit(tmp_path):
    """`schedule` = (first step, total): a baseline continuing a wsd warm start trains the steps of a
    loop written out by hand from that step on, and records the schedule in its summary."""
    cfg = InnerConfig(batch_size=2, warmup_steps=2, schedule="wsd", decay_fraction=0.5)
    spec = PathSpec(model=ModelConfig(hidden_size=16, n_layers=1, n_heads=2), vocab_size=30, seq_len=12)
    cpu = torch.device("cpu")
    model, summary = train_dense(spec, _batches(3), steps=4, inner=cfg, seed=4, device=cpu, precision="fp32",
                                 out=tmp_path / "dense", schedule=(6, 10))
    reference = build_path_model(spec.model, vocab_size=30, seq_len=12, seed=4)
    optimizer = make_optimizer(reference, cfg)
    data = _batches(3)
    for step in range(6, 10):  # by hand: the wsd learning rate of steps 6..9 of a 10-step run, no warmup
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config=cfg, total_steps=10)
        ids = torch.as_tensor(next(data), dtype=torch.long)
        reference(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for name, param in path_parameters(model).items():
        torch.testing.assert_close(param, path_parameters(reference)[name], rtol=0, atol=0)
    assert summary["schedule"] == {"name": "wsd", "first_step": 6, "total_steps": 10}


def test_a_run_continued_from_its_saved_parameters_and_adamw_state_equals_the_uninterrupted_run(tmp_path):
    """`save_optimizer` then `init` + `init_optimizer` + the schedule counted on (a wsd warm start and a
    phase continuing it with `warm_start.continue_optimizer`): bit for bit one run of all the steps."""
    from dipaco.optim.dense import OPTIMIZER, PARAMETERS, read_optimizer

    cfg = InnerConfig(batch_size=2, warmup_steps=2, schedule="wsd", decay_fraction=0.5)
    spec = PathSpec(model=ModelConfig(hidden_size=16, n_layers=1, n_heads=2), vocab_size=30, seq_len=12)
    common = dict(inner=cfg, seed=4, device=torch.device("cpu"), precision="fp32")
    straight, _ = train_dense(spec, _batches(5), steps=8, out=tmp_path / "straight", schedule=(0, 8), **common)
    data = _batches(5)
    _, first = train_dense(spec, data, steps=4, out=tmp_path / "warm", schedule=(0, None), save_optimizer=True, **common)
    tensors, meta = read_optimizer(tmp_path / "warm" / OPTIMIZER)
    assert set(meta["step"].values()) == {4} and len(tensors) == 2 * len(meta["step"])
    continued, summary = train_dense(spec, data, steps=4, out=tmp_path / "continued", init=tmp_path / "warm" / PARAMETERS,
                                     init_optimizer=tmp_path / "warm" / OPTIMIZER, schedule=(4, 8), **common)
    assert summary["continued_optimizer"] and not first["continued_optimizer"]
    for name, param in path_parameters(continued).items():
        torch.testing.assert_close(param, path_parameters(straight)[name], rtol=0, atol=0)
    # a fresh AdamW at the same point does not give the same model: the state is what made it equal
    fresh, _ = train_dense(spec, _batches(5), steps=4, out=tmp_path / "fresh", init=tmp_path / "warm" / PARAMETERS,
                           schedule=(4, 8), **common)
    assert any(not torch.equal(p, path_parameters(straight)[n]) for n, p in path_parameters(fresh).items())


def test_an_adamw_state_of_another_model_or_no_state_at_all_is_refused_by_name(tmp_path):
    from dipaco.optim.dense import OPTIMIZER, read_optimizer

    cfg = InnerConfig(batch_size=2, warmup_steps=1)
    common = dict(inner=cfg, seed=4, device=torch.device("cpu"), precision="fp32")
    small = PathSpec(model=ModelConfig(hidden_size=16, n_layers=1, n_heads=2), vocab_size=30, seq_len=12)
    wide = PathSpec(model=ModelConfig(hidden_size=32, n_layers=1, n_heads=2), vocab_size=30, seq_len=12)
    train_dense(small, _batches(1), steps=1, out=tmp_path / "small", save_optimizer=True, **common)
    with pytest.raises(ValueError, match="no moments of shape"):
        train_dense(wide, _batches(1), steps=1, out=tmp_path / "wide", init_optimizer=tmp_path / "small" / OPTIMIZER,
                    **common)
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="bad.safetensors is not an AdamW state"):
        read_optimizer(tmp_path / "bad.safetensors")
