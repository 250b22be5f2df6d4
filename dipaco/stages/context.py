"""Everything a stage needs to build and load path models for a run, derived once from the config.

    factory = PathFactory(config, RunDir("runs/demo"))
    model = factory.load_path(path=3, round=factory.store.current_round())

The vocabulary comes from the run's tokenizer, the sequence length from the shards, the grid from
the topology; models are plain `LlamaForCausalLM`s holding one path's parameters at a time.
"""

from __future__ import annotations

from functools import cached_property

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

from dipaco.config import Config
from dipaco.eval.early_stopping import ValidationData
from dipaco.model.path_model import PathSpec, assemble_path
from dipaco.model.topology import Topology
from dipaco.run_dir import RunDir
from dipaco.store.module_store import ModuleStore
from routing.router import Router
from sharding.reader import ShardReader
from sharding.tokenizer import load_tokenizer


class PathFactory:
    def __init__(self, config: Config, run: RunDir):
        self.config = config
        self.run = run

    @cached_property
    def topology(self) -> Topology:
        return Topology.from_config(self.config.topology, n_layers=self.config.model.n_layers)

    @cached_property
    def store(self) -> ModuleStore:
        return ModuleStore(self.config.train.store_url or str(self.run.store))

    @cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return load_tokenizer(self.run.require(self.run.tokenizer, "route"))

    @cached_property
    def router(self) -> Router:
        return Router.load(self.run.require(self.run.routing / "router.json", "route").parent)

    @cached_property
    def reader(self) -> ShardReader:
        reader = ShardReader(self.run.require(self.run.shards / "index.json", "shard").parent)
        if reader.n_paths != self.topology.n_paths:
            raise ValueError(
                f"{self.run.shards / 'index.json'} holds {reader.n_paths} paths, but topology.levels "
                f"{list(self.topology.levels)} gives {self.topology.n_paths}: run `dipaco route` and "
                f"`dipaco shard` again for this grid, or use another --run"
            )
        return reader

    @cached_property
    def spec(self) -> PathSpec:
        """The shape of every path model of this run (vocabulary from the run's tokenizer)."""
        return PathSpec(model=self.config.model, vocab_size=len(self.tokenizer), seq_len=self.config.sharding.seq_len,
                        eos_id=self.tokenizer.eos_token_id, pad_id=self.tokenizer.pad_token_id)

    @property
    def validation(self) -> ValidationData:
        """Each path's validation batches, as the islands score them (early stopping)."""
        return ValidationData(reader=self.reader, batch_size=self.config.inner.batch_size,
                              max_batches=self.config.inner.val_batches, precision=self.config.train.precision)

    def new_model(self, *, seed: int | None = None) -> LlamaForCausalLM:
        """A path-shaped model (random weights, seeded when `seed` is given)."""
        return self.spec.new_model(seed=seed)

    def load_path(self, *, path: int, round: int, device: torch.device | None = None) -> LlamaForCausalLM:
        """Path `path` assembled from the store's modules after round `round`."""
        modules = self.store.read_modules(round, self.topology.modules_of_path(path))
        return assemble_path(self.spec, modules, device=device)
