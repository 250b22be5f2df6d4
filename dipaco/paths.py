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
from dipaco.model import build_path_model, load_modules
from dipaco.run import RunDir
from dipaco.store import ModuleStore
from dipaco.topology import Topology
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
    def reader(self) -> ShardReader:
        reader = ShardReader(self.run.require(self.run.shards / "index.json", "shard").parent)
        if reader.n_paths != self.topology.n_paths:
            raise ValueError(
                f"{self.run.shards / 'index.json'} holds {reader.n_paths} paths, but topology.levels "
                f"{list(self.topology.levels)} gives {self.topology.n_paths}: run `dipaco route` and "
                f"`dipaco shard` again for this grid, or use another --run"
            )
        return reader

    def new_model(self, *, seed: int | None = None) -> LlamaForCausalLM:
        """A path-shaped model (random weights, seeded when `seed` is given)."""
        return build_path_model(
            self.config.model,
            vocab_size=len(self.tokenizer),
            seq_len=self.config.sharding.seq_len,
            seed=seed,
            eos_id=self.tokenizer.eos_token_id,
            pad_id=self.tokenizer.pad_token_id,
        )

    def load_path(self, *, path: int, round: int, device: torch.device | None = None) -> LlamaForCausalLM:
        """Path `path` assembled from the store's modules after round `round`."""
        model = self.new_model()
        load_modules(model, {name: self.store.read_module(round, name) for name in self.topology.modules_of_path(path)})
        return model.to(device) if device is not None else model
