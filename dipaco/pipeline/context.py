"""Everything a stage needs to build and load path models for a run, derived once from the config.

    factory = PathFactory(config, RunDir("runs/demo"))
    model = factory.load_path(path=3, round=factory.store.current_round())
    factory.topology, factory.store, factory.tokenizer, factory.reader, factory.router, factory.spec
    factory.prefix_tokens                     # the one place `routing.prefix_tokens` is read

The vocabulary comes from the run's tokenizer, the sequence length from the shards, the grid from
the topology; models are plain `LlamaForCausalLM`s holding one path's parameters at a time. Stages
build one at their entry point and hand their helpers the pieces they use; `path_spec`,
`baseline_budgets` and `chosen_versions` are the other readings of the config several stages share.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

from dipaco.config import Config
from dipaco.eval.dense_baselines import baseline_steps
from dipaco.eval.early_stopping import ValidationData
from dipaco.model.path_model import PathSpec, assemble_path
from dipaco.model.topology import Topology
from dipaco.optim.weighting import PathSizes
from dipaco.pipeline.published import shard_fetcher
from dipaco.run_dir import RunDir
from dipaco.store.module_store import ModuleStore
from sharding.reader import ShardReader
from sharding.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from routing.router import Router


class PathFactory:
    def __init__(self, config: Config, run: RunDir):
        self.config = config
        self.run = run

    @cached_property
    def topology(self) -> Topology:
        return Topology.from_config(self.config.topology, n_layers=self.config.model.n_layers)

    @property
    def prefix_tokens(self) -> int:
        """The routing prefix every stage cuts, scores after and exports (`routing.prefix_tokens`)."""
        return self.config.routing.prefix_tokens

    @cached_property
    def store(self) -> ModuleStore:
        return ModuleStore(self.config.store.url or str(self.run.store))

    @cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return load_tokenizer(self.run.require(self.run.tokenizer, "route"))

    @cached_property
    def router(self) -> Router:
        from routing.router import Router  # scikit-learn and faiss: only the stages that route pay for them

        return Router.load(self.run.require(self.run.routing / "router.json", "route").parent)

    @cached_property
    def reader(self) -> ShardReader:
        reader = ShardReader(self.run.require(self.run.shards / "index.json", "shard").parent,
                             fetch=shard_fetcher(self.run, store=self.store, config=self.config))  # store-only runs
        if reader.n_paths != self.topology.n_paths:
            raise ValueError(
                f"{self.run.shards / 'index.json'} holds {reader.n_paths} paths, but topology.levels "
                f"{list(self.topology.levels)} gives {self.topology.n_paths}: run `dipaco route` and "
                f"`dipaco shard` again for this grid, or use another --run"
            )
        return reader

    @cached_property
    def path_sizes(self) -> PathSizes:
        """Each path's training-shard tokens (from shards/index.json, no shard is read) and the tokens one
        inner step trains on one rank: what the outer step weights results by (`dipaco.optim.weighting`)."""
        reader, inner = self.reader, self.config.inner
        return PathSizes(shard_tokens=tuple(reader.num_tokens(p, "train") for p in range(self.topology.n_paths)),
                         step_tokens=inner.batch_size * reader.seq_len)

    @cached_property
    def spec(self) -> PathSpec:
        """The shape of every path model of this run (vocabulary from the run's tokenizer)."""
        return path_spec(self.config, self.tokenizer)

    @property
    def validation(self) -> ValidationData:
        """Each path's validation batches, as the islands score them (early stopping)."""
        return ValidationData(reader=self.reader, batch_size=self.config.inner.batch_size,
                              max_batches=self.config.inner.val_batches, precision=self.config.hardware.precision)

    def new_model(self, *, seed: int | None = None) -> LlamaForCausalLM:
        """A path-shaped model (random weights, seeded when `seed` is given)."""
        return self.spec.new_model(seed=seed)

    def load_path(self, *, path: int, round: int, device: torch.device | None = None) -> LlamaForCausalLM:
        """Path `path` assembled from the store's modules after round `round`."""
        modules = self.store.read_modules(round, self.topology.modules_of_path(path))
        return assemble_path(self.spec, modules, device=device)


def chosen_versions(factory: PathFactory, *, round: int | None, best: bool) -> dict[int, int]:
    """The module version of each path that `--round` (default: the last) or `--best` ask for."""
    if best:
        from dipaco.device import resolve_device
        from dipaco.eval.early_stopping import best_of_run

        return best_of_run(factory.store, factory.topology, factory.spec, factory.validation,
                           device=resolve_device(factory.config.hardware.device))[0]
    last = factory.store.current_round()
    round = last if round is None else round
    if not 0 <= round <= last:
        raise ValueError(f"--round {round} is outside the store's rounds 0..{last}")
    return {p: round for p in range(factory.topology.n_paths)}


def path_spec(config: Config, tokenizer: PreTrainedTokenizerBase) -> PathSpec:
    """The shape of a path model: `config.model` with the tokenizer's vocabulary, `sharding.seq_len` long."""
    return PathSpec(model=config.model, vocab_size=len(tokenizer), seq_len=config.sharding.seq_len,
                    eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)


def baseline_budgets(config: Config, n_paths: int) -> dict[str, int]:
    """The step budget of each dense baseline this config asks for (`dipaco.eval.dense_baselines`): the
    warm start's steps included."""
    return baseline_steps(steps_per_path=config.run.rounds * config.inner.steps, n_paths=n_paths,
                          large=config.eval.large_hidden_size > 0, pretrain_steps=config.pretrain_steps)


def check_schedule(config: Config, record: Path) -> None:
    """Refuse to continue the dense warm start (`dipaco pretrain`) whose `summary.json` is `record` under another `inner.schedule`
    than it was trained with (a `wsd` warm start never decayed; a `cosine` one did): an error naming the file."""
    if not record.exists():
        return
    trained = json.loads(record.read_text()).get("schedule", {}).get("name", "cosine")  # older summaries: cosine
    if trained != config.inner.schedule:
        raise ValueError(f"{record} records a warm start trained with inner.schedule {trained!r}, but inner.schedule "
                         f"is {config.inner.schedule!r}: set it back, or run `dipaco pretrain` again "
                         f"(`dipaco run --restart-from pretrain`)")


def warm_start_optimizer(config: Config, run: RunDir) -> Path | None:
    """The warm start's AdamW state (`pretrain/optimizer.safetensors`) when `warm_start.continue_optimizer`
    says to continue it, else None; an error naming the file when it is missing."""
    if not config.warm_start.continue_optimizer:
        return None
    file = run.pretrain / "optimizer.safetensors"
    if not file.exists():
        raise ValueError(f"warm_start.continue_optimizer is set but {file} is missing (a warm start pretrained before "
                         f"dipaco saved its AdamW state): run `dipaco pretrain` again, or set warm_start.continue_optimizer=false")
    return file

