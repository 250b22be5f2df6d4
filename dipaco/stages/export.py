"""Trained paths as ordinary Hugging Face models, and the whole mixture as one directory (`dipaco export`).

    dipaco export out/demo  --run runs/demo                # the mixture: every path, the router, the tokenizer
    dipaco export out/demo  --run runs/demo --baselines    # ... and the dense baselines (baselines/<name>/)
    dipaco export out/path3 --run runs/demo --path 3       # one path: config.json, model.safetensors, tokenizer

The mixture directory is self-describing (`dipaco_mixture.json`, `dipaco.inference.manifest`) and loads
with `dipaco.load(DIR)`, which routes each prompt to one path (`dipaco.inference.mixture`); `--route
likelihood` makes likelihood routing the mixture's default (a caller can still choose either at load).
The router's featurizer model (`base-model`, `hf`) is copied in, so the directory stands alone. Every
path (one per routed path; with DiLoCo replicas the first replica, the one evaluation loads) is a
Hugging Face directory that loads with no dipaco import:

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("out/demo/path-0003"); tok = AutoTokenizer.from_pretrained("out/demo/path-0003")

`--round R` exports module version R (default the last), `--best` each path's best version by
validation loss (dipaco.eval.early_stopping). `--all` is the mixture (the default; it was once its own
layout with `paths.json`, now `dipaco_mixture.json`). A directory is written whole under a hidden
temporary sibling, then renamed over `out`, so a reader never sees half an export (`dipaco.outputs`):
`out` must be new, empty, or an earlier export (with `--overwrite`), and outside the run directory;
nothing else is touched.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
from pathlib import Path

from dipaco.atomic import write_json
from dipaco.config import Config
from dipaco.inference.manifest import MANIFEST, Manifest, PathEntry, pickled_files, write_manifest
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


def export_mixture(factory: PathFactory, *, rounds: dict[int, int], out: str | os.PathLike, route: str = "router",
                   baselines: bool = False, overwrite: bool = False) -> Path:
    """The whole mixture in `out`: each routed path (`path-0003/`, at `rounds[p]`), the router (`router/`,
    and its featurizer's model in `featurizer/` when it has one), the tokenizer and `dipaco_mixture.json`;
    with `baselines`, the run's dense baselines as Hugging Face directories too (`baselines/<name>/`)."""
    topology = factory.topology
    paths = [topology.representative(q) for q in range(topology.n_routed)]
    with output_dir(out, overwrite=overwrite, protected=_protected(factory), what="dipaco export") as tmp:
        for path in paths:
            _write_path(factory, path=path, round=rounds[path], out=tmp / f"path-{path:04d}")
            log.info("exported path %d (round %d)", path, rounds[path])
        router = factory.router
        router.save(tmp / "router")
        featurizer = _copy_featurizer_model(router.featurizer, tmp / "featurizer")
        factory.tokenizer.save_pretrained(tmp / "tokenizer")
        if baselines:
            _write_baselines(factory, tmp / "baselines")
        manifest = Manifest(
            levels=list(topology.levels), replicas=topology.replicas, prefix_tokens=factory.prefix_tokens,
            max_length=factory.config.sharding.seq_len, tokenizer="tokenizer", router="router",
            featurizer=featurizer, route=route,
            paths={p: PathEntry(dir=f"path-{p:04d}", choice=list(topology.choice(p)), round=rounds[p]) for p in paths})
        write_manifest(tmp, manifest)
    log.info("exported the mixture (%d paths) to %s (%s)", len(paths), out, MANIFEST)
    return Path(out)


def _copy_featurizer_model(featurizer, out: Path) -> str | None:
    """Copy the router's featurizer model into `out` (None for a featurizer without one: TF-IDF); its
    pickled weight files are refused, since loading them would unpickle."""
    source = getattr(featurizer, "location", None)
    if source is None:
        return None
    files = [f for f in Path(source).iterdir() if f.is_file()]
    pickled = pickled_files(Path(source))
    if pickled:
        raise ValueError(f"the router's featurizer model {source} has pickled weight files {pickled}; an export "
                         f"holds safetensors only: save that model with safe_serialization and route again")
    out.mkdir()
    for file in files:
        shutil.copy2(file, out / file.name)
    return out.name


def _write_baselines(factory: PathFactory, out: Path) -> None:
    """Each trained dense baseline of the run as a Hugging Face directory `out/<name>/`."""
    from dipaco.optim.dense import load_dense

    root = factory.run.baselines
    folders = sorted(d for d in root.iterdir() if (d / "summary.json").is_file()) if root.is_dir() else []
    if not folders:
        raise ValueError(f"--baselines: {root} holds no trained baseline; run `dipaco baselines` first")
    for folder in folders:
        model, _ = load_dense(folder, factory.spec)
        model.config.use_cache = True
        model.save_pretrained(out / folder.name, safe_serialization=True)
        factory.tokenizer.save_pretrained(out / folder.name)
        log.info("exported baseline %s", folder.name)


def _protected(factory: PathFactory) -> list[Path]:
    """What an export must not write into: the run directory (and a local store elsewhere)."""
    areas = [factory.run.root]
    if factory.store.is_local:
        areas.append(Path(factory.store.root))
    return areas


def command(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    factory = PathFactory(config, run)
    rounds = chosen_versions(factory, round=args.round, best=args.best)
    if args.path is None:
        if args.all:
            log.info("--all: the whole mixture is what `dipaco export DIR` writes; its index is now %s", MANIFEST)
        out = export_mixture(factory, rounds=rounds, out=args.out, route=args.route, baselines=args.baselines,
                             overwrite=args.overwrite)
        print(f"exported the mixture ({factory.topology.n_routed} paths, the router and the tokenizer) to {out}; "
              f"load it with dipaco.load({str(out)!r})")
        return
    if args.baselines or args.route != "router":
        raise ValueError("--baselines and --route go with the whole mixture, not with --path")
    if not 0 <= args.path < factory.topology.n_paths:
        raise ValueError(f"--path {args.path} is outside 0..{factory.topology.n_paths - 1}")
    out = export_path(factory, path=args.path, round=rounds[args.path], out=args.out, overwrite=args.overwrite)
    print(f"exported path {args.path} (round {rounds[args.path]}) to {out}; "
          f"load it with AutoModelForCausalLM.from_pretrained({str(out)!r})")
