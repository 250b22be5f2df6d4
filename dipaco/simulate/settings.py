"""What one simulation runs: the `simulate` config section, the round policy's `rounds` section, the codec
and inner steps of a task, and the quantities derived from them (total chips, horizon, transfer times)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dipaco.codec.registry import codec_info
from dipaco.config import Config, RoundsConfig, SimulateConfig
from dipaco.simulate.failures import HOUR
from dipaco.store.traffic import ring_allreduce_bytes

INDEX_BITS = 16  # topk: bits of a sent value's offset in its chunk before zstd (an upper estimate)


@dataclass(frozen=True)
class Settings:
    sim: SimulateConfig
    rounds: RoundsConfig = field(default_factory=RoundsConfig)  # how the syncer closes rounds (its mode is each strategy's)
    codec: str = "none"  # how uploaded pseudo-gradients are compressed (compression.codec)
    inner_steps: int = 100  # inner steps per task (inner.steps)
    density: float = 0.03  # codec topk: fraction of the entries sent (compression.density)
    bits: int = 2  # codec topk: bits per sent value (compression.bits)

    @classmethod
    def from_config(cls, config: Config) -> Settings:
        return cls(sim=config.simulate, rounds=config.rounds, codec=config.compression.codec,
                   inner_steps=config.inner.steps, density=config.compression.density, bits=config.compression.bits)

    def with_(self, **changes) -> Settings:
        """The same settings with some `simulate` fields changed (e.g. learners=16)."""
        return dataclasses.replace(self, sim=dataclasses.replace(self.sim, **changes))

    @property
    def total_chips(self) -> int:
        return self.sim.learners * self.sim.chips_per_learner

    @property
    def horizon(self) -> float:
        return self.sim.horizon_hours * HOUR

    @property
    def task_seconds(self) -> float:
        """A task at nominal speed: inner_steps steps."""
        return self.inner_steps * self.sim.step_seconds

    @property
    def upload_bytes(self) -> float:
        """One task's pseudo-gradient, compressed as `compression.codec` says."""
        bits = codec_info(self.codec).bits
        bits = self.density * (self.bits + INDEX_BITS) if bits is None else bits
        return self.sim.model_parameters * bits / 8

    @property
    def download_bytes(self) -> float:
        """The module versions a learner reads for its next task."""
        return self.sim.model_parameters * self.sim.parameter_bytes

    @property
    def handoff_bytes(self) -> float:
        """A path's carried state moved to another learner: AdamW's two float32 moments (as a hand-off uploads them)."""
        return self.sim.model_parameters * 2 * 4.0

    def transfer_seconds(self, nbytes: float) -> float:
        return nbytes * 8 / (self.sim.link_gbit_per_s * 1e9)

    @property
    def data_parallel_step_bytes(self) -> float:
        """Bytes one site's link carries per data-parallel step: a ring all-reduce of the gradients
        between the `learners` sites sends and receives 2 (L - 1) / L of them (0 on one site)."""
        return ring_allreduce_bytes(self.sim.model_parameters * self.sim.parameter_bytes, self.sim.learners)
