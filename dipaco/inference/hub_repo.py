"""The mixture as a Hugging Face repository: a top-level `config.json` whose `auto_map` names the modeling
files shipped beside it (`hub/configuration_dipaco.py`, `hub/modeling_dipaco.py`: torch and transformers
only), every module's tensors once in sharded safetensors with an index, and the tokenizer at the top.

    write_weights(out, tensors, shard_bytes=2**31)    # model-00001-of-00002.safetensors ... + the index
    read_tensors(out, ["grid.embeddings.model.norm.weight"])   # {name: tensor}, from whichever shard holds it
    write_hub_config(out, llama=..., topology=..., paths=..., route="router", router=..., ...)
    clean_tokenizer(out, max_length=256); normal_permissions(out)

Weight names: `grid.<module>.<parameter of a path model>` (`dipaco.model.topology` names the modules), and
the router's arrays `router.<name>` (`hub_router`). `dipaco.load` reads the same files (`load_path_model`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dipaco.model.topology import Topology

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
MANIFEST_NAME = "dipaco_mixture.json"
HUB_FILES = Path(__file__).parent / "hub"
MODELING = ("configuration_dipaco.py", "modeling_dipaco.py")
MODEL_TYPE = "dipaco_mixture"
ARCHITECTURE = "DipacoMixtureForCausalLM"
SHARD_BYTES = 2 * 1024**3  # a shard holds at most this much (one larger tensor gets a shard of its own)
LOAD_TIME_KEYS = ("is_local", "local_files_only", "name_or_path", "_commit_hash")  # never written back
TFIDF_VECTORIZER = {"stop_words": "english", "sublinear_tf": True, "lowercase": True}  # what modeling_dipaco computes


def grid_name(stored: str, param: str) -> str:
    """The weight name of a path model's parameter `param` in the module stored as `stored`."""
    return f"grid.{stored}.{param}"


def write_weights(out: Path, tensors: Iterable[tuple[str, torch.Tensor]], *,
                  shard_bytes: int = SHARD_BYTES) -> dict[str, str]:
    """Write `(name, tensor)` pairs to `model-0000i-of-0000n.safetensors` shards of at most `shard_bytes`
    and `model.safetensors.index.json`; returns the weight map {name: file}."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        if name in shards[-1] or any(name in s for s in shards):
            raise ValueError(f"weight {name!r} written twice")
        shards[-1][name] = tensor.detach().cpu().contiguous()
        size += nbytes
        total += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                         "weight_map": dict(sorted(weight_map.items()))}, indent=1) + "\n")
    return weight_map


def read_tensors(directory: Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The named tensors of an export's shards (the index says which shard holds each)."""
    file = directory / INDEX
    try:
        weight_map = json.loads(file.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{file} is not a safetensors index ({err}): export the mixture again") from err
    by_file: dict[str, list[str]] = {}
    for name in names:
        if name not in weight_map:
            raise ValueError(f"{file} names no weight {name!r}")
        shard = weight_map[name]
        if "/" in shard or shard.startswith(".") or not shard.endswith(".safetensors"):
            raise ValueError(f"{file}: weight {name!r} is in {shard!r}, not a safetensors file of the directory")
        by_file.setdefault(shard, []).append(name)
    out = {}
    for shard, wanted in by_file.items():
        with safe_open(str(directory / shard), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in wanted})
    return out


def load_path_model(directory: Path, *, path: int, modules: dict[str, str]) -> LlamaForCausalLM:
    """Path `path` of the export in `directory` built from its modules ({module: stored name}) in the shards,
    the architecture and the grid from the top-level config.json."""
    hub = read_hub_config(directory)
    config = LlamaConfig(**{k: v for k, v in hub["llama"].items() if k not in ("model_type", "architectures")})
    model = LlamaForCausalLM(config)
    topology = Topology(levels=tuple(hub["levels"]), level_blocks=tuple(tuple(b) for b in hub["level_blocks"]),
                        private_blocks=frozenset(hub["private_blocks"]), private_embeddings=hub["private_embeddings"],
                        replicas=hub["replicas"])
    names = {}
    for param in dict(model.named_parameters()):
        module = topology.module_of_param(param, path)
        if module not in modules:
            raise ValueError(f"{directory / MANIFEST_NAME}: path {path} names no stored module for {module!r}")
        names[grid_name(modules[module], param)] = param
    state = {names[k]: v for k, v in read_tensors(directory, names).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{directory}: path {path}'s modules miss {missing[:3]} (extra {unexpected[:3]})")
    model.config.use_cache = True
    return model


def load_hub_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """The tokenizer at an export's top level, loaded as the fast tokenizer it is: `AutoTokenizer` would read
    config.json first, whose `auto_map` makes transformers ask whether to run the modeling code."""
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load the tokenizer in {directory}: {err}") from err
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {directory} has no eos token")
    return tokenizer


def read_hub_config(directory: Path) -> dict[str, Any]:
    """The top-level config.json of an export (`DipacoConfig`'s fields)."""
    file = directory / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {file}: {err}; export the mixture again") from err
    if not isinstance(data, dict) or data.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{file}: field 'model_type' is not {MODEL_TYPE!r}; export the mixture again")
    missing = [k for k in ("llama", "levels", "level_blocks", "private_blocks", "private_embeddings", "replicas")
               if k not in data]
    if missing:
        raise ValueError(f"{file}: fields {missing} are missing; export the mixture again")
    return data


def hub_router(router) -> tuple[dict[str, Any] | None, dict[str, np.ndarray], str | None]:
    """The router as `modeling_dipaco` computes it: (its description for config.json, its arrays, None),
    or (None, {}, why) when modeling_dipaco cannot reproduce its featurizer (likelihood routing then)."""
    feat_tensors, feat_meta = router.featurizer.state_dict()
    name = feat_meta["name"]
    tensors: dict[str, np.ndarray] = {f"centroids.{i}": c for i, c in enumerate(router.centroids)}
    description: dict[str, Any] = {"featurizer": name, "method": router.method, "levels": list(router.levels),
                                   "slices": [list(s) for s in router.slices]}
    if name == "tfidf":
        if feat_meta.get("vectorizer") != TFIDF_VECTORIZER:
            return None, {}, f"its TF-IDF settings {feat_meta.get('vectorizer')} are not {TFIDF_VECTORIZER}"
        description["vocabulary"] = feat_meta["vocabulary"]
        tensors.update(idf=feat_tensors["idf"], components=feat_tensors["components"])
    elif getattr(router.featurizer, "location", None) is not None:
        description.update(model="featurizer", max_tokens=feat_meta["max_tokens"])
    else:
        return None, {}, f"its featurizer {name!r} is not one modeling_dipaco computes"
    if router.penalties is not None:
        tensors["penalties"] = router.penalties
    if router.linear is not None:
        tensors["linear.weight"], tensors["linear.bias"] = router.linear
    description["tensors"] = {k: list(v.shape) for k, v in tensors.items()}
    return description, tensors, None


def llama_dict(config) -> dict[str, Any]:
    """A LlamaConfig as a dict both transformers 4 (`rope_theta`, `rope_scaling`) and 5 (`rope_parameters`) read."""
    data = config.to_diff_dict() if hasattr(config, "to_diff_dict") else dict(config)
    rope = data.get("rope_parameters") or getattr(config, "rope_parameters", None) or {}
    theta = data.get("rope_theta", rope.get("rope_theta", getattr(config, "rope_theta", None)))
    if theta is not None:
        data["rope_theta"] = theta
    data.setdefault("rope_scaling", None)
    data.pop("transformers_version", None)
    return data


def write_hub_config(out: Path, **fields: Any) -> Path:
    """`config.json` for `DipacoConfig` with its `auto_map`, and the two modeling files beside it."""
    for name in MODELING:
        shutil.copyfile(HUB_FILES / name, out / name)
    llama = fields["llama"]
    data = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
            "auto_map": {"AutoConfig": "configuration_dipaco.DipacoConfig",
                         "AutoModelForCausalLM": f"modeling_dipaco.{ARCHITECTURE}"},
            **fields, "eos_token_id": llama.get("eos_token_id"), "pad_token_id": llama.get("pad_token_id"),
            "vocab_size": llama.get("vocab_size"), "tie_word_embeddings": False}
    file = out / "config.json"
    file.write_text(json.dumps(data, indent=1) + "\n")
    return file


def patch_path_config(directory: Path) -> None:
    """A path directory's config.json readable by transformers 4 too (`rope_theta` beside `rope_parameters`)."""
    file = directory / "config.json"
    data = json.loads(file.read_text())
    rope = data.get("rope_parameters") or {}
    if "rope_theta" not in data and "rope_theta" in rope:
        data["rope_theta"] = rope["rope_theta"]
    data.setdefault("rope_scaling", None)
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def clean_tokenizer(directory: Path, *, max_length: int) -> None:
    """tokenizer_config.json without load-time flags written back, and `model_max_length` the sequence length."""
    file = directory / "tokenizer_config.json"
    data = json.loads(file.read_text())
    for key in LOAD_TIME_KEYS:
        data.pop(key, None)
    data["model_max_length"] = max_length
    if data.get("tokenizer_class") == "TokenizersBackend":  # transformers 5's name; 4 knows the fast tokenizer's
        data["tokenizer_class"] = "PreTrainedTokenizerFast"
    file.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def normal_permissions(root: Path) -> None:
    """Directories 0755 and files 0644 (less what the umask takes away) under `root`, `root` included."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for folder, dirs, files in os.walk(root):
        for d in dirs:
            os.chmod(os.path.join(folder, d), 0o777 & ~umask)
        for f in files:
            os.chmod(os.path.join(folder, f), 0o666 & ~umask)
