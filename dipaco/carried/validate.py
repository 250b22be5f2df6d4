"""One validator for a path's inner state as read from the store: an island wrote it, so it is untrusted.

    check_inner_state(tensors, meta, file="islands/path-0001/inner-round-000002.safetensors",
                      expected_shapes={"embeddings/model.embed_tokens.weight": [512, 32], ...},
                      max_step=8, betas=(0.9, 0.95), delta_norms=[0.31, 0.28], max_ratio=100.0)
    # None, or InnerStateInvalid (a StoreError) naming the file and the tensor

An inner state (`dipaco.optim.inner.optimizer_state`, `dipaco.optim.error_feedback`, `dipaco.optim.drift`)
holds, per parameter `p` of module `m` ("m/p" in `expected_shapes`):

- `p.exp_avg`, `p.exp_avg_sq`: AdamW's moments, both or neither (neither: that parameter starts fresh), with
  the step count `meta["step"][p]`, 1 ≤ step ≤ `max_step` (the path's inner steps so far);
- `p.momentum_buffer`: Muon's momentum instead (`inner.optimizer: muon`, the blocks' 2-D weights,
  `dipaco.optim.muon`), with no step count; its bound is finiteness and shape (Muon orthogonalises the
  update, so no ratio to another moment bounds it);
- `residual/m/p`: the error-feedback residual; `drift/m/p`: the drift of a module its tasks did not send.

Each is finite and of its parameter's shape, float32 (the moments may be bf16: a checkpoint,
`dipaco.carried.state`); no other name is allowed. Then:

**AdamW consistency.** torch's AdamW keeps the moments without bias correction, from m_0 = v_0 = 0:
m_t = β1 m_{t-1} + (1-β1) g_t and v_t = β2 v_{t-1} + (1-β2) g_t² (weight decay is decoupled: it never
enters them), so m_t = (1-β1) Σ_{j<t} β1^j g_{t-j} and v_t = (1-β2) Σ_{j<t} β2^j g_{t-j}². Hence
v_t ≥ 0, and writing β1^j |g| = (β1^j β2^{-j/2}) (β2^{j/2} |g|), Cauchy-Schwarz gives

    |m_t| ≤ (1-β1) √(Σ_{j<t} r^j) √(Σ_{j<t} β2^j g_{t-j}²) = c_t(β1, β2) √v_t,
    c_t = (1-β1) √(S_t / (1-β2)),   r = β1² / β2,   S_t = Σ_{j<t} r^j = (1 - r^t) / (1 - r)  (t when r = 1),

element by element, whatever the gradients (equality at t = 1). With r < 1 (the defaults 0.9, 0.95: r = 0.853,
c_∞ = 1.165) c_t grows to (1-β1)/√((1-β2)(1-r)); with r ≥ 1 it grows without bound, which is why the step
count is checked against the path's. Moments scaled by 1000 break it by √1000 ≈ 31.6 times the honest
ratio (moments scaled by k: √k), a negative `exp_avg_sq` breaks v ≥ 0, and both would make the next
steps' updates m/√v larger than AdamW can ever take. A relative slack of 1e-3 and an absolute one of 1e-18
(a squared gradient that underflowed in float32) absorb the rounding. Moments stored in bf16 (their
tensors bf16, or `meta["moments"] == "bf16"` when decoded back to float32) are each rounded by at most
2^-8 relative, so |m|/√v can grow by (1+2^-8)/√(1-2^-8) ≈ 1.006: their relative slack is 1e-2.

**Residual and drift.** Each is bounded by the path's own progress: its norm (all its tensors together) is at
most `max_ratio` × the largest of `delta_norms`, the norms of the path's accepted pseudo-gradients (the
coordinator knows them; the island does not, and passes None: that bound is then the coordinator's
alone). A top-k residual is at most the sent norm over √density (the kept entries hold at least that
share of the energy), the drift at most the training of the tasks since its module was last sent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dipaco.store.module_store import StoreError

MOMENTS = (".exp_avg", ".exp_avg_sq")  # suffixes of AdamW's entries (dipaco.optim.inner.optimizer_state)
MUON = ".momentum_buffer"  # the suffix of Muon's entry (dipaco.optim.muon)
CARRIED = ("residual/", "drift/")  # prefixes of the residual's and the drift's entries
RELATIVE_SLACK, ABSOLUTE_SLACK = 1e-3, 1e-18  # float32 rounding in |m| ≤ c √v
BF16_SLACK = 1e-2  # bf16-stored moments (a checkpoint): m and v each rounded by ≤ 2^-8, |m|/√v by ≤ ~0.6%


class InnerStateInvalid(StoreError):
    """A path's inner state in the store is not one its AdamW and its codec could have left."""


def moment_bound(beta1: float, beta2: float, step: int) -> float:
    """c_t(β1, β2): |exp_avg| ≤ c_t √exp_avg_sq after `step` AdamW steps (module docstring)."""
    r = beta1 * beta1 / beta2
    series = float(step) if math.isclose(r, 1.0) else (1.0 - r**step) / (1.0 - r)
    return (1.0 - beta1) * math.sqrt(series / (1.0 - beta2))


def check_inner_state(tensors: dict[str, torch.Tensor], meta: dict, *, file: str,
                      expected_shapes: dict[str, list[int]], max_step: int, betas: tuple[float, float],
                      delta_norms: Sequence[float] | None = None, max_ratio: float = 0.0) -> None:
    """Refuse (InnerStateInvalid naming `file` and the tensor) an inner state `tensors` with metadata `meta`
    (`{"step": {param: int}}`) that is not the AdamW moments, residual and drift of the parameters
    `expected_shapes` (`{"module/param": shape}`) after at most `max_step` steps with `betas`, or whose
    residual or drift is over `max_ratio` × max(`delta_norms`) (None, empty, or `max_ratio` 0: not checked)."""
    params = {name.partition("/")[2]: list(shape) for name, shape in expected_shapes.items()}  # param -> shape
    moments, carried, shapes = _sort_entries(tensors, params, expected_shapes, file=file)
    for name, tensor in tensors.items():
        _check_tensor(name, tensor, shapes[name], file=file, bf16=name not in carried)
    steps = meta.get("step", {}) if isinstance(meta, dict) else None
    if not isinstance(steps, dict):
        raise InnerStateInvalid(f"{file}: its metadata has no AdamW step counts ({str(meta)[:80]})")
    stored_bf16 = meta.get("moments") == "bf16" or any(tensors[k].dtype == torch.bfloat16 for k in moments)
    slack = BF16_SLACK if stored_bf16 else RELATIVE_SLACK
    for param in sorted(set(moments.values())):
        _check_moments(param, tensors[f"{param}.exp_avg"], tensors[f"{param}.exp_avg_sq"], steps.get(param),
                       file=file, max_step=max_step, betas=betas, slack=slack)
    unused = sorted(set(steps) - set(moments.values()))
    if unused:
        raise InnerStateInvalid(f"{file}: step counts for {unused[:3]}, which have no moments")
    if delta_norms and max(delta_norms) > 0 and max_ratio:  # 0: no module sent yet (a fragment's first tasks)
        for prefix in CARRIED:
            _check_carried_norm([t for k, t in tensors.items() if carried.get(k) == prefix], prefix.rstrip("/"),
                                file=file, bound=max_ratio * max(delta_norms), max_ratio=max_ratio)


def carried_norms(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """{module: ‖its residual‖ + ‖its drift‖} of an inner state's tensors (modules with neither left out):
    how far a path's next result may move a module beyond its own training (`update_bound`)."""
    squares: dict[tuple[str, str], float] = {}
    for name, tensor in tensors.items():
        prefix = next((p for p in CARRIED if name.startswith(p)), None)
        if prefix is not None:
            key = (prefix, name.removeprefix(prefix).partition("/")[0])
            squares[key] = squares.get(key, 0.0) + float(tensor.double().square().sum())
    norms: dict[str, float] = {}
    for (_, module), square in squares.items():
        norms[module] = norms.get(module, 0.0) + math.sqrt(square)
    return norms


def _suffix(name: str) -> str | None:
    """The moment suffix `name` ends with (the longer first), None for another name."""
    return next((s for s in reversed(MOMENTS) if name.endswith(s)), None)


def _sort_entries(tensors: dict[str, torch.Tensor], params: dict[str, list[int]], expected_shapes: dict[str, list[int]],
                  *, file: str) -> tuple[dict[str, str], dict[str, str], dict[str, list[int]]]:
    """(moment entry → its parameter, carried entry → its prefix, entry → the shape it must have); a name
    that is none of the path's refused, and a moment without its pair."""
    moments: dict[str, str] = {}
    carried: dict[str, str] = {}
    shapes: dict[str, list[int]] = {}
    for name in tensors:
        prefix, suffix = next((p for p in CARRIED if name.startswith(p)), None), _suffix(name)
        if prefix is not None and name.removeprefix(prefix) in expected_shapes:
            carried[name], shapes[name] = prefix, list(expected_shapes[name.removeprefix(prefix)])
        elif prefix is None and name.endswith(MUON) and name.removesuffix(MUON) in params:
            shapes[name] = params[name.removesuffix(MUON)]  # Muon's momentum: shape and finiteness only
        elif prefix is None and suffix is not None and name.removesuffix(suffix) in params:
            moments[name], shapes[name] = name.removesuffix(suffix), params[name.removesuffix(suffix)]
        else:
            raise InnerStateInvalid(f"{file}: {name} is not a moment, residual or drift of the path's parameters")
    for name, param in moments.items():
        other = param + (".exp_avg_sq" if name.endswith(".exp_avg") else ".exp_avg")
        if other not in tensors:
            raise InnerStateInvalid(f"{file}: {name} has no {other} beside it")
    return moments, carried, shapes


def _check_tensor(name: str, tensor: torch.Tensor, shape: list[int], *, file: str, bf16: bool) -> None:
    """Its shape, its dtype (float32; bf16 too where `bf16`: a moment), finite values."""
    if list(tensor.shape) != shape:
        raise InnerStateInvalid(f"{file}: {name} has shape {list(tensor.shape)}, its parameter's is {shape}")
    if tensor.dtype != torch.float32 and not (bf16 and tensor.dtype == torch.bfloat16):
        raise InnerStateInvalid(f"{file}: {name} is {tensor.dtype}, not float32" + (" or bfloat16" if bf16 else ""))
    if not bool(torch.isfinite(tensor).all()):
        raise InnerStateInvalid(f"{file}: {name} has {int((~torch.isfinite(tensor)).sum())} NaN or infinite values")


def _check_moments(param: str, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: object, *, file: str,
                   max_step: int, betas: tuple[float, float], slack: float) -> None:
    """One parameter's moments are ones AdamW leaves after `step` ≤ `max_step` steps (module docstring), up to
    a relative `slack` for their rounding."""
    if not isinstance(step, int) or isinstance(step, bool) or not 1 <= step <= max_step:
        raise InnerStateInvalid(f"{file}: {param} has AdamW step count {step!r}, the path has trained "
                                f"{max_step} steps")
    negative = int((exp_avg_sq < 0).sum())
    if negative:
        raise InnerStateInvalid(f"{file}: {param}.exp_avg_sq has {negative} negative values "
                                f"(min {float(exp_avg_sq.min()):.3g}); AdamW's second moment is a sum of squares")
    c = moment_bound(*betas, step)
    excess = exp_avg.double().abs() - (c * (1 + slack) * exp_avg_sq.double().sqrt() + ABSOLUTE_SLACK)
    if bool((excess > 0).any()):
        i = int(excess.flatten().argmax())
        m, v = float(exp_avg.flatten()[i]), float(exp_avg_sq.flatten()[i])
        raise InnerStateInvalid(f"{file}: {param}.exp_avg has {int((excess > 0).sum())} values above c √exp_avg_sq "
                                f"(c = {c:.4g} after {step} steps with betas {tuple(betas)}), e.g. |{m:.3g}| > "
                                f"{c:.4g} x √{v:.3g}: not moments AdamW can leave")


def _check_carried_norm(entries: list[torch.Tensor], label: str, *, file: str, bound: float, max_ratio: float) -> None:
    """The residual's (or the drift's) tensors, taken together, have a norm of at most `bound`."""
    norm = math.sqrt(sum(float(t.double().square().sum()) for t in entries))
    if norm > bound:
        raise InnerStateInvalid(f"{file}: its {label} has norm {norm:.4g}, above {bound:.4g} ({max_ratio:g} x the "
                                f"largest of the path's accepted pseudo-gradient norms)")
