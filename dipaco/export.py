"""Trained paths as ordinary Hugging Face models, and routed generation.

    dipaco export   --run runs/demo --path 3 out/path3     # config.json, model.safetensors, tokenizer
    dipaco export   --run runs/demo --all out/demo         # every path + the router (+ paths.json)
    dipaco generate --run runs/demo "def fibonacci(n):"    # route the prompt, generate with that path

An exported path loads with no dipaco import:

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("out/path3"); tok = AutoTokenizer.from_pretrained("out/path3")

`--round R` exports module version R (default the last), `--best` each path's best version by
validation loss (dipaco.early_stopping). Directories are written under a temporary name and renamed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from dipaco.paths import PathFactory
from routing.router import Router
from sharding.tokenizer import decode_prefix, encode_batch

log = logging.getLogger(__name__)


def export_path(factory: PathFactory, *, path: int, round: int, out: str | os.PathLike) -> Path:
    """Write path `path` at module version `round` as a Hugging Face model directory `out`."""
    out = Path(out)
    model = factory.load_path(path=path, round=round)
    model.config.use_cache = True  # generation reuses past keys and values
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    factory.tokenizer.save_pretrained(tmp)
    topology = factory.topology
    info = {"path": path, "choice": topology.path_label(path), "round": round,
            "modules": topology.modules_of_path(path), "levels": list(topology.levels),
            "prefix_tokens": factory.config.routing.prefix_tokens}
    (tmp / "dipaco_path.json").write_text(json.dumps(info, indent=1))
    _replace_dir(tmp, out)
    log.info("exported path %d (round %d) to %s", path, round, out)
    return out


def export_all(factory: PathFactory, *, rounds: dict[int, int], out: str | os.PathLike) -> Path:
    """Every path (`out/path-0003/`, at `rounds[p]`) plus the router (`out/router/`) and `paths.json`."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for path in range(factory.topology.n_paths):
        export_path(factory, path=path, round=rounds[path], out=tmp / f"path-{path:04d}")
    load_router(factory).save(tmp / "router")
    factory.tokenizer.save_pretrained(tmp / "tokenizer")
    index = {"n_paths": factory.topology.n_paths, "levels": list(factory.topology.levels),
             "prefix_tokens": factory.config.routing.prefix_tokens,
             "paths": {str(p): {"dir": f"path-{p:04d}", "round": rounds[p]} for p in range(factory.topology.n_paths)},
             "router": "router", "tokenizer": "tokenizer"}
    (tmp / "paths.json").write_text(json.dumps(index, indent=1))
    _replace_dir(tmp, out)
    return out


def load_router(factory: PathFactory) -> Router:
    run = factory.run
    return Router.load(run.require(run.routing / "router.json", "route").parent)


def route_prompt(factory: PathFactory, router: Router, prompt: str) -> int:
    """The path the router picks for a prompt: from the text of its first `routing.prefix_tokens` tokens
    (a shorter prompt is routed whole)."""
    (tokens,) = encode_batch(factory.tokenizer, [prompt])
    return int(router.route([decode_prefix(factory.tokenizer, tokens, factory.config.routing.prefix_tokens)])[0])


@torch.no_grad()
def generate(factory: PathFactory, prompt: str, *, round: int, max_new_tokens: int = 64, temperature: float = 0.0,
             seed: int = 0, rounds: dict[int, int] | None = None) -> tuple[str, int]:
    """Route the prompt, then generate with the chosen path through `transformers`' `generate`.

    Greedy when `temperature` is 0. Returns (the prompt and its continuation as text, the path)."""
    path = route_prompt(factory, load_router(factory), prompt)
    round = rounds[path] if rounds else round
    model = factory.load_path(path=path, round=round)
    model.eval()
    model.config.use_cache = True
    tokenizer = factory.tokenizer
    (tokens,) = encode_batch(tokenizer, [prompt])
    if len(tokens) == 0:
        raise ValueError("the prompt is empty after tokenization; give some text")
    input_ids = torch.as_tensor(np.asarray(tokens)[None], dtype=torch.long)
    torch.manual_seed(seed)
    limit = factory.config.sharding.seq_len - input_ids.shape[1]
    if limit < 1:
        raise ValueError(f"the prompt has {input_ids.shape[1]} tokens; paths see at most sharding.seq_len "
                         f"{factory.config.sharding.seq_len}")
    sample = temperature > 0
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                            max_new_tokens=min(max_new_tokens, limit), do_sample=sample,
                            temperature=temperature if sample else None, top_k=None, top_p=None,
                            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                            else tokenizer.eos_token_id,
                            eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(output[0].tolist(), skip_special_tokens=True), path


def _replace_dir(tmp: Path, out: Path) -> None:
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
