"""A path is a standard Hugging Face causal LM; this file builds one and maps it to and from modules.

    spec = PathSpec(model=cfg.model, vocab_size=4096, seq_len=256)
    model = spec.new_model(seed=0)
    modules = split_into_modules(model, topology, path=3)   # {module: {param_name: tensor}}
    model = assemble_path(spec, modules)                     # a fresh model holding those tensors
    save_parameters(model, "model.safetensors"); load_parameters(model, "model.safetensors")

No weights are downloaded: the model is a `LlamaForCausalLM` built from a `LlamaConfig`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from dipaco.atomic import replacing
from dipaco.config import ModelConfig
from dipaco.model.topology import Topology


def llama_config(config: ModelConfig, *, vocab_size: int, seq_len: int, eos_id: int | None = None,
                 pad_id: int | None = None) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.mlp_size,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_heads,
        max_position_embeddings=seq_len,
        rope_theta=config.rope_theta,
        initializer_range=config.init_std,
        attention_dropout=config.dropout,
        tie_word_embeddings=config.tie_embeddings,
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=pad_id,
        use_cache=False,
    )


def build_path_model(config: ModelConfig, *, vocab_size: int, seq_len: int, seed: int | None = None,
                     eos_id: int | None = None, pad_id: int | None = None) -> LlamaForCausalLM:
    """A freshly initialised path model (seeded when `seed` is given), in float32 on the CPU."""
    if seed is not None:
        torch.manual_seed(seed)
    hf_config = llama_config(config, vocab_size=vocab_size, seq_len=seq_len, eos_id=eos_id, pad_id=pad_id)
    return LlamaForCausalLM(hf_config)


def path_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The model's trainable parameters by name (a tied head appears once, as the embedding)."""
    return dict(model.named_parameters())


def split_into_modules(model: torch.nn.Module, topology: Topology, *, path: int) -> dict[str, dict[str, torch.Tensor]]:
    """Group a path model's parameters by module: `{module: {param_name: detached float32 copy}}`."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in path_parameters(model).items():
        module = topology.module_of_param(name, path)
        modules.setdefault(module, {})[name] = param.detach().float().cpu().clone()
    return modules


def load_modules(model: torch.nn.Module, modules: dict[str, dict[str, torch.Tensor]]) -> None:
    """Copy module tensors into a path model; every parameter must be covered exactly once."""
    params = path_parameters(model)
    seen: set[str] = set()
    for module, tensors in modules.items():
        for name, tensor in tensors.items():
            if name not in params:
                raise ValueError(f"module {module!r} holds {name!r}, which the path model does not have")
            if name in seen:
                raise ValueError(f"parameter {name!r} appears in more than one module")
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"module {module!r}: {name} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(params[name].shape)}"
                )
            with torch.no_grad():
                params[name].copy_(tensor)
            seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"no module holds the parameters {missing[:4]} ({len(missing)} missing)")


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in path_parameters(model).values())


@dataclass(frozen=True)
class PathSpec:
    """Everything needed to build a path-shaped model: the architecture, vocabulary and sequence length."""

    model: ModelConfig
    vocab_size: int
    seq_len: int
    eos_id: int | None = None
    pad_id: int | None = None

    def new_model(self, *, seed: int | None = None) -> LlamaForCausalLM:
        """A freshly initialised model of this shape (seeded when `seed` is given), float32 on the CPU."""
        return build_path_model(self.model, vocab_size=self.vocab_size, seq_len=self.seq_len, seed=seed,
                                eos_id=self.eos_id, pad_id=self.pad_id)


def assemble_path(spec: PathSpec, modules: dict[str, dict[str, torch.Tensor]], *,
                  device: torch.device | None = None) -> LlamaForCausalLM:
    """A model of shape `spec` holding exactly the tensors of `modules` (one path's modules)."""
    model = spec.new_model()
    load_modules(model, modules)
    return model.to(device) if device is not None else model


def save_parameters(model: torch.nn.Module, file: str | os.PathLike) -> None:
    """Write a model's parameters to a safetensors file (atomically: a temporary name, then a rename)."""
    with replacing(file) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in path_parameters(model).items()}, str(tmp))


def load_parameters(model: torch.nn.Module, file: str | os.PathLike) -> None:
    """Copy a safetensors file of `save_parameters` into `model`; names and shapes must match exactly."""
    tensors = load_file(str(file))
    params = path_parameters(model)
    missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or extra:
        raise ValueError(f"{file} does not match the model: missing {missing[:3]}, unexpected {extra[:3]} "
                         f"(another model or vocabulary setting?)")
    for key, param in params.items():
        if param.shape != tensors[key].shape:
            raise ValueError(f"{file}: {key} has shape {tuple(tensors[key].shape)}, the model expects "
                             f"{tuple(param.shape)} (another model or vocabulary setting?)")
        with torch.no_grad():
            param.copy_(tensors[key])

