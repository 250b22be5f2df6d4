"""A path's carried state: its inner optimizer's moments, its error-feedback residual and its fragments' drift,
as one object that owns its tensors, checks them, and decides when they cross the wire.

    state = CarriedState.of_optimizer(optimizer, names, residual=e, drift=d)   # after a task, kept in memory
    state.load_into(optimizer, params)                                          # the path's next task continues it
    reason = UploadPlan(every=10, inner_steps=H, total_steps=R * H).reason(step_offset=s, steps=H)
    tensors, meta = state.to_tensors(moments=MOMENTS_OF[reason])               # "checkpoint": moments in bf16
    state = CarriedState.from_tensors(tensors, meta, where=file); state.check(shapes, where=file, max_step=n, betas=(0.9, 0.95))

The state belongs to the path and lives on the island that trains it (`docs/islands.md#carried-state`). It
crosses the wire only when `UploadPlan.reason` says so: every `resilience.inner_checkpoint_every` tasks of
the path (a checkpoint, its moments in bf16), on the path's last task (bf16 too: it serves only a run
extended later), and on a hand-off (the island stops
cleanly, or the path moves to another island while this one is alive); that one in float32, so the path
continues exactly. A path moved after its island died resumes from its last checkpoint (`stale`: the
moments only; the residual and drift a checkpoint held were measured against modules since moved on).

On disk (one safetensors file, `dipaco.store.board.inner_ref`): AdamW's `<param>.exp_avg` and
`<param>.exp_avg_sq`, with `inner.optimizer: muon` Muon's `<param>.momentum_buffer` for the blocks' matrices
instead (`dipaco.optim.muon`) (float32 or bf16; bf16 rounding keeps exp_avg_sq ≥ 0), `residual/<module>/<param>` and
`drift/<module>/<param>` (float32 always: training not sent yet), and in the header's metadata the AdamW
step counts (`{"step": {param: n}}`) and the moments' dtype. An island writes it, so everything read back is
checked (`check`, through the one validator `dipaco.carried.validate`) and refused naming the file and
the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dipaco.carried.validate import carried_norms, check_inner_state
from dipaco.optim.inner import load_optimizer_state, optimizer_state
from dipaco.store.module_store import StoreError

RESIDUAL = "residual/"  # prefix of the error-feedback residual's entries on disk
DRIFT = "drift/"  # prefix of the drift's entries on disk
MOMENTS = {"float32": torch.float32, "bf16": torch.bfloat16}  # the dtypes moments are stored in
MOMENTS_OF = {"checkpoint": "bf16", "last": "bf16", "hand-off": "float32"}  # by upload reason (last: kept to extend the run, as a checkpoint)



@dataclass
class CarriedState:
    """What a path's tasks hand on besides its modules; every tensor float32 on the CPU."""

    adam: dict[str, torch.Tensor] = field(default_factory=dict)  # the moments: "<param>.exp_avg" / ".exp_avg_sq" / ".momentum_buffer" (Muon) (empty: fresh)
    steps: dict[str, int] = field(default_factory=dict)  # AdamW's step count per parameter
    residual: dict[str, torch.Tensor] = field(default_factory=dict)  # "module/param" -> e (empty: zeros)
    drift: dict[str, torch.Tensor] = field(default_factory=dict)  # "module/param" -> θ_base − θ_local of modules not sent
    stored: str = "float32"  # the dtype its moments were read from the store in (`MOMENTS`; bf16: a checkpoint's)

    @classmethod
    def of_optimizer(cls, optimizer: torch.optim.Optimizer, names: dict[torch.nn.Parameter, str], *,
                     residual: dict[str, torch.Tensor], drift: dict[str, torch.Tensor]) -> CarriedState:
        adam, meta = optimizer_state(optimizer, names)
        return cls(adam=adam, steps=meta["step"], residual=residual, drift=drift)

    def load_into(self, optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter]) -> None:
        """Give `optimizer` these moments (copies: the optimizer steps them in place, this state stays)."""
        load_optimizer_state(optimizer, params, {k: t.clone() for k, t in self.adam.items()}, {"step": self.steps})

    def stale(self) -> CarriedState:
        """The state a path moved from an older checkpoint continues: its moments (the residual and the
        drift were measured against the modules of that time, which have moved on since)."""
        return CarriedState(adam=self.adam, steps=self.steps, stored=self.stored)

    def to_tensors(self, *, moments: str = "float32") -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, metadata) as stored; `moments` "bf16" halves the moments' bytes."""
        dtype = MOMENTS[moments]
        tensors = {k: t.to(dtype).contiguous() for k, t in self.adam.items()}
        tensors |= {RESIDUAL + k: t.contiguous() for k, t in self.residual.items()}
        tensors |= {DRIFT + k: t.contiguous() for k, t in self.drift.items()}
        return tensors, {"step": dict(self.steps), "moments": moments}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict, *, where: str) -> CarriedState:
        """The inverse of `to_tensors` (moments back in float32); refuses a malformed header naming `where`."""
        steps = meta.get("step") if isinstance(meta, dict) else None
        if not isinstance(steps, dict) or not all(isinstance(v, int) and v >= 0 for v in steps.values()):
            raise StoreError(f"{where}: inner state metadata has no valid AdamW step counts")
        stored = "bf16" if any(t.dtype == torch.bfloat16 for t in tensors.values()) else "float32"
        state = cls(steps=dict(steps), stored=stored)
        for name, tensor in tensors.items():
            if name.startswith(RESIDUAL):
                state.residual[name.removeprefix(RESIDUAL)] = tensor
            elif name.startswith(DRIFT):
                state.drift[name.removeprefix(DRIFT)] = tensor
            elif tensor.dtype in MOMENTS.values():
                state.adam[name] = tensor.float()
            else:
                raise StoreError(f"{where}: inner state moment {name} is {tensor.dtype}, not float32 or bfloat16")
        return state

    def nbytes(self) -> int:
        """Bytes of its tensors in memory (float32)."""
        return sum(t.numel() * t.element_size()
                   for part in (self.adam, self.residual, self.drift) for t in part.values())

    def check(self, shapes: dict[str, list[int]], *, where: str, max_step: int,
              betas: tuple[float, float]) -> None:
        """Refuse (StoreError naming `where` and the tensor) a state that does not fit the path whose
        parameters `shapes` gives (`{"module/param": shape}`) after at most `max_step` AdamW steps with
        `betas`: the one validator (`dipaco.carried.validate.check_inner_state`: names, shapes, finite
        values, AdamW's consistency, with the slack of the dtype the moments were stored in), and a residual
        that is not every parameter's (or none)."""
        tensors, meta = self.to_tensors()
        check_inner_state(tensors, meta | {"moments": self.stored}, file=where, expected_shapes=shapes,
                          max_step=max_step, betas=betas)
        if self.residual:
            missing, unexpected = sorted(set(shapes) - set(self.residual)), sorted(set(self.residual) - set(shapes))
            if missing or unexpected:
                raise StoreError(f"{where}: error-feedback residual does not match the path's parameters "
                                 f"(missing {missing[:3]}, unexpected {unexpected[:3]})")

    def norms(self) -> dict[str, float]:
        """{module: ‖residual‖ + ‖drift‖} (`dipaco.carried.validate.carried_norms`): how far the path's next
        result may move a module beyond its own training (the poison bound's c_m, `ResultMeta.carried_norms`)."""
        return carried_norms({RESIDUAL + k: t for k, t in self.residual.items()}
                             | {DRIFT + k: t for k, t in self.drift.items()})


@dataclass(frozen=True)
class UploadPlan:
    """When a path's carried state crosses the wire (the one place that decides it)."""

    every: int  # resilience.inner_checkpoint_every: a checkpoint every this many tasks of the path (0 = none)
    inner_steps: int  # inner.steps: a task's steps (a cut task trains fewer; checkpoints count steps)
    total_steps: int  # the path's steps over the run (run.rounds × inner.steps)

    def reason(self, *, step_offset: int, steps: int, handing_off: bool = False) -> str | None:
        """Why the state after a task of `steps` steps from `step_offset` is uploaded: "last" (the path's
        last task), "hand-off" (the island lets the path go), "checkpoint" (the path's steps crossed a
        multiple of every × inner_steps), or None (it stays in the island's memory)."""
        end = step_offset + steps
        if end >= self.total_steps:
            return "last"
        if handing_off:
            return "hand-off"
        period = self.every * self.inner_steps
        if period and end // period > step_offset // period:
            return "checkpoint"
        return None
