"""A path's inner state is checked wherever it crosses the store (issue 36, item 4): `check_inner_state`
against AdamW's own recursion, each tamper of the issue refused naming the file and the tensor, and the
island that still finds one bad starts the path from fresh moments instead of exiting."""

import math
import re

import numpy as np
import pytest
import torch

from dipaco.carried.state import CarriedState
from dipaco.carried.validate import InnerStateInvalid, carried_norms, check_inner_state, moment_bound
from dipaco.islands.island.held import HeldState, fetch_carried
from dipaco.optim.inner import optimizer_state
from dipaco.store.board import write_inner
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import Task

BETAS = (0.9, 0.95)
SHAPES = {"mod/weight": [4, 3], "mod/bias": [4]}
FILE = "islands/path-0000/inner-round-000001.safetensors"
REF = "islands/path-0000/inner-round-000001.safetensors"


def honest_state(steps: int = 6, *, betas=BETAS, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict]:
    """The moments torch's AdamW leaves after `steps` steps on a Linear(3, 4) with random gradients."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=betas)
    for _ in range(steps):
        model(torch.randn(8, 3)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer_state(optimizer, {p: n for n, p in model.named_parameters()})


def check(tensors, meta, **kwargs):
    options = dict(file=FILE, expected_shapes=SHAPES, max_step=6, betas=BETAS) | kwargs
    check_inner_state(tensors, meta, **options)


def test_the_moment_bound_is_adamws_worst_case():
    """c_t against numpy's recursion: no gradient sequence exceeds it, and the Cauchy-Schwarz extremal one
    (|g_{t-j}| ∝ (β1/β2)^j) reaches it, for several betas and steps, r = β1²/β2 below and above 1."""
    rng = np.random.default_rng(0)
    for beta1, beta2 in [(0.9, 0.95), (0.9, 0.999), (0.95, 0.9), (0.5, 0.5)]:
        for t in (1, 3, 10, 40):
            m = v = 0.0
            for g in (beta1 / beta2) ** np.arange(t)[::-1]:  # oldest first: g_1 ... g_t
                m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
            assert m / math.sqrt(v) == pytest.approx(moment_bound(beta1, beta2, t), rel=1e-9)
            g = rng.standard_normal((1000, t))
            m, v = np.zeros(1000), np.zeros(1000)
            for j in range(t):
                m, v = beta1 * m + (1 - beta1) * g[:, j], beta2 * v + (1 - beta2) * g[:, j] ** 2
            assert (np.abs(m) <= moment_bound(beta1, beta2, t) * np.sqrt(v) + 1e-15).all()


@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.9, 0.999)])
def test_honest_adamw_states_pass(betas):
    for steps in (1, 6):
        tensors, meta = honest_state(steps, betas=betas)
        check(tensors, meta, betas=betas)
    check({}, {"step": {}})  # fresh: nothing carried


def scaled_moments(tensors, meta):
    return {k: v * 1000 for k, v in tensors.items()}, meta


def negative_second_moment(tensors, meta):
    return tensors | {"bias.exp_avg_sq": -tensors["bias.exp_avg_sq"] - 1e-6}, meta


def nan(tensors, meta):
    weight = tensors["weight.exp_avg"].clone()
    weight[1, 2] = math.nan
    return tensors | {"weight.exp_avg": weight}, meta


def wrong_shape(tensors, meta):
    return tensors | {"weight.exp_avg": torch.zeros(3, 4), "weight.exp_avg_sq": torch.ones(3, 4)}, meta


def unknown_name(tensors, meta):
    return tensors | {"lm_head.weight.exp_avg": torch.zeros(2)}, meta


def step_beyond_the_path(tensors, meta):
    return tensors, {"step": {name: 7 for name in meta["step"]}}


def huge_residual(tensors, meta):
    return tensors | {"residual/mod/weight": torch.full((4, 3), 10.0)}, meta


TAMPERS = {
    "moments x1000": (scaled_moments, "exp_avg has"),
    "exp_avg_sq < 0": (negative_second_moment, "bias.exp_avg_sq has 4 negative values"),
    "a NaN": (nan, "weight.exp_avg has 1 NaN"),
    "a wrong shape": (wrong_shape, "weight.exp_avg has shape [3, 4], its parameter's is [4, 3]"),
    "an unknown tensor": (unknown_name, "lm_head.weight.exp_avg is not a moment"),
    "a step count the path has not trained": (step_beyond_the_path, "step count 7, the path has trained 6"),
    "a residual beyond the path's progress": (huge_residual, "its residual has norm 34.64, above 10"),
}


@pytest.mark.parametrize("tamper", TAMPERS)
def test_each_tamper_is_refused_naming_the_file_and_the_tensor(tamper):
    change, message = TAMPERS[tamper]
    tensors, meta = change(*honest_state())
    with pytest.raises(InnerStateInvalid, match=re.escape(message)) as refused:
        check(tensors, meta, delta_norms=[0.05, 0.1], max_ratio=100)
    assert str(refused.value).startswith(FILE + ": ")


def test_a_residual_within_the_paths_progress_passes_and_is_unbounded_without_norms():
    tensors, meta = honest_state()
    tensors |= {"residual/mod/weight": torch.full((4, 3), 0.1), "drift/mod/bias": torch.full((4,), 0.1)}
    check(tensors, meta, delta_norms=[0.01, 0.02], max_ratio=100)  # 0.35 and 0.2 ≤ 100 x 0.02
    check(tensors | {"residual/mod/weight": torch.full((4, 3), 1e3)}, meta)  # the island: no norms, no bound


def task(inner_from: str | None) -> Task:
    return Task.open(path=0, base=1, step_offset=6, inner_from=inner_from)


@pytest.mark.parametrize("damage", ["truncated", "moments x1000", "missing"])
def test_the_island_starts_fresh_from_a_bad_inner_state_and_says_why(tmp_path, damage, caplog):
    """A truncated or tampered state in the store: the island's `fetch_carried` refuses it naming the file
    (no exception), so the task trains from fresh moments and says why; a missing one (it stayed on an
    island that died, no checkpoint) is fresh moments too, logged; a good one is used as it is."""
    store = ModuleStore(tmp_path.as_uri())
    tensors, meta = honest_state()
    write_inner(store, REF, tensors, meta)
    options = dict(held=None, shapes=SHAPES, max_step=6, betas=BETAS)
    state, where, local, refused = fetch_carried(store, task(REF), **options)
    assert not refused and not local and state.steps == meta["step"]
    assert all(torch.equal(state.adam[k], tensors[k]) for k in tensors)
    file = tmp_path / REF
    if damage == "truncated":
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    elif damage == "missing":
        file.unlink()
    else:
        write_inner(store, REF, *scaled_moments(tensors, meta))
    state, where, local, refused = fetch_carried(store, task(REF), **options)
    assert not state.adam and not state.residual and not state.drift and not local and where == ""
    if damage == "missing":
        assert refused == "" and "no checkpoint; fresh moments" in caplog.text
    else:
        assert str(file) in refused or REF in refused
        assert "resumes from fresh moments" in caplog.text
    held = HeldState(store)  # what this island holds itself is used as it is
    held.keep(REF, 0, CarriedState.from_tensors(tensors, meta, where=REF), uploaded=True)
    assert fetch_carried(store, task(REF), **(options | {"held": held}))[2] is True


def test_a_bf16_checkpoint_passes_and_its_decoded_moments_too():
    """A checkpoint stores the moments in bf16 (`CarriedState.to_tensors(moments="bf16")`): honest moments
    pass the validator as stored and decoded back to float32 (`CarriedState.check`), within bf16's slack;
    moments scaled by 1000 still fail."""
    tensors, meta = honest_state()
    stored, stored_meta = CarriedState.from_tensors(tensors, meta, where=FILE).to_tensors(moments="bf16")
    assert stored["weight.exp_avg"].dtype == torch.bfloat16
    check(stored, stored_meta)
    decoded = CarriedState.from_tensors(stored, stored_meta, where=FILE)
    assert decoded.stored == "bf16" and decoded.adam["weight.exp_avg"].dtype == torch.float32
    decoded.check(SHAPES, where=FILE, max_step=6, betas=BETAS)
    scaled = CarriedState.from_tensors(*scaled_moments(*decoded.to_tensors()), where=FILE)
    with pytest.raises(InnerStateInvalid, match="exp_avg"):
        scaled.check(SHAPES, where=FILE, max_step=6, betas=BETAS)


def test_carried_norms_add_each_modules_residual_and_drift_norms():
    """What a result may carry beyond its task's training, per module: ‖residual_m‖ + ‖drift_m‖ (numpy)."""
    rng = np.random.default_rng(1)
    arrays = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in
              [("residual/a/w", (3, 2)), ("residual/a/b", (2,)), ("drift/a/w", (3, 2)), ("drift/b/w", (4,))]}
    tensors = {name: torch.from_numpy(a) for name, a in arrays.items()} | {"w.exp_avg": torch.ones(3, 2)}
    residual_a = np.sqrt(sum(np.square(arrays[k].astype(np.float64)).sum() for k in ("residual/a/w", "residual/a/b")))
    expected = {"a": residual_a + np.linalg.norm(arrays["drift/a/w"].astype(np.float64)),
                "b": np.linalg.norm(arrays["drift/b/w"].astype(np.float64))}
    assert carried_norms(tensors) == pytest.approx(expected, rel=1e-12)


def muon_state(steps: int = 4) -> tuple[dict[str, torch.Tensor], dict, dict[str, list[int]]]:
    """The state `inner.optimizer: muon` leaves: torch's Muon on a block's 2-D weight (its momentum buffer,
    no step count), AdamW on the rest, as `dipaco.optim.inner.optimizer_state` saves them."""
    from dipaco.optim.muon import MuonAdamW

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.Linear(3, 4)])})
    names = {p: f"model.layers.0.{n.rsplit('.', 1)[-1]}" for n, p in model.named_parameters()}
    weight, bias = model["layers"][0].weight, model["layers"][0].bias
    optimizer = MuonAdamW(muon=torch.optim.Muon([weight], lr=1e-2), adamw=torch.optim.AdamW([bias], lr=1e-2, betas=BETAS))
    for _ in range(steps):
        model["layers"][0](torch.randn(8, 3)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    tensors, meta = optimizer_state(optimizer, names)
    return tensors, meta, {f"mod/{name}": list(p.shape) for p, name in names.items()}


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon ships with torch >= 2.9")
def test_a_muon_state_passes_and_its_momentum_is_checked_for_shape_and_finiteness():
    tensors, meta, shapes = muon_state()
    assert "model.layers.0.weight.momentum_buffer" in tensors and "model.layers.0.weight" not in meta["step"]
    check(tensors, meta, expected_shapes=shapes, max_step=4)
    buffer = tensors["model.layers.0.weight.momentum_buffer"].clone()
    buffer[0, 0] = math.nan
    with pytest.raises(InnerStateInvalid, match=re.escape("model.layers.0.weight.momentum_buffer has 1 NaN")):
        check(tensors | {"model.layers.0.weight.momentum_buffer": buffer}, meta, expected_shapes=shapes, max_step=4)
    with pytest.raises(InnerStateInvalid, match=re.escape("momentum_buffer has shape [3, 4]")):
        check(tensors | {"model.layers.0.weight.momentum_buffer": torch.zeros(3, 4)}, meta, expected_shapes=shapes,
              max_step=4)
