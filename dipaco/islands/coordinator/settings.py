"""What a coordinator reads from the config, unpacked once.

    settings = CoordinatorSettings.from_config(config)
"""

from __future__ import annotations

from dataclasses import dataclass

from dipaco.config import Config, OuterConfig, ResilienceConfig, RoundsConfig
from dipaco.optim.outer import path_decay_from


@dataclass(frozen=True)
class CoordinatorSettings:
    outer: OuterConfig  # the outer step
    rounds: RoundsConfig  # when a round closes (sync / async)
    resilience: ResilienceConfig  # heartbeat timeout, lease timeout, result checks
    run_rounds: int  # the run's length: results applied per path (run.rounds)
    inner_steps: int  # steps per task
    keep_versions: int = 2  # module versions retention keeps (store.keep_versions)
    decay_from: int | None = None  # the path step where the inner lr starts to decay (outer.decay); None = never

    @classmethod
    def from_config(cls, config: Config) -> CoordinatorSettings:
        return cls(outer=config.outer, rounds=config.rounds, resilience=config.resilience,
                   run_rounds=config.run.rounds, inner_steps=config.inner.steps,
                   keep_versions=config.store.keep_versions,
                   decay_from=path_decay_from(config.inner, rounds=config.run.rounds,
                                              warm_start_steps=config.warm_start_steps))
