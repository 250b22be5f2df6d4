"""Trained paths as ordinary Hugging Face models (`dipaco export`).

    dipaco export   --run runs/demo --path 3 out/path3     # config.json, model.safetensors, tokenizer
    dipaco export   --run runs/demo --all out/demo         # every path + the router (+ paths.json)

An exported path loads with no dipaco import:

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("out/path3"); tok = AutoTokenizer.from_pretrained("out/path3")

`--round R` exports module version R (default the last), `--best` each path's best version by
validation loss (dipaco.eval.early_stopping). A directory is written whole under a temporary name
(`<out>.tmp`), then renamed over `out`, so a reader never sees half an export.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from dipaco.atomic import write_json
from dipaco.stages.context import PathFactory

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
    write_json(tmp / "dipaco_path.json", info)
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
    factory.router.save(tmp / "router")
    factory.tokenizer.save_pretrained(tmp / "tokenizer")
    index = {"n_paths": factory.topology.n_paths, "levels": list(factory.topology.levels),
             "prefix_tokens": factory.config.routing.prefix_tokens,
             "paths": {str(p): {"dir": f"path-{p:04d}", "round": rounds[p]} for p in range(factory.topology.n_paths)},
             "router": "router", "tokenizer": "tokenizer"}
    write_json(tmp / "paths.json", index)
    _replace_dir(tmp, out)
    return out


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
