"""The run directory: where each stage reads and writes, in one place.

    runs/demo/
      config.yaml      the resolved config every stage and island reads
      tokenizer/       the BPE tokenizer (AutoTokenizer.from_pretrained loads it)
      routing/         router.safetensors + router.json, assignments.safetensors + .json
      shards/          index.json + path-0000/train-00000.tok.zst ... (sharding.format)
      pretrain/        the dense warm start: model.safetensors, hf/, shards/ (dipaco.stages.pretrain)
      store/           the module store (dipaco.store), unless store.url points elsewhere
      baselines/       dense baselines: <name>/model.safetensors + <name>/summary.json
      logs/            one log file per island task and baseline
      tensorboard/     the coordinator's per-round metrics as TensorBoard event files (dipaco.islands.coordinator.metrics)
      train.json       per-round training summary;  eval.json  the evaluation results
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def routing(self) -> Path:
        return self.root / "routing"

    @property
    def shards(self) -> Path:
        return self.root / "shards"

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def pretrain(self) -> Path:
        return self.root / "pretrain"

    @property
    def baselines(self) -> Path:
        return self.root / "baselines"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def train_summary(self) -> Path:
        return self.root / "train.json"

    @property
    def eval_results(self) -> Path:
        return self.root / "eval.json"

    def require(self, path: Path, stage: str) -> Path:
        """`path`, or an error telling which stage makes it."""
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist: run `dipaco {stage} --run {self.root}` first")
        return path
