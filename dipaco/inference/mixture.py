"""A whole exported mixture as one object: route each prompt by its prefix to one path, generate with it.

    import dipaco
    mixture = dipaco.load("out/demo")                              # the k-means router (the manifest's route)
    mixture = dipaco.load("out/demo", route="likelihood", max_loaded=2)
    print(mixture.generate("In the beginning", max_new_tokens=20))  # the prompt and its continuation
    completion = mixture.complete("def fibonacci(n):")             # .path, .continuation, .tokens
    CPU check: python -c "import dipaco; print(dipaco.load('out/demo').generate('In the beginning'))"

`dipaco export DIR --run RUN` writes the directory (`dipaco.inference.manifest`). Routing and generation
are `dipaco generate`'s own functions (`prompt_routing.route_prompts`, `continuation.continue_tokens`),
so a greedy continuation here equals `dipaco generate`'s token for token. Paths are loaded when first
routed to and at most `max_loaded` stay in memory (`PathCache`). Only JSON and safetensors are read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

from dipaco.config import TopologyConfig
from dipaco.eval.prefix_routing import PrefixRouter
from dipaco.inference.continuation import check_options, continue_tokens
from dipaco.inference.hub_repo import INDEX, load_hub_tokenizer, load_path_model
from dipaco.inference.manifest import MANIFEST, Manifest, pickled_files, read_manifest
from dipaco.inference.path_cache import PathCache
from dipaco.inference.prompt_routing import route_prompts
from dipaco.inference.routes import parse_route
from dipaco.model.topology import Topology
from sharding.tokenizer import encode_batch, load_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    """One routed generation: the path that ran, the generated token ids, the prompt and its continuation
    as text (`text`, as `dipaco generate` prints it) and the generated tokens alone (`continuation`)."""

    path: int
    prompt_tokens: int
    tokens: np.ndarray
    text: str
    continuation: str


class Mixture:
    """An exported mixture (`dipaco export DIR`): the tokenizer, the routing (`route`: the k-means router,
    or `likelihood`, the paths' own loss on the prompt's prefix) and every path, loaded lazily."""

    def __init__(self, directory: str | Path, *, route: str | None = None, max_loaded: int | None = None,
                 device: str | torch.device = "cpu"):
        self.directory = Path(directory)
        self.manifest: Manifest = read_manifest(self.directory)
        self.route = route or self.manifest.route
        parse_route(self.route)
        self.device = torch.device(device)
        self.tokenizer: PreTrainedTokenizerBase = (
            load_hub_tokenizer(self.directory) if self.manifest.tokenizer == "."
            else load_tokenizer(self.directory / self.manifest.tokenizer))
        self.paths = PathCache(self._load_path, max_loaded=max_loaded)
        self.router = None if self.route == "likelihood" else self._prefix_router()  # likelihood:K's shortlist too

    def __repr__(self) -> str:
        return (f"Mixture({str(self.directory)!r}, paths={self.path_ids}, route={self.route!r}, "
                f"loaded={self.paths.loaded})")

    @property
    def prefix_tokens(self) -> int:
        """The routing prefix: a prompt is routed by its first `prefix_tokens` tokens."""
        return self.manifest.prefix_tokens

    @property
    def max_length(self) -> int:
        """The most tokens a path reads (the run's `sharding.seq_len`)."""
        return self.manifest.max_length

    @property
    def path_ids(self) -> list[int]:
        """The paths of the mixture, in order (the run's numbering)."""
        return sorted(self.manifest.paths)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text, as the run tokenized its documents (no special tokens added)."""
        return encode_batch(self.tokenizer, texts)

    def route_tokens(self, prompts: list[np.ndarray]) -> np.ndarray:
        """The path (N,) of each tokenized prompt, from its first `prefix_tokens` tokens."""
        versions = {p: entry.round for p, entry in self.manifest.paths.items()}
        return route_prompts(prompts, route=self.route, router=self.router, prefix_tokens=self.prefix_tokens,
                             load=lambda path, _version: self.model(path), versions=versions, device=self.device)

    def route_texts(self, texts: list[str]) -> np.ndarray:
        """The path (N,) of each prompt."""
        return self.route_tokens(self.encode(texts))

    def model(self, path: int) -> LlamaForCausalLM:
        """Path `path`'s model (loaded on first use; see `max_loaded`)."""
        if path not in self.manifest.paths:
            raise ValueError(f"the mixture in {self.directory} has paths {sorted(self.manifest.paths)}, not {path}")
        return self.paths.get(path)

    def complete(self, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0,
                 seed: int = 0) -> Completion:
        """Route `prompt`, then continue it with that path: greedy when `temperature` is 0, else sampled with
        `seed`; at most `max_new_tokens` tokens, and no more than `max_length` tokens in all."""
        check_options(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, route=self.route)
        (tokens,) = self.encode([prompt])
        (path,) = self.route_tokens([tokens])
        new = continue_tokens(self.model(int(path)), tokens, max_length=self.max_length,
                              max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                              pad_id=self.tokenizer.pad_token_id, eos_id=self.tokenizer.eos_token_id)
        return Completion(path=int(path), prompt_tokens=len(tokens), tokens=new,
                          text=self.tokenizer.decode([*tokens.tolist(), *new.tolist()], skip_special_tokens=True),
                          continuation=self.tokenizer.decode(new.tolist(), skip_special_tokens=True))

    def generate(self, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0) -> str:
        """The prompt and its routed continuation as text (`complete` has the path and the tokens)."""
        return self.complete(prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed).text

    def _load_path(self, path: int) -> LlamaForCausalLM:
        entry = self.manifest.paths[path]
        if entry.modules is not None:  # format 2: built from the shared modules in the shards
            _check_safe(self.directory, INDEX)
            model = load_path_model(self.directory, path=path, modules=entry.modules)
            log.info("built path %d from modules %s", path, sorted(entry.modules.values()))
            return model.to(self.device).eval()
        directory = self.directory / entry.dir
        _check_safe(directory, "model.safetensors")
        model = LlamaForCausalLM.from_pretrained(directory, use_safetensors=True, local_files_only=True)
        log.info("loaded path %d from %s", path, directory)
        return model.to(self.device).eval()

    def _prefix_router(self) -> PrefixRouter:
        from routing.router import Router  # faiss and scikit-learn: only a mixture routed by its router pays

        manifest = self.manifest
        if manifest.router is None:
            raise ValueError(f"{self.directory / MANIFEST} names no router: load it with route='likelihood'")
        featurizer = None if manifest.featurizer is None else self.directory / manifest.featurizer
        if featurizer is not None:
            _check_safe(featurizer, "config.json")
        router = Router.load(self.directory / manifest.router, featurizer_model=featurizer)
        grid = Topology.from_config(TopologyConfig(levels=list(manifest.levels), replicas=manifest.replicas),
                                    n_layers=len(manifest.levels))  # only the grid: which path a choice is
        return PrefixRouter(router, self.tokenizer, grid, prefix_tokens=manifest.prefix_tokens)


def _check_safe(directory: Path, needed: str) -> None:
    """Refuse a model directory of the mixture that lacks `needed` or holds a file whose loading unpickles."""
    pickled = pickled_files(directory)
    if pickled:
        raise ValueError(f"{directory} holds {pickled}: a mixture loads safetensors and JSON only, never a pickle")
    if not (directory / needed).is_file():
        raise ValueError(f"{directory} has no {needed}: export the mixture again (`dipaco export`)")


def load(directory: str | Path, *, route: str | None = None, max_loaded: int | None = None,
         device: str | torch.device = "cpu") -> Mixture:
    """The mixture exported to `directory` by `dipaco export` (`Mixture`)."""
    return Mixture(directory, route=route, max_loaded=max_loaded, device=device)
