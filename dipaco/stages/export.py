"""Trained paths as ordinary Hugging Face models (`dipaco export`).

    dipaco export   --run runs/demo --path 3 out/path3     # config.json, model.safetensors, tokenizer
    dipaco export   --run runs/demo --all out/demo         # every path + the router (+ paths.json)

An exported path loads with no dipaco import:

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("out/path3"); tok = AutoTokenizer.from_pretrained("out/path3")

`--round R` exports module version R (default the last), `--best` each path's best version by
validation loss (dipaco.eval.early_stopping). A directory is written whole under a hidden temporary
sibling, then renamed over `out`, so a reader never sees half an export (`dipaco.outputs`): `out` must
be new, empty, or an earlier export (with `--overwrite`), and outside the run directory; nothing
else is touched.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from dipaco.atomic import write_json
from dipaco.config import Config
from dipaco.outputs import output_dir
from dipaco.pipeline.context import PathFactory, chosen_versions
from dipaco.run_dir import RunDir

log = logging.getLogger(__name__)


def export_path(factory: PathFactory, *, path: int, round: int, out: str | os.PathLike,
                overwrite: bool = False) -> Path:
    """Write path `path` at module version `round` as a Hugging Face model directory `out`."""
    with output_dir(out, overwrite=overwrite, protected=_protected(factory), what="dipaco export") as tmp:
        _write_path(factory, path=path, round=round, out=tmp)
    log.info("exported path %d (round %d) to %s", path, round, out)
    return Path(out)


def _write_path(factory: PathFactory, *, path: int, round: int, out: Path) -> None:
    model = factory.load_path(path=path, round=round)
    model.config.use_cache = True  # generation reuses past keys and values
    model.save_pretrained(out, safe_serialization=True)
    factory.tokenizer.save_pretrained(out)
    topology = factory.topology
    info = {"path": path, "choice": topology.path_label(path), "round": round,
            "modules": topology.modules_of_path(path), "levels": list(topology.levels),
            "prefix_tokens": factory.prefix_tokens}
    write_json(out / "dipaco_path.json", info)


def export_all(factory: PathFactory, *, rounds: dict[int, int], out: str | os.PathLike,
               overwrite: bool = False) -> Path:
    """Every path (`out/path-0003/`, at `rounds[p]`) plus the router (`out/router/`) and `paths.json`."""
    with output_dir(out, overwrite=overwrite, protected=_protected(factory), what="dipaco export --all") as tmp:
        for path in range(factory.topology.n_paths):
            _write_path(factory, path=path, round=rounds[path], out=tmp / f"path-{path:04d}")
            log.info("exported path %d (round %d)", path, rounds[path])
        factory.router.save(tmp / "router")
        factory.tokenizer.save_pretrained(tmp / "tokenizer")
        index = {"n_paths": factory.topology.n_paths, "levels": list(factory.topology.levels),
                 "prefix_tokens": factory.prefix_tokens,
                 "paths": {str(p): {"dir": f"path-{p:04d}", "round": rounds[p]} for p in range(factory.topology.n_paths)},
                 "router": "router", "tokenizer": "tokenizer"}
        write_json(tmp / "paths.json", index)
    return Path(out)


def _protected(factory: PathFactory) -> list[Path]:
    """What an export must not write into: the run directory (and a local store elsewhere)."""
    areas = [factory.run.root]
    if factory.store.is_local:
        areas.append(Path(factory.store.root))
    return areas


def command(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    factory = PathFactory(config, run)
    rounds = chosen_versions(factory, round=args.round, best=args.best)
    if args.all:
        out = export_all(factory, rounds=rounds, out=args.out, overwrite=args.overwrite)
        print(f"exported {factory.topology.n_paths} paths, the router and the tokenizer to {out}")
        return
    if not 0 <= args.path < factory.topology.n_paths:
        raise ValueError(f"--path {args.path} is outside 0..{factory.topology.n_paths - 1}")
    out = export_path(factory, path=args.path, round=rounds[args.path], out=args.out, overwrite=args.overwrite)
    print(f"exported path {args.path} (round {rounds[args.path]}) to {out}; "
          f"load it with AutoModelForCausalLM.from_pretrained({str(out)!r})")
